"""torch's legacy (non-zip) format: torch < 1.6 or ``_use_new_zipfile_serialization=False``.

A stream of pickles: magic number, protocol version, sys info, the object, the list of storage
keys; then each storage in that order as an 8-byte little-endian element count followed by its
raw bytes. Storage offsets are found by hopping over those counts, never reading the data.

The stream is recognised as torch recognises it: by what its first pickle holds (the magic
number), in whatever pickle protocol it was written (``torch.save(pickle_protocol=N)``), not by
its first bytes. A pickle whose first value is anything else is a bare pickle
(:func:`read_pickle_stream`). All five pickles are walked, and the globals of each reported:
``torch.load`` unpickles every one of them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

from ckpttool.errors import CUT_HINT, CorruptCheckpointError
from ckpttool.formats.base import Parsed
from ckpttool.io.source import read_range, source_of
from ckpttool.model.records import ITEMSIZE, StorageRecord, fits_int64
from ckpttool.pickle.emulation import storage_class_dtype
from ckpttool.pickle.interpreter import PickleResult, TruncatedPickleError, load_pickle

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


FIRST_WINDOW = 1 << 24  # the pickles of a legacy file come first and are small

T = TypeVar("T")


def read_growing(
    handle: BinaryIO,
    file_size: int,
    parse: Callable[[bytes], T],
    limit: int | None = None,
    first: int = FIRST_WINDOW,
) -> T:
    """Run ``parse`` on the file's first ``first`` bytes, reading more only while the pickle
    needs it (up to ``limit`` bytes, if given).

    The tensor data that follows a legacy file's pickles is never read.
    """
    most = file_size if limit is None else min(file_size, limit)
    window = min(first, most)
    while True:
        handle.seek(0)
        data = handle.read(window)
        try:
            return parse(data)
        except TruncatedPickleError:
            if window >= most:
                raise
            window = min(window * 4, most)


def is_magic(value: Any) -> bool:
    """Whether a first pickle's value is the legacy magic number (``torch.load``'s test)."""
    return type(value) is int and value == MAGIC_NUMBER


def read_pickle_stream(
    handle: BinaryIO,
    file_size: int,
    *,
    refuse_dangerous: bool,
    track_spans: bool,
    limit: int | None = None,
    first: int = FIRST_WINDOW,
) -> Parsed:
    """A file ``torch.load`` reads as a pickle stream: the legacy format when its first pickle
    is the magic number (any protocol), else a bare pickle (its first pickle)."""

    def parse(data: bytes) -> Parsed:
        first = load_pickle(data, 0, refuse_dangerous=refuse_dangerous, track_spans=track_spans)
        if is_magic(first.root):
            return _read_legacy(data, first, handle, file_size, refuse_dangerous, track_spans)
        return _bare_pickle(first, file_size)

    return read_growing(handle, file_size, parse, limit, first)


def _bare_pickle(result: PickleResult, file_size: int) -> Parsed:
    def no_span(storage: StorageRecord) -> tuple[int, int]:
        raise CorruptCheckpointError("a bare pickle has no tensor storage")

    details = {"trailing_bytes": file_size - result.end}
    return Parsed(format="pickle", root=result.root, span=no_span, pickle=result, details=details)


def _read_legacy(
    data: bytes,
    magic: PickleResult,
    handle: BinaryIO,
    file_size: int,
    refuse_dangerous: bool,
    track_spans: bool,
) -> Parsed:
    # every pickle of the stream is walked under the same policy: torch unpickles them all
    protocol = load_pickle(data, magic.end, refuse_dangerous=refuse_dangerous)
    if protocol.root != PROTOCOL_VERSION:
        raise CorruptCheckpointError(f"unsupported legacy protocol version {protocol.root!r}")
    sys_info = load_pickle(data, protocol.end, refuse_dangerous=refuse_dangerous)
    info = sys_info.root if isinstance(sys_info.root, dict) else {}
    byteorder = "little" if info.get("little_endian", True) else "big"
    object_start = sys_info.end

    # Pass 1: which storages the object uses (their dtype gives each record's element size).
    claimed: dict[str, tuple[str, int, str]] = {}

    def record_pid(pid: Any) -> Any:
        cls = module_class(pid)
        if cls is not None:
            return cls
        key, dtype, location, numel = _parse_pid(pid)
        claimed.setdefault(key, (dtype, numel, location))
        return StorageRecord(key, dtype, numel, location, "", 0)

    first = load_pickle(
        data, object_start, persistent_load=record_pid, refuse_dangerous=refuse_dangerous
    )
    keys_result = load_pickle(data, first.end, refuse_dangerous=refuse_dangerous)
    keys = keys_result.root
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CorruptCheckpointError("legacy storage key list is malformed")

    spans: dict[str, tuple[int, int]] = {}
    offset = keys_result.end
    for key in keys:
        if key not in claimed:
            raise CorruptCheckpointError(f"legacy storage {key!r} is not used by the object")
        count_bytes = read_range(source_of(handle), 8, offset)
        if len(count_bytes) != 8:
            raise CorruptCheckpointError(f"file truncated before storage {key!r}{CUT_HINT}")
        (count,) = struct.unpack("<q", count_bytes)
        nbytes = count * ITEMSIZE.get(claimed[key][0], 1)
        if count < 0 or offset + 8 + nbytes > file_size:
            raise CorruptCheckpointError(
                f"legacy storage {key!r} claims {max(count, 0):,} elements but the file ends "
                f"first{CUT_HINT}"
            )
        spans[key] = (offset + 8, nbytes)
        offset += 8 + nbytes
    missing = set(claimed) - set(spans)
    if missing:
        raise CorruptCheckpointError(f"legacy storages missing from the file: {sorted(missing)}")

    storages: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> Any:
        cls = module_class(pid)
        if cls is not None:
            return cls
        key, dtype, location, numel = _parse_pid(pid)
        if key not in storages:
            storages[key] = StorageRecord(
                key, dtype, numel, location, f"legacy:{key}", spans[key][1], byteorder
            )
        return storages[key]

    result = load_pickle(
        data,
        object_start,
        persistent_load=persistent_load,
        refuse_dangerous=refuse_dangerous,
        track_spans=track_spans,
    )
    # the globals of all five pickles, in file order (scan reports them, verify judges them)
    result.globals_seen = [
        *magic.globals_seen, *protocol.globals_seen, *sys_info.globals_seen,
        *result.globals_seen, *keys_result.globals_seen,
    ]  # fmt: skip
    details = {"byteorder": byteorder, "trailing_bytes": file_size - offset}
    return Parsed(
        format="torch-legacy",
        root=result.root,
        span=lambda storage: spans[storage.key],
        pickle=result,
        details=details,
        storages=list(storages.values()),
    )


def module_class(pid: Any) -> Any:
    """The class a ``("module", cls, source_file, source)`` id stands for (None: not one).

    ``torch.save(model)`` in the legacy format saves each module class so, with its source
    for a warning; ``torch.load`` gives the class back: so does this (a global reference)."""
    if isinstance(pid, tuple) and len(pid) == 4 and _ascii(pid[0]) == "module":
        return pid[1]
    return None


def _ascii(value: Any) -> Any:
    """torch decodes a bytes type name or location as ASCII (files pickled by Python 2)."""
    return value.decode("ascii") if isinstance(value, bytes) else value


def _parse_pid(pid: Any) -> tuple[str, str, str, int]:
    if not (isinstance(pid, tuple) and len(pid) == 6 and _ascii(pid[0]) == "storage"):
        raise CorruptCheckpointError(f"unexpected legacy persistent id {pid!r:.80}")
    _, storage_type, key, location, numel, view_metadata = pid
    location = _ascii(location)
    if view_metadata is not None:
        raise CorruptCheckpointError(
            "legacy storage views (files from torch < 0.4) are not supported"
        )
    if not isinstance(numel, int) or numel < 0 or not fits_int64(numel):
        raise CorruptCheckpointError(f"legacy storage {key!r:.80} has a bad size {numel!r:.40}")
    return str(key), storage_class_dtype(storage_type), str(location), numel
