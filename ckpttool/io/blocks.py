"""Long byte ranges compared, checksummed and copied at memory speed: what ``diff``, ``verify``
and ``convert`` (its writes and its read-back) and ``edit`` do with the bytes of large tensors.

Two things made these paths several times slower than ``cmp`` and ``cat``: a fresh ``bytearray``
per read (zero-filled, then page-faulted in) and comparisons through NumPy (a mask per block).
Here each range is read in blocks of :data:`BLOCK` bytes into reused, page-aligned anonymous
maps (``pread`` into an unaligned heap buffer, or a fresh map, measured slower), and two blocks
are compared with the C library's ``memcmp``. Bytes written as they are in a file are copied by
the kernel (:class:`FileRange`, :func:`copy_range`), never read into memory.

Reading the next block on a second thread while this one is compared or checksummed (``pread``,
``memcmp`` through ctypes and ISA-L's CRC-32 all let go of the GIL) was measured and left out:
on the shared 2-core VM it was slower than reading in turn (bench/README.md, "Throughput").

Memory: two buffers of :data:`BLOCK` bytes per call running at once, whatever the range.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, BinaryIO, NamedTuple

from ckpttool.io.crc import crc32
from ckpttool.io.progress import ProgressCallback

BLOCK = 1 << 20  # bytes per read: 256 KiB and 4 MiB blocks measured slower

#: ``read(offset, into)``: reads up to ``len(into)`` bytes at ``offset`` into ``into``, returns
#: how many (fewer only at the end of the file): :meth:`Checkpoint.read_file_into`.
ReadInto = Callable[[int, memoryview], int]


def equal_ranges(
    read_a: ReadInto,
    start_a: int,
    read_b: ReadInto,
    start_b: int,
    length: int,
    seen: Callable[[memoryview], None] | None = None,
) -> bool:
    """Whether ``length`` bytes from ``start_a`` (through ``read_a``) equal ``length`` bytes from
    ``start_b`` (through ``read_b``); False too when either ends early. Stops at the first
    block that differs. ``seen`` is given each block found equal, in order, while it is in
    memory (``diff --by-module``'s norms: no second read); it must not keep the view."""
    with _buffers() as (buffer_a, buffer_b):
        whole_a, whole_b = memoryview(buffer_a), memoryview(buffer_b)
        try:
            done = 0
            while done < length:
                size = min(BLOCK, length - done)
                if read_a(start_a + done, whole_a[:size]) != size:
                    return False
                if read_b(start_b + done, whole_b[:size]) != size:
                    return False
                if not _same(buffer_a, buffer_b, size):
                    return False
                if seen is not None:
                    block = whole_a[:size]
                    try:
                        seen(block)
                    finally:
                        block.release()
                done += size
        finally:
            whole_a.release()
            whole_b.release()
    return True


def crc_range(
    read: ReadInto, start: int, length: int, progress: ProgressCallback | None = None
) -> int | None:
    """CRC-32 of ``length`` bytes from ``start`` (None: the file ends before)."""
    crc = 0
    with _buffers() as (buffer, _):
        whole = memoryview(buffer)
        try:
            done = 0
            while done < length:
                size = min(BLOCK, length - done)
                view = whole[:size]
                got = read(start + done, view)
                crc = crc32(view[:got], crc)
                view.release()
                if got < size:
                    return None
                done += size
                if progress is not None:
                    progress(size)
        finally:
            whole.release()
    return crc


class FileRange(NamedTuple):
    """Bytes still in a file, for a writer to copy in the kernel (:func:`write_data`) instead
    of reading them into memory and writing them out again (``convert``'s as-is tensors)."""

    fd: int
    offset: int
    length: int


def write_data(handle: BinaryIO, data: bytes | bytearray | memoryview | FileRange) -> None:
    """Write ``data`` at ``handle``'s position: bytes as they are, a :class:`FileRange` copied
    from its file by :func:`copy_range` (the handle flushed first, and moved past them)."""
    if not isinstance(data, FileRange):
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size < _WRITEBACK_MIN:
            handle.write(data)
            return
        handle.flush()
        start = handle.tell()
        handle.write(data)
        handle.flush()  # a large write goes to the file at once: its writeback starts now
        start_writeback(handle.fileno(), start, size)
        return
    handle.flush()
    start = handle.tell()
    copy_range(data.fd, data.offset, handle.fileno(), start, data.length)
    handle.seek(start + data.length)


#: Bytes written by one :func:`write_data` call from which the disk is asked to start on them
#: at once (:func:`start_writeback`); smaller writes are left to the buffered writer.
_WRITEBACK_MIN = 4 << 20
_COPY_CHUNK = 64 << 20  # bytes per copy_file_range call (progress steps)
_FALLBACK_CHUNK = 8 << 20  # buffer of the read/write loop where the kernel cannot copy


def copy_range(
    source_fd: int,
    source_offset: int,
    dest_fd: int,
    dest_offset: int,
    size: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Copy ``size`` bytes between two files at explicit offsets, in the kernel where possible."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    buffer = memoryview(bytearray(0 if use_kernel else _FALLBACK_CHUNK))
    while done < size:
        want = min(_COPY_CHUNK if use_kernel else _FALLBACK_CHUNK, size - done)
        if use_kernel:
            try:
                got = os.copy_file_range(
                    source_fd, dest_fd, want, source_offset + done, dest_offset + done
                )
            except OSError:  # e.g. EXDEV on old kernels, EINVAL on some file systems
                use_kernel = False
                buffer = memoryview(bytearray(_FALLBACK_CHUNK))
                continue
        else:
            got = os.preadv(source_fd, [buffer[:want]], source_offset + done)
            if got > 0:
                written = 0
                while written < got:
                    at = dest_offset + done + written
                    written += os.pwrite(dest_fd, buffer[written:got], at)
        if got <= 0:
            raise EOFError(f"source ends {size - done:,} bytes early")
        start_writeback(dest_fd, dest_offset + done, got)
        done += got
        if progress is not None:
            progress(got)


_sync_file_range: Any = None  # libc's, once looked up; False where there is none


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` to the disk
    now, without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the disk then
    writes while the rest is copied, and the fsync that commits the file has less left to
    wait for. Only a hint: durability still comes from that fsync; a no-op where unsupported."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError, AttributeError):
                function = ctypes.CDLL(None, use_errno=True).sync_file_range
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                function.restype = ctypes.c_int
                _sync_file_range = function
    if _sync_file_range:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; errors ignored


_free: list[mmap.mmap] = []  # buffers of finished calls, for the next one
_free_lock = threading.Lock()


@contextmanager
def _buffers() -> Iterator[list[mmap.mmap]]:
    """Two page-aligned buffers of :data:`BLOCK` bytes, kept for the next call. Safe across
    threads: each call has its own; at most those of the calls running at once are kept."""
    with _free_lock:
        taken = [_free.pop() for _ in range(min(2, len(_free)))]
    taken += [mmap.mmap(-1, BLOCK) for _ in range(2 - len(taken))]
    try:
        yield taken
    finally:
        with _free_lock:
            _free.extend(taken)


def _same(a: mmap.mmap, b: mmap.mmap, size: int) -> bool:
    """The first ``size`` bytes of two buffers are equal (``memcmp``: NumPy's ``array_equal``
    makes a mask per block, and comparing ``bytes`` copies both first)."""
    memcmp = _memcmp()
    if memcmp is None:
        return a[:size] == b[:size]
    import ctypes

    left = ctypes.c_char.from_buffer(a)
    right = ctypes.c_char.from_buffer(b)
    try:
        return bool(memcmp(ctypes.addressof(left), ctypes.addressof(right), size) == 0)
    finally:
        del left, right  # the buffers' exports


@lru_cache(maxsize=1)
def _memcmp() -> Any:
    """The C library's ``memcmp`` (None where ctypes cannot find it: bytes are compared)."""
    import ctypes
    import ctypes.util

    try:  # the symbols the process has loaded (POSIX), else the C library by name
        function = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        try:
            function = ctypes.CDLL(ctypes.util.find_library("c") or "msvcrt").memcmp
        except (OSError, AttributeError):
            return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return function


__all__ = [
    "BLOCK", "FileRange", "ReadInto", "copy_range", "crc_range", "equal_ranges", "write_data",
]  # fmt: skip
