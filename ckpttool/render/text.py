"""Text helpers every renderer shares: tables, and (from :mod:`ckpttool.model.text`) sizes, counts and short values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpttool.model.text import human_count as human_count
from ckpttool.model.text import human_size as human_size
from ckpttool.model.text import plain as plain
from ckpttool.model.text import plural as plural
from ckpttool.model.text import short as short


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """``tabulate(rows, headers=headers, disable_numparse=True)``: the same text, made here for
    a table of printable ASCII (tabulate's "simple" format, every column left-aligned).

    tabulate spent about 2 s on a table of 100,000 rows. It measures, strips and pads every
    cell in several passes; a table whose every cell is printable ASCII (almost every
    checkpoint's keys) needs one width per column and one format per row, which gives the same
    text. Anything else (no rows, rows of another length than ``headers``, a cell with a line
    break, a tab, an escape code or a non-ASCII character, whose width tabulate measures its
    own way, or a bytes value, which it decodes) goes to tabulate.
    """
    width = len(headers)
    if not rows or any(len(row) != width for row in rows):
        return _tabulate(rows, headers)
    columns = []
    for header, column in zip(headers, zip(*rows)):
        if any(issubclass(kind, bytes) for kind in set(map(type, column))):  # it decodes them
            return _tabulate(rows, headers)
        texts = ["" if value is None else f"{value}" for value in column]
        joined = "".join(texts) + header
        if not (joined.isascii() and joined.isprintable()):
            return _tabulate(rows, headers)
        columns.append([text.strip() for text in texts])
    # tabulate's column width: its widest cell, and at least the header and 2 spaces
    widths = [
        max(max(map(len, column)), len(header) + 2) for header, column in zip(headers, columns)
    ]
    line = "  ".join(f"{{:<{w}}}" for w in widths).format
    lines = [
        line(*headers).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines.extend([line(*cells).rstrip() for cells in zip(*columns)])
    return "\n".join(lines)


def _tabulate(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    from tabulate import tabulate  # only for tables that are not printable ASCII

    return str(tabulate(rows, headers=list(headers), disable_numparse=True))


#: Eighths of a character cell, for bars: " " is none, "█" a whole cell.
BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(value: float | None, top: float, width: int) -> str:
    """``value`` as a bar of block characters, ``width`` cells long at ``top`` (an infinite
    value, or one above ``top``, is a full bar; None or 0: none)."""
    if value is None or value <= 0 or top <= 0:
        return ""
    eighths = width * 8 if value >= top else round(value / top * width * 8)
    eighths = max(eighths, 1)  # anything that changed shows
    full, part = divmod(eighths, 8)
    return (BLOCKS[8] * full + (BLOCKS[part] if part else "")).rstrip()


def with_bars(table_text: str, values: Sequence[float | None], *, title: str = "") -> str:
    """A table (``table``'s text: header, rule, one line per value) with a bar per row after
    its last column, scaled to the largest finite value, as wide as the terminal allows (10 to
    40 cells; 80 columns when the output is not a terminal). No colour: plain characters."""
    import math
    import shutil

    lines = table_text.split("\n")
    used = max(map(len, lines))
    width = max(10, min(40, shutil.get_terminal_size((80, 24)).columns - used - 3))
    finite = [v for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    if top == 0 and any(v == math.inf for v in values):
        top = 1.0
    out = [f"{lines[0].ljust(used)}  {title}".rstrip(), f"{lines[1].ljust(used)}  {'-' * width}"]
    for line, value in zip(lines[2:], values):
        out.append(f"{line.ljust(used)}  {bar(value, top, width)}".rstrip())
    return "\n".join(out)
