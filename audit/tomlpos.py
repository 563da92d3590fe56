"""Line numbers for TOML errors (tomllib reports positions only for syntax errors)."""
from __future__ import annotations

import re


def header_lines(text: str, header: str) -> list[int]:
    """1-based lines of every table header such as ``[[pin]]``, in file order."""
    return [i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(header)]


def key_line(text: str, body_start: int, key: str) -> int | None:
    """1-based line of ``key = ...`` in the table body beginning at 1-based line ``body_start``
    (1 for top-level keys). Falls back to the table's header line, or None at top level."""
    lines = text.splitlines()
    for i in range(max(body_start - 1, 0), len(lines)):
        stripped = lines[i].strip()
        if stripped.startswith("["):
            break
        if re.match(rf"^{re.escape(key)}\s*=", stripped):
            return i + 1
    return body_start - 1 if body_start > 1 else None
