"""Reading the harness's TOML inputs, and line numbers for their errors (tomllib reports positions
only for syntax errors)."""
from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path


def read_toml(path: str | Path, error: type, *, hint: str | None = None) -> tuple[str, dict]:
    """(text, data) of a TOML file; unreadable or malformed files raise ``error`` (an InputFileError
    subclass) with the path and, for syntax errors, the line."""
    spath = str(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error("file not found", path=spath, hint=hint) from None
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}", path=spath, hint=hint) from None
    if not stat.S_ISREG(mode):  # a FIFO would block the read forever, a directory cannot be read
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise error(f"is {kind}, not a TOML file", path=spath, hint=hint)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error("file not found", path=spath, hint=hint) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read: {getattr(exc, 'strerror', None) or exc}", path=spath, hint=hint) from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        raise error(f"not valid TOML: {exc}", path=spath, line=int(m.group(1)) if m else None) from None


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
