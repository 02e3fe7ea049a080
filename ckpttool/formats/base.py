"""What every format reader returns to :mod:`ckpttool.reader`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpttool.pickle_safe import PickleResult
from ckpttool.records import StorageRecord


@dataclass
class Parsed:
    format: str  # "torch-zip", "torch-legacy", "safetensors", "pickle"
    root: Any  # the object tree (records.py types and plain values)
    span: Callable[[StorageRecord], tuple[int, int]]  # storage -> (file offset, byte length)
    pickle: PickleResult | None = None
    details: dict[str, Any] = field(default_factory=dict)  # format facts shown by `show`
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    storages: list[StorageRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # found in non-strict mode


def no_span(storage: StorageRecord) -> tuple[int, int]:
    raise ValueError(f"storage {storage.key!r} has no bytes in this file")
