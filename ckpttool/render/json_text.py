"""``--json`` output as text: indented where a person reads it, one line per record below.

``json.dumps(value, indent=2)`` runs json's pure-Python encoder (the C one handles only
``indent=None``), which was the largest single cost of ``show --json`` on a checkpoint of 100,000
tensors, and puts every field of every tensor on a line of its own. :func:`dumps` indents the
first ``depth`` levels (the report's fields, its lists) and writes each value below them, a
tensor's record for one, on one line with the C encoder. The text parses to the same value as
``json.dumps``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

_INLINE = json.JSONEncoder(separators=(", ", ": "))


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


def _key(key: Any) -> str:
    """A dict key as json writes it (it turns ``True``, ``None``, numbers into strings)."""
    if not isinstance(key, str):
        # json's own key rule (TypeError for other types), applied through a one-key dict
        return _INLINE.encode({key: 0})[1:-4]
    return _INLINE.encode(key)
