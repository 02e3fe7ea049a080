"""The data files of a torch.distributed.checkpoint (DCP) directory, read item by item.

Every rank writes its own data file (``__0_0.distcp``); each stored item in it is a small
``torch.save`` zip archive at the byte range ``.metadata`` gives. :class:`DcpFiles` opens the
files on demand (a bounded number at a time), parses an item's archive (small ones from one
read, in memory; their pickles' walks shared between archives with identical ``data.pkl``), and
assembles any byte range of a chunked tensor from only the chunks, and rows, that cover it.
"""

from __future__ import annotations

import io
import math
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.errors import CkptError, CorruptCheckpointError, InputError, NotACheckpointError
from ckpttool.formats.base import Parsed
from ckpttool.formats.dcp.metadata import StorageSpan, span_of
from ckpttool.formats.torch_zip.reader import PickleCache, open_zip, read_torch_zip
from ckpttool.formats.torch_zip.zip_index import ZipIndex
from ckpttool.io.source import RangeReader, close_member, join, open_member, read_range
from ckpttool.model.records import (
    ITEMSIZE,
    ChunkedStorageRecord,
    ChunkRecord,
    StorageRecord,
    TensorRecord,
)

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
        # read() and close() may come from several threads (--jobs reads a source ahead of its
        # writer): one at a time, as the handles and caches above are shared
        self._lock = threading.RLock()

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
        whose tree is only read; see :class:`~ckpttool.formats.torch_zip.reader.PickleCache`).
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

    def chunk_values(self, chunk: ChunkRecord, storage: StorageRecord) -> Any:
        """The whole chunk as a NumPy array of raw items shaped as the chunk (a rewrite of it:
        :mod:`.write`)."""
        return self._chunk_rows(chunk, storage, 0, chunk.sizes[0] if chunk.sizes else 1)

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
        that cover them; each chunk contributes only those rows. One thread at a time.
        """
        with self._lock:
            return self._read(storage, start, stop)

    def _read(self, storage: StorageRecord, start: int, stop: int) -> bytearray:
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
        with self._lock:
            while self._fds:
                close_member(self._fds.popitem()[1])


__all__ = ["MAX_IN_MEMORY", "MAX_OPEN_FILES", "DcpFiles", "contiguous_stride", "present"]
