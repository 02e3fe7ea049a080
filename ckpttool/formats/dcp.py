"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` plus ``__<rank>_<n>.distcp`` files.

Every rank writes its own data file; each stored item in it is a small ``torch.save`` zip
archive at a byte range the metadata records: a tensor *chunk* (the rank's shard of a tensor,
at some offsets of the global tensor) or a non-tensor *value* (``step``, an optimizer's ``lr``).
This module turns a directory into the reader's tree: a :class:`~ckpttool.records.TensorRecord`
per tensor with its *global* shape and dtype, whose storage is a
:class:`~ckpttool.records.ChunkedStorageRecord` listing the chunks; values read through the
safe unpickler; the nesting rebuilt from ``planner_data`` as ``dcp_to_torch_save`` does.

Nothing is loaded up front but the metadata and the values. Reading a range of a tensor reads
only the chunks (and within them only the rows) that cover it, each through the same zip and
pickle walkers as any torch file (never ``torch.load``), so memory stays bounded by the range
read. Data files are opened on demand, a bounded number at a time.
"""

from __future__ import annotations

import io
import math
import os
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.errors import (
    CkptError,
    CorruptCheckpointError,
    InputError,
    NotACheckpointError,
    ResourceLimitError,
)
from ckpttool.formats.base import DCP_METADATA, Parsed, is_dcp_directory
from ckpttool.formats.dcp_metadata import (
    BytesEntry,
    DcpMetadata,
    StorageSpan,
    TensorEntry,
    nested_tree,
    parse_metadata,
    span_of,
)
from ckpttool.formats.torch_zip import PickleCache, open_zip, read_torch_zip
from ckpttool.formats.zip_index import ZipIndex
from ckpttool.pickle.interpreter import PickleResult, load_pickle
from ckpttool.records import (
    ITEMSIZE,
    ChunkedStorageRecord,
    ChunkRecord,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
)
from ckpttool.source import (
    RangeReader,
    close_member,
    join,
    member_sizes,
    open_member,
    read_range,
    source_size,
)

METADATA = DCP_METADATA
MAX_METADATA = 1 << 30  # as for a torch file's data.pkl
MAX_RAW_VALUE = 64 << 20  # a value stored as raw bytes (a BytesIO, no archive) is kept up to this
MAX_OPEN_FILES = 32  # data files held open at once (a 1024-rank checkpoint has 1024 of them)
# An item's archive up to this size is read with one read and parsed in memory (a chunk's is
# a few hundred bytes plus its tensor's); a larger one is parsed through a window, a range at a
# time, so memory stays bounded by this whatever the chunks hold.
MAX_IN_MEMORY = 1 << 20


def present(span: StorageSpan, sizes: dict[str, int]) -> bool:
    """The item's bytes are in the directory (else its file was reported missing or short)."""
    return span.offset + span.length <= sizes.get(span.file, -1)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _Window(io.RawIOBase):
    """Bytes [base, base + length) of an open file as a file of their own: one item's archive,
    read a range at a time (one too large to hold in memory at once: ``MAX_IN_MEMORY``)."""

    def __init__(self, fd: int | RangeReader, base: int, length: int) -> None:
        super().__init__()
        self._fd, self._base, self._length, self._pos = fd, base, length, 0

    def fileno(self) -> int:
        # The whole data file's descriptor (torch_zip sizes a handle with fstat): a bound
        # looser than the window's that never rejects a valid archive. Offsets in the window
        # are relative to its start: read through read()/seek(), not os.pread on this fd.
        if not isinstance(self._fd, int):
            raise io.UnsupportedOperation("a window of a remote file has no descriptor")
        return self._fd

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._pos)
        if count <= 0:
            return 0
        data = read_range(self._fd, count, self._base + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class _RemoteWindow(_Window):
    """A window of a remote data file: sized by the window itself (it has no descriptor)."""

    @property
    def size(self) -> int:
        return self._length

    def read_range(self, offset: int, length: int) -> bytearray:
        return read_range(self._fd, min(length, self._length - offset), self._base + offset)


def _window(source: int | RangeReader, base: int, length: int) -> _Window:
    return (
        _Window(source, base, length)
        if isinstance(source, int)
        else _RemoteWindow(source, base, length)
    )


class _ArchiveBytes(io.BytesIO):
    """A small item's archive, read whole with one read and parsed from memory.

    A DCP chunk's archive is a few hundred bytes: parsing it through a window took a dozen
    small reads (end record, directory, local headers, data.pkl), half of the cost of reading
    a chunk. ``source_size`` takes its ``size``: the bound a window gives the zip reader's
    checks (the whole data file's size for a local file, the archive's for a remote one), so
    every archive reads as it does through a window.
    """

    def __init__(self, data: bytearray, size: int) -> None:
        super().__init__(data)
        self.size = size

    def read_range(self, offset: int, length: int) -> bytearray:
        """Bytes of the archive (only what it holds: ``size`` may bound more)."""
        offset = max(0, offset)
        with self.getbuffer() as view:
            return bytearray(view[offset : offset + max(0, length)])


class DcpFiles:
    """The data files of one DCP directory: opened on demand, parsed item by item, closed."""

    def __init__(self, directory: Path | str, sizes: dict[str, int]) -> None:
        self.directory = directory  # a local directory, or a URL (str)
        self.sizes = sizes  # data file -> size, for the files that exist
        self._fds: OrderedDict[str, int | RangeReader] = OrderedDict()
        # each chunk's tensor as checked, and where its bytes start (keyed by the chunk alone: a
        # pair key was 6 MB at 100,000 chunks; the dtype it was checked against is the record's)
        self._chunks: dict[ChunkRecord, tuple[TensorRecord, int]] = {}
        self.pickles = PickleCache()  # chunk archives' data.pkl walks (identical pickles)

    def fd(self, name: str) -> int | RangeReader:
        if name in self._fds:
            self._fds.move_to_end(name)
            return self._fds[name]
        if name not in self.sizes:
            raise CorruptCheckpointError(f"{self.directory}: data file {name} is missing")
        try:
            fd = open_member(str(self.directory), name)
        except OSError as error:
            where = join(str(self.directory), name)
            raise InputError(f"{where}: cannot open ({error.strerror})") from None
        self._fds[name] = fd
        if len(self._fds) > MAX_OPEN_FILES:
            close_member(self._fds.popitem(last=False)[1])
        return fd

    def pread(self, name: str, offset: int, length: int) -> bytearray:
        data = read_range(self.fd(name), length, offset)
        if len(data) != length:
            raise CorruptCheckpointError(f"{name} ends inside an item's bytes (truncated)")
        return data

    def _item(self, fd: int | RangeReader, span: StorageSpan) -> BinaryIO:
        """The archive at ``span`` of ``fd`` as a file of its own: in memory if small, else a
        window. A read that fails or comes back short (the file shrank) leaves it to the
        window, so the zip reader meets that error where and as it always did."""
        if span.length <= MAX_IN_MEMORY:
            try:
                data = read_range(fd, span.length, span.offset)
                bound = os.fstat(fd).st_size if isinstance(fd, int) else span.length
            except OSError:
                data, bound = bytearray(), -1
            if len(data) == span.length and bound >= 0:
                return _ArchiveBytes(data, bound)
        return io.BufferedReader(_window(fd, span.offset, span.length))

    def zip_directory(self, span: StorageSpan) -> ZipIndex:
        """The zip directory of the archive at ``span`` (offsets relative to its start)."""
        return open_zip(self._item(self.fd(span.file), span))

    def archive(
        self,
        span: StorageSpan,
        *,
        refuse_dangerous: bool = True,
        shared: bool = False,
        directory: ZipIndex | None = None,
    ) -> Parsed:
        """The torch.save archive stored at ``span``, parsed (spans relative to its start).

        ``shared``: its pickle's walk may be shared with other archives' (a tensor chunk's,
        whose tree is only read; see :class:`~ckpttool.formats.torch_zip.PickleCache`).
        ``directory``: what :meth:`zip_directory` gave for ``span``, not to read it twice.
        """
        if span.offset + span.length > self.sizes.get(span.file, -1):
            raise CorruptCheckpointError(f"{span}: past the end of {span.file} (truncated)")
        fd = self.fd(span.file)
        try:
            return read_torch_zip(
                self._item(fd, span) if directory is None else directory.handle,
                refuse_dangerous=refuse_dangerous,
                track_spans=False,
                cache=self.pickles if shared else None,
                directory=directory,
            )
        except CkptError as error:  # inside a DCP directory, "not a checkpoint" is corruption
            kind = CorruptCheckpointError if isinstance(error, NotACheckpointError) else type(error)
            raise kind(f"{span}: {error}") from None

    def chunk_tensor(
        self, chunk: ChunkRecord, storage: StorageRecord, parsed: Parsed | None = None
    ) -> tuple[TensorRecord, int]:
        """The chunk's tensor as its archive describes it, and where its storage's bytes start
        (``parsed``: the chunk's archive, if the caller has already parsed it)."""
        cached = self._chunks.get(chunk)
        if cached is None or cached[0].dtype != storage.dtype:  # (a chunk of two tensors)
            span = span_of(chunk)
            if parsed is None:
                parsed = self.archive(span, shared=True)
            record = parsed.root
            if not isinstance(record, TensorRecord) or record.storage is None:
                raise CorruptCheckpointError(f"{span}: holds no tensor chunk")
            start, length = parsed.span(record.storage)
            where = f"{storage.key}: the chunk at {list(chunk.offsets)} in {span}"
            if (record.dtype, record.shape) != (storage.dtype, chunk.sizes):
                raise CorruptCheckpointError(
                    f"{where} is {record.dtype}{list(record.shape)}, the metadata says "
                    f"{storage.dtype}{list(chunk.sizes)}"
                )
            if record.extent * record.itemsize > min(record.storage.nbytes, length):
                raise CorruptCheckpointError(f"{where} reaches past its storage's bytes")
            if record.storage.byteorder != "little":
                raise CorruptCheckpointError(f"{where} is big-endian, which ckpttool does not read")
            cached = (record, chunk.offset + start)
            self._chunks[chunk] = cached
        return cached

    def _chunk_rows(self, chunk: ChunkRecord, storage: StorageRecord, first: int, stop: int) -> Any:
        """Rows [first, stop) of a chunk (its first dimension) as a NumPy array of raw items."""
        import numpy as np

        record, base = self.chunk_tensor(chunk, storage)
        shape, stride, offset = record.shape, record.stride, record.storage_offset
        if shape:  # the rows' view of the chunk (no record copied for it: one per chunk read)
            shape = (stop - first, *shape[1:])
            offset += first * stride[0]
        extent = offset  # as TensorRecord.extent, of that view
        if math.prod(shape):
            extent += 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        itemsize = record.itemsize
        start = offset * itemsize
        data = self.pread(chunk.file, base + start, extent * itemsize - start)
        return np.lib.stride_tricks.as_strided(
            np.frombuffer(data, dtype=f"V{itemsize}"),
            shape=shape,
            strides=tuple(s * itemsize for s in stride),
            writeable=False,
        )

    def _whole_chunk(
        self, chunk: ChunkRecord, storage: ChunkedStorageRecord, start: int, length: int
    ) -> bytearray | None:
        """``length`` bytes from byte ``start`` of a tensor stored as one contiguous chunk: one
        read, no NumPy (most tensors of a checkpoint that was not sharded). None if the chunk
        is a part of its tensor or strided: rows are assembled then."""
        if chunk.sizes != storage.shape or any(chunk.offsets):
            return None
        record, base = self.chunk_tensor(chunk, storage)
        if record.stride != contiguous_stride(record.shape):
            return None
        at = base + record.storage_offset * record.itemsize + start
        return self.pread(chunk.file, at, length)

    def read(self, storage: StorageRecord, start: int, stop: int) -> bytearray:
        """Bytes [start, stop) of a chunked tensor as if stored whole, contiguous, in one file.

        Only the rows of the global tensor that hold the range are assembled, from the chunks
        that cover them; each chunk contributes only those rows.
        """
        import numpy as np

        if not isinstance(storage, ChunkedStorageRecord):
            raise CorruptCheckpointError(f"{storage.key}: not a chunked storage")
        itemsize = ITEMSIZE.get(storage.dtype, 1)
        first, last = start // itemsize, -(-stop // itemsize)
        shape = storage.shape or (1,)
        row = math.prod(shape[1:])
        if last <= first or row == 0:
            return bytearray(stop - start)
        row_first, row_stop = first // row, -(-last // row)
        needed = []  # (chunk, its first and last row inside [row_first, row_stop))
        for chunk in storage.chunks:
            offsets, sizes = chunk.offsets or (0,), chunk.sizes or (1,)
            low, high = max(row_first, offsets[0]), min(row_stop, offsets[0] + sizes[0])
            if low < high and chunk.numel:
                if not present(span_of(chunk), self.sizes):
                    raise CorruptCheckpointError(
                        f"{storage.key}: {chunk.file} is missing or shorter than its items"
                    )
                needed.append((chunk, low, high))
        if len(storage.chunks) == 1 and needed and start >= 0 and stop <= storage.nbytes:
            # from the first whole item, as the rows below are cut
            whole = self._whole_chunk(needed[0][0], storage, first * itemsize, stop - start)
            if whole is not None:
                return whole
        buffer = bytearray((row_stop - row_first) * row * itemsize)
        rows = np.frombuffer(buffer, dtype=f"V{itemsize}").reshape(row_stop - row_first, *shape[1:])
        covered = 0
        for chunk, low, high in needed:
            offsets, sizes = chunk.offsets or (0,), chunk.sizes or (1,)
            piece = self._chunk_rows(chunk, storage, low - offsets[0], high - offsets[0])
            inner = (slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
            where = (slice(low - row_first, high - row_first), *inner)
            rows[where] = piece.reshape(rows[where].shape)
            covered += piece.size
        if covered != rows.size:
            raise CorruptCheckpointError(f"{storage.key}: its chunks do not cover the tensor")
        skip = (first - row_first * row) * itemsize
        if skip == 0 and len(buffer) == stop - start:
            return buffer
        return buffer[skip : skip + stop - start]

    def close(self) -> None:
        while self._fds:
            close_member(self._fds.popitem()[1])


def load_metadata(handle: BinaryIO, *, refuse_dangerous: bool) -> tuple[PickleResult, DcpMetadata]:
    """Walk ``.metadata`` with the safe unpickler (runs nothing) and interpret it."""
    size = source_size(handle)
    if size > MAX_METADATA:
        raise ResourceLimitError(f".metadata has {size:,} bytes")
    # compact: its entries as dcp_call's records, which parse_metadata reads
    result = load_pickle(handle.read(), refuse_dangerous=refuse_dangerous, compact=True)
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
    )  # fmt: skip


def data_size(directory: Path, parsed: Parsed) -> int:
    """Bytes on disk: ``.metadata`` and the data files it refers to."""
    files = parsed.details.get("files", {})
    return (directory / METADATA).stat().st_size + sum(s for s in files.values() if s)


__all__ = ["METADATA", "DcpFiles", "is_dcp_directory", "load_metadata", "read_dcp"]
