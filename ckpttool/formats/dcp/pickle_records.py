"""The compact records the walker's DCP fast path (:mod:`ckpttool.formats.dcp.pickle_call`) makes of a
``.metadata`` pickle's entries (what stands in the memo for the objects they replace, and the
``Redo`` signal, are the walker's: :mod:`ckpttool.pickle.hooks`).

They hold what :mod:`ckpttool.formats.dcp.metadata` reads of each entry, and what ``finalize``
would have counted for the objects they replace (``nodes``, ``depth``, ``shared``).
"""

from __future__ import annotations

from typing import Any

from ckpttool.pickle.hooks import ELIDED, Redo


class TensorMeta:
    """A ``TensorStorageMetadata``: dtype name ("torch.float32"), requires_grad, global size,
    and each chunk's (offsets, sizes)."""

    __slots__ = ("chunks", "depth", "dtype", "nodes", "requires_grad", "shared", "size")

    def __init__(
        self,
        dtype: str,
        requires_grad: Any,
        size: tuple[int, ...],
        chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
        nodes: int,
        shared: tuple[Any, ...],
    ) -> None:
        self.dtype, self.requires_grad, self.size, self.chunks = dtype, requires_grad, size, chunks
        self.nodes, self.shared, self.depth = nodes, shared, 7


class IndexMeta:
    """A ``MetadataIndex`` (a ``storage_data`` key): fqn, chunk offset, chunk position. A field
    the pickle left out is None, as the state dict's ``get`` would give."""

    __slots__ = ("depth", "fqn", "index", "nodes", "offset", "shared")

    def __init__(self, fields: dict[str, Any], nodes: int, shared: tuple[Any, ...]) -> None:
        self.fqn, self.offset, self.index = (
            fields.get("fqn"),
            fields.get("offset"),
            fields.get("index"),
        )
        self.nodes, self.shared, self.depth = nodes, shared, 3


class InfoMeta:
    """A ``_StorageInfo`` (a ``storage_data`` value): data file, offset, length; no transforms."""

    __slots__ = ("depth", "length", "nodes", "offset", "relative_path", "shared")

    def __init__(self, fields: dict[str, Any], nodes: int, shared: tuple[Any, ...]) -> None:
        self.relative_path = fields.get("relative_path")
        self.offset, self.length = fields.get("offset"), fields.get("length")
        self.nodes, self.shared, self.depth = nodes, shared, 3


#: The record types, for the walker's checks.
COMPACT = (TensorMeta, IndexMeta, InfoMeta)


__all__ = ["COMPACT", "ELIDED", "IndexMeta", "InfoMeta", "Redo", "TensorMeta"]
