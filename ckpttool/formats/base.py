"""What every format reader returns to :mod:`ckpttool.checkpoint`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpttool.model.records import StorageRecord
from ckpttool.pickle.interpreter import PickleResult

#: The file a torch.distributed.checkpoint directory is recognised by (written last by DCP).
DCP_METADATA = ".metadata"


def is_dcp_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (checked without importing its reader)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


@dataclass
class Parsed:
    format: str  # "torch-zip", "torch-legacy", "safetensors", "pickle", "dcp"
    root: Any  # the object tree (records.py types and plain values)
    span: Callable[[StorageRecord], tuple[int, int]]  # storage -> (file offset, byte length)
    pickle: PickleResult | None = None
    details: dict[str, Any] = field(default_factory=dict)  # format facts shown by `show`
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    storages: list[StorageRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # found in non-strict mode
    # For storages that are not one span of one file (DCP's chunked storages): bytes
    # [start, stop) of the storage, assembled; and what to close with the checkpoint.
    read: Callable[[StorageRecord, int, int], bytearray] | None = None
    close: Callable[[], None] | None = None
    # For a checkpoint assembled from several remote files: raise if one of them changed.
    unchanged: Callable[[], None] | None = None
    # The format's own index, parsed (DCP: its DcpMetadata), for verify not to parse it again.
    index: Any = None


def no_span(storage: StorageRecord) -> tuple[int, int]:
    raise ValueError(f"storage {storage.key!r} has no bytes in this file")


def read_at(fd: int, length: int, offset: int) -> bytearray:
    """``length`` bytes at ``offset``, fewer only at the end of the file.

    One ``pread`` moves at most 2 GiB on Linux (a bf16 embedding of a large model is more), so
    this loops until the bytes are there or the file ends.
    """
    data = bytearray(length)
    view = memoryview(data)
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    view.release()
    del data[done:]
    return data
