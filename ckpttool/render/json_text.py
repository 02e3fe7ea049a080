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
from typing import Any

_INLINE = json.JSONEncoder(separators=(", ", ": "))


def dumps(value: Any, depth: int = 2, indent: int = 2) -> str:
    """JSON text of ``value``: containers nested less than ``depth`` deep on several lines."""
    parts: list[str] = []
    _emit(value, 0, depth, indent, parts)
    return "".join(parts)


def _emit(value: Any, level: int, depth: int, indent: int, out: list[str]) -> None:
    if level >= depth or not value or not isinstance(value, (dict, list, tuple)):
        out.append(_INLINE.encode(value))
        return
    inner = "\n" + " " * (indent * (level + 1))
    if isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + inner + _key(key) + ": ")
            _emit(item, level + 1, depth, indent, out)
        out.append("\n" + " " * (indent * level) + "}")
        return
    out.append("[")
    for i, item in enumerate(value):
        out.append(("," if i else "") + inner)
        _emit(item, level + 1, depth, indent, out)
    out.append("\n" + " " * (indent * level) + "]")


def _key(key: Any) -> str:
    """A dict key as json writes it (it turns ``True``, ``None``, numbers into strings)."""
    if not isinstance(key, str):
        # json's own key rule (TypeError for other types), applied through a one-key dict
        return _INLINE.encode({key: 0})[1:-4]
    return _INLINE.encode(key)
