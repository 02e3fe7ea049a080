"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` plus ``__<rank>_<n>.distcp`` files.

Every rank writes its own data file; each stored item in it is a small ``torch.save`` zip
archive at a byte range the metadata records: a tensor *chunk* (the rank's shard of a tensor,
at some offsets of the global tensor) or a non-tensor *value* (``step``, an optimizer's ``lr``).
This module turns a directory into the reader's tree: a :class:`~ckpttool.model.records.TensorRecord`
per tensor with its *global* shape and dtype, whose storage is a
:class:`~ckpttool.model.records.ChunkedStorageRecord` listing the chunks; values read through the
safe unpickler; the nesting rebuilt from ``planner_data`` as ``dcp_to_torch_save`` does.

Nothing is loaded up front but the metadata and the values. Reading a range of a tensor reads
only the chunks (and within them only the rows) that cover it, each through the same zip and
pickle walkers as any torch file (never ``torch.load``), so memory stays bounded by the range
read. Data files are opened on demand, a bounded number at a time (:mod:`.dcp_files`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.errors import CorruptCheckpointError, ResourceLimitError
from ckpttool.formats.base import Parsed
from ckpttool.formats.dcp.files import DcpFiles, contiguous_stride, present
from ckpttool.formats.dcp.metadata import (
    BytesEntry,
    DcpMetadata,
    TensorEntry,
    nested_tree,
    parse_metadata,
)
from ckpttool.formats.dcp.names import DCP_METADATA, is_dcp_directory
from ckpttool.formats.dcp.pickle_call import DCP_CALL
from ckpttool.io.source import member_sizes, source_size
from ckpttool.model.records import (
    ITEMSIZE,
    ChunkedStorageRecord,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
)
from ckpttool.pickle.interpreter import PickleResult, load_pickle

METADATA = DCP_METADATA
MAX_METADATA = 1 << 30  # as for a torch file's data.pkl
MAX_RAW_VALUE = 64 << 20  # a value stored as raw bytes (a BytesIO, no archive) is kept up to this


def load_metadata(handle: BinaryIO, *, refuse_dangerous: bool) -> tuple[PickleResult, DcpMetadata]:
    """Walk ``.metadata`` with the safe unpickler (runs nothing) and interpret it."""
    size = source_size(handle)
    if size > MAX_METADATA:
        raise ResourceLimitError(f".metadata has {size:,} bytes")
    # compact: its entries as dcp_call's records, which parse_metadata reads
    result = load_pickle(handle.read(), refuse_dangerous=refuse_dangerous, compact=DCP_CALL)
    meta = parse_metadata(result.root)
    result.root = None  # the walked tree: 70 MB at 100,000 entries, and read only here
    return result, meta


def _file_problems(meta: DcpMetadata, sizes: dict[str, int]) -> list[str]:
    """Missing data files, and files shorter or longer than the items they should hold."""
    ends: dict[str, int] = {}
    for span in meta.spans():
        ends[span.file] = max(ends.get(span.file, 0), span.offset + span.length)
    problems = []
    for name, end in sorted(ends.items()):
        if name not in sizes:
            problems.append(f"data file {name} is missing (it should hold {end:,} bytes)")
        elif sizes[name] < end:
            problems.append(
                f"data file {name} has {sizes[name]:,} bytes but its items reach byte {end:,} "
                "(truncated: an interrupted copy or save?)"
            )
        elif sizes[name] > end:
            problems.append(f"data file {name} has {sizes[name] - end:,} bytes after its last item")
    return problems


def _value(files: DcpFiles, entry: BytesEntry, refuse_dangerous: bool, seen: list[Any]) -> Any:
    """A non-tensor entry: its torch.save archive walked safely (tensors in it kept inline)."""
    span = entry.span
    if span is None:
        return None
    if span.transforms:
        raise CorruptCheckpointError(f"{entry.fqn}: stored through {list(span.transforms)}")
    if files.pread(span.file, span.offset, min(4, span.length)) != b"PK\x03\x04":
        if span.length > MAX_RAW_VALUE:
            raise ResourceLimitError(f"{entry.fqn}: a raw value of {span.length:,} bytes")
        return bytes(files.pread(span.file, span.offset, span.length))  # raw (older DCP BytesIO)
    parsed = files.archive(span, refuse_dangerous=refuse_dangerous)
    if parsed.pickle is not None:
        seen.extend(parsed.pickle.globals_seen)
    inline: dict[StorageRecord, bytes] = {}
    for storage in parsed.storages:
        offset, length = parsed.span(storage)
        data = files.pread(span.file, span.offset + offset, min(length, storage.nbytes))
        inline[storage] = bytes(data)
    return _inline_tensors(parsed.root, inline)


def _inline_tensors(node: Any, inline: dict[StorageRecord, bytes]) -> Any:
    """Give tensors inside a value their bytes (they live in that small archive only)."""
    if isinstance(node, TensorRecord) and node.storage in inline:
        return replace(node, inline_data=inline[node.storage])
    if isinstance(node, dict):
        return {k: _inline_tensors(v, inline) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_inline_tensors(v, inline) for v in node)
    if isinstance(node, OpaqueObject) and inline:
        node.state = _inline_tensors(node.state, inline)
        node.args = _inline_tensors(node.args, inline)
        node.dictitems = _inline_tensors(node.dictitems, inline)
        node.listitems = _inline_tensors(node.listitems, inline)
    return node


def tensor_record(
    entry: TensorEntry, strides: dict[tuple[int, ...], tuple[int, ...]] | None = None
) -> TensorRecord:
    """A DCP tensor as the reader's record: global shape, contiguous, chunked storage (its
    record "dcp": found by its key). ``strides``: shape -> stride, shared by the records made."""
    numel = math.prod(entry.shape)
    storage = ChunkedStorageRecord(
        key=entry.fqn,
        dtype=entry.dtype,
        numel=numel,
        location="cpu",
        record="dcp",
        data_size=numel * ITEMSIZE[entry.dtype],
        chunks=entry.chunks,
        shape=entry.shape,
    )
    stride = strides.get(entry.shape) if strides is not None else None
    if stride is None:
        stride = contiguous_stride(entry.shape)
        if strides is not None:
            strides[entry.shape] = stride
    return TensorRecord("", entry.dtype, entry.shape, stride, 0, storage, entry.requires_grad)


def read_dcp(
    directory: Path | str, handle: BinaryIO, *, strict: bool, refuse_dangerous: bool
) -> Parsed:
    """Parse a DCP directory (local, or a URL) whose open ``.metadata`` is ``handle``. See the
    module doc."""
    result, meta = load_metadata(handle, refuse_dangerous=refuse_dangerous)
    sizes = member_sizes(str(directory), list(meta.files))
    problems = meta.problems + _file_problems(meta, sizes)
    if problems and strict:
        raise CorruptCheckpointError(f"{directory}: {problems[0]}")
    files = DcpFiles(directory, sizes)
    values: dict[str, Any] = {}
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}
    try:
        for entry in meta.entries:
            if isinstance(entry, TensorEntry):
                values[entry.fqn] = tensor_record(entry, strides)
                continue
            if entry.span is not None and not present(entry.span, sizes):
                values[entry.fqn] = None  # its file is missing or short: reported above
                continue
            try:
                values[entry.fqn] = _value(files, entry, refuse_dangerous, result.globals_seen)
            except CorruptCheckpointError as error:
                if strict:
                    raise
                problems.append(str(error))
                values[entry.fqn] = None
        root = nested_tree(meta, values)
        meta.paths.clear()  # read by nested_tree only (two objects an entry)
    except BaseException:
        files.close()
        raise
    chunks = sum(len(e.chunks) for e in meta.entries if isinstance(e, TensorEntry))
    details = {
        "version": meta.version,
        "files": {name: sizes.get(name) for name in meta.files},
        "tensor_chunks": chunks,
        "values": sum(isinstance(e, BytesEntry) for e in meta.entries),
    }

    def no_span(storage: StorageRecord) -> tuple[int, int]:
        raise CorruptCheckpointError(f"{storage.key}: stored in chunks, not as one byte range")

    return Parsed(
        format="dcp", root=root, span=no_span, pickle=result, details=details,
        problems=problems, read=files.read, close=files.close, index=meta,
        concurrent_reads=True,  # DcpFiles.read takes one thread at a time
    )  # fmt: skip


def data_size(directory: Path, parsed: Parsed) -> int:
    """Bytes on disk: ``.metadata`` and the data files it refers to."""
    files = parsed.details.get("files", {})
    return (directory / METADATA).stat().st_size + sum(s for s in files.values() if s)


__all__ = [
    "METADATA", "DcpFiles", "is_dcp_directory", "load_metadata", "present", "read_dcp",
    "tensor_record",
]  # fmt: skip
