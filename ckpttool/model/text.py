"""Values as people read them: sizes, counts, plurals, short JSON-safe renderings of tree values.

Below every floor that talks to people (the renderers, the progress bar, a framework's lines in
``show``), so that none of them imports the renderers for a number's wording.
"""

from __future__ import annotations

import json
import math
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


def short(value: Any, width: int = 60) -> str:
    text = json.dumps(plain(value)) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
