"""Text helpers every renderer shares: sizes and counts for people, JSON-safe and short values."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from ckpttool.model.records import GlobalRef, OpaqueObject, TensorRecord

_UNITS = ("B", "KB", "MB", "GB", "TB")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``noun`` for one, ``nouns`` (default: ``noun`` + "s") for any other count: "1 file",
    "0 files"."""
    return noun if count == 1 else (nouns or noun + "s")


def human_size(n: int | float) -> str:
    size = float(n)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"  # pragma: no cover


def human_count(n: int) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= threshold:
            return f"{n / threshold:.2f}{suffix}"
    return str(n)


def plain(value: Any) -> Any:
    """A JSON-safe rendering of any tree value (tensors as short descriptions)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, TensorRecord):
        return f"<tensor {value.dtype}{list(value.shape)}>"
    if isinstance(value, GlobalRef):
        return str(value)
    if isinstance(value, OpaqueObject):
        return {"__class__": value.cls, **{k: plain(v) for k, v in value.fields().items()}}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return str(value)


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


def short(value: Any, width: int = 60) -> str:
    text = json.dumps(plain(value)) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
