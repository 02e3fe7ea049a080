"""``--json`` output as text: indented where a person reads it, one line per record below.

``json.dumps(value, indent=2)`` runs json's pure-Python encoder (the C one handles only
``indent=None``), which was the largest single cost of ``show --json`` on a checkpoint of 100,000
tensors, and puts every field of every tensor on a line of its own. :func:`dumps` indents the
first ``depth`` levels (the report's fields, its lists) and writes each value below them, a
tensor's record for one, on one line with the C encoder. The text parses to the same value as
``json.dumps``'s. A :class:`Rows` stands for a list whose items are made as they are written
(``show --json``'s tensors), so that the text of 100,000 of them is never held at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def _rows_as_list(value: Any) -> Any:
    """The encoder's hook for what it cannot write: a :class:`Rows` below the indented levels
    is written as its list; anything else is refused, as json refuses it."""
    if isinstance(value, Rows):
        return value.values()
    raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")


_INLINE = json.JSONEncoder(separators=(", ", ": "), default=_rows_as_list)


def item_encoder() -> Callable[[Any], str]:
    """``_INLINE.encode`` for many values: its C encoder made once, not once per value (a
    tenth of ``show --json``'s rendering at 100,000 tensors). The same text."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has the C accelerator
        return _INLINE.encode
    encoder = make(
        {},  # markers: circular references are refused, as by _INLINE
        _INLINE.default,
        json.encoder.encode_basestring_ascii,  # ensure_ascii, as _INLINE
        None,
        _INLINE.key_separator,
        _INLINE.item_separator,
        _INLINE.sort_keys,
        _INLINE.skipkeys,
        _INLINE.allow_nan,
    )
    join = "".join

    def encode(value: Any) -> str:
        return join(encoder(value, 0))

    return encode


class Rows:
    """A list whose items are made as they are written: ``make(item)`` for each of ``items``.

    For :func:`dumps` and :func:`chunks` only (``json.dumps`` cannot write it). A report of
    100,000 tensors would otherwise hold 100,000 dicts, one per tensor, while it is written.
    """

    __slots__ = ("items", "make", "text")

    def __init__(
        self,
        items: Sequence[Any],
        make: Callable[[Any], Any],
        text: Callable[[Any], str] | None = None,
    ) -> None:
        self.items = items
        self.make = make
        # an item's JSON text written directly (as the inline encoder writes ``make(item)``)
        self.text = text

    def __len__(self) -> int:
        return len(self.items)

    def values(self) -> list[Any]:
        """The list it stands for."""
        return [self.make(item) for item in self.items]


def dumps(value: Any, depth: int = 2, indent: int = 2) -> str:
    """JSON text of ``value``: containers nested less than ``depth`` deep on several lines."""
    return "".join(_pieces(value, 0, depth, indent))


def chunks(value: Any, depth: int = 2, indent: int = 2, size: int = 1 << 16) -> Iterator[str]:
    """:func:`dumps`'s text in pieces of about ``size`` characters, for writing as it is made:
    at 100,000 tensors the whole text is 23 MB, and the list of its parts as much again."""
    batch: list[str] = []
    length = 0
    for piece in _pieces(value, 0, depth, indent):
        batch.append(piece)
        length += len(piece)
        if length >= size:
            yield "".join(batch)
            batch.clear()
            length = 0
    if batch:
        yield "".join(batch)


def _pieces(value: Any, level: int, depth: int, indent: int) -> Iterator[str]:
    if isinstance(value, Rows):
        if level + 1 == depth and value.items:  # each item on a line of its own
            yield from _rows(value, "\n" + " " * (indent * (level + 1)), level, indent)
            return
        value = value.values()
    if level >= depth or not value or not isinstance(value, (dict, list, tuple)):
        yield _INLINE.encode(value)
        return
    inner = "\n" + " " * (indent * (level + 1))
    if level + 1 >= depth:  # the items are written on one line each: no nested generators
        encode = _INLINE.encode
        if isinstance(value, dict):
            yield "{"
            for i, (key, item) in enumerate(value.items()):
                yield ("," if i else "") + inner + _key(key) + ": " + encode(item)
        else:
            yield "["
            for i, item in enumerate(value):
                yield ("," if i else "") + inner + encode(item)
    elif isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + inner + _key(key) + ": "
            yield from _pieces(item, level + 1, depth, indent)
    else:
        yield "["
        for i, item in enumerate(value):
            yield ("," if i else "") + inner
            yield from _pieces(item, level + 1, depth, indent)
    yield "\n" + " " * (indent * level) + ("}" if isinstance(value, dict) else "]")


def _rows(rows: Rows, inner: str, level: int, indent: int, batch: int = 256) -> Iterator[str]:
    """A :class:`Rows` list, items one per line, its lines joined ``batch`` at a time."""
    items = rows.items
    text = rows.text
    if text is None:
        encode = item_encoder()
        make = rows.make

        def text(item: Any) -> str:
            return encode(make(item))

    separator = "," + inner
    yield "["
    for start in range(0, len(items), batch):
        lines = [text(item) for item in items[start : start + batch]]
        yield (separator if start else inner) + separator.join(lines)
    yield "\n" + " " * (indent * level) + "]"


def _key(key: Any) -> str:
    """A dict key as json writes it (it turns ``True``, ``None``, numbers into strings)."""
    if not isinstance(key, str):
        # json's own key rule (TypeError for other types), applied through a one-key dict
        return _INLINE.encode({key: 0})[1:-4]
    return _INLINE.encode(key)
