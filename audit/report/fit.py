"""Readable widths for rendered markdown: no table cell longer than ``max_cell`` characters and no line wider
than ``width``, without losing a character of what was rendered.

* A table cell that is too long, or the longest cells of a row that is too wide, keep a short head and move
  their full text into a footnote (GitHub's ``[^n]``), defined right after the table; the same text in many
  cells is one footnote.
* A paragraph, list item or quote line that is too wide is wrapped at spaces outside code spans (a soft line
  break in markdown: the same paragraph); a footnote's definition is wrapped the same way, its continuation
  lines indented as markdown wants them.
* Code blocks and headings are left as they are.

Deterministic: the same markdown in gives the same markdown out.
"""
from __future__ import annotations

import re

MAX_CELL = 200
WIDTH = 400
#: the head a moved cell keeps (at most), before its footnote reference
HEAD = 60
#: a cell shorter than this is never moved to a footnote (a wide row of short cells stays wide)
MIN_MOVED = 80

_ROW = re.compile(r"^\|.*\|\s*$")
_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def _cells(row: str) -> list[str]:
    """The cells of a table row, split on pipes not escaped with a backslash."""
    body = row.strip()[1:-1]
    out, cur, i = [], [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            cur.append(body[i:i + 2])
            i += 2
            continue
        if ch == "|":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out


def _safe_cut(text: str, limit: int) -> str:
    """The longest head of *text* up to *limit* characters that ends at a space outside code spans, links and
    emphasis (so the head is valid markdown on its own); "" when there is none."""
    best = ""
    ticks = 0
    depth = 0
    stars = 0
    for i, ch in enumerate(text[:limit]):
        if ch == "`":
            ticks += 1
        elif ticks % 2 == 0 and ch in "[(":
            depth += 1
        elif ticks % 2 == 0 and ch in "])":
            depth = max(depth - 1, 0)
        elif ticks % 2 == 0 and ch == "*":
            stars += 1
        elif ch == " " and ticks % 2 == 0 and depth == 0 and stars % 2 == 0:
            best = text[:i]
    return best.rstrip(" ,;:")


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    """*text* broken at spaces outside code spans into lines of at most *width* (a word longer than that
    stays whole), the first prefixed with *first*, the others with *rest*."""
    words, cur, ticks = [], [], 0
    for ch in text:
        if ch == "`":
            ticks += 1
        if ch == " " and ticks % 2 == 0:
            words.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    words.append("".join(cur))
    lines, line = [], first
    for w in words:
        if not w:
            continue
        prefix_only = line in (first, rest)
        candidate = line + w if prefix_only else f"{line} {w}"
        if len(candidate) > width and not prefix_only:
            lines.append(line)
            line = rest + w
        else:
            line = candidate
    lines.append(line)
    return lines


class _Notes:
    def __init__(self):
        self.by_text: dict[str, int] = {}
        self.pending: list[tuple[int, str]] = []
        self.count = 0

    def ref(self, text: str) -> str:
        if text not in self.by_text:
            self.count += 1
            self.by_text[text] = self.count
            self.pending.append((self.count, text))
        return f"[^{self.by_text[text]}]"

    def flush(self, width: int) -> list[str]:
        out = []
        for n, text in self.pending:
            out += _wrap(text, width, f"[^{n}]: ", "    ")
        self.pending = []
        return out


def _moved(text: str, notes: _Notes, head: int = HEAD) -> str:
    kept = _safe_cut(text, head) if head else ""
    ref = notes.ref(text)
    return f" {kept} … {ref} " if kept else f" {ref} "


def _fit_row(row: str, notes: _Notes, max_cell: int, width: int) -> str:
    original = [c.strip() for c in _cells(row)]
    #: per cell, the head length it was moved with (None: kept whole)
    moved: list[int | None] = [HEAD if len(c) > max_cell else None for c in original]
    cells = [_moved(c, notes) if m is not None else f" {c} " for c, m in zip(original, moved)]
    line = "|" + "|".join(cells) + "|"
    # still too wide: move the longest cells, then shorten the heads of the moved ones, until it fits
    for head in (HEAD, 24, 12, 0):  # a bare reference only when nothing else fits
        while len(line) > width:
            movable = [i for i, c in enumerate(original) if len(c) > max(head + 8, MIN_MOVED - 1)
                       and (moved[i] is None or moved[i] > head)]
            if not movable:
                break
            i = max(movable, key=lambda k: (len(cells[k]), -k))
            moved[i] = head
            cells[i] = _moved(original[i], notes, head)
            line = "|" + "|".join(cells) + "|"
    return line


def fit(markdown: str, *, max_cell: int = MAX_CELL, width: int = WIDTH) -> str:
    notes = _Notes()
    out: list[str] = []
    fence = False
    in_table = False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
        is_row = not fence and bool(_ROW.match(line))
        if in_table and not is_row:
            if notes.pending:
                out += ["", *notes.flush(width)]
                if line.strip():
                    out.append("")
            in_table = False
        if is_row:
            in_table = True
            out.append(line if _SEPARATOR.match(line) else _fit_row(line, notes, max_cell, width))
            continue
        if fence or len(line) <= width or line.lstrip().startswith("#"):
            out.append(line)
            continue
        m = re.match(r"^(\s*(?:[-*] |\d+\. |> )?)", line)
        first = m.group(1)
        rest = "> " if first.strip() == ">" else " " * len(first)
        out += _wrap(line[len(first):], width, first, rest)
    if notes.pending:
        out += ["", *notes.flush(width)]
    return "\n".join(out)
