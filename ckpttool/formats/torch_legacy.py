"""torch's legacy (non-zip) format: torch < 1.6 or ``_use_new_zipfile_serialization=False``.

A stream of pickles: magic number, protocol version, sys info, the object, the list of storage
keys; then each storage in that order as an 8-byte little-endian element count followed by its
raw bytes. Storage offsets are found by hopping over those counts, never reading the data.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

from ckpttool.errors import CorruptCheckpointError, NotACheckpointError
from ckpttool.formats.base import Parsed
from ckpttool.formats.torch_zip import storage_dtype
from ckpttool.pickle.interpreter import TruncatedPickleError, load_pickle
from ckpttool.records import ITEMSIZE, StorageRecord, fits_int64
from ckpttool.source import read_range, source_of

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
# The first pickle of a legacy file: PROTO 2, LONG1 of 10 bytes holding MAGIC_NUMBER.
MAGIC_PREFIX = b"\x80\x02\x8a\x0a" + MAGIC_NUMBER.to_bytes(10, "little")


FIRST_WINDOW = 1 << 24  # the pickles of a legacy file come first and are small

T = TypeVar("T")


def read_growing(handle: BinaryIO, file_size: int, parse: Callable[[bytes], T]) -> T:
    """Run ``parse`` on the file's first bytes, reading more only while the pickle needs it.

    The tensor data that follows a legacy file's pickles is never read.
    """
    window = min(FIRST_WINDOW, file_size)
    while True:
        handle.seek(0)
        data = handle.read(window)
        try:
            return parse(data)
        except TruncatedPickleError:
            if window >= file_size:
                raise
            window = min(window * 4, file_size)


def read_torch_legacy(
    handle: BinaryIO, file_size: int, *, refuse_dangerous: bool, track_spans: bool
) -> Parsed:
    return read_growing(
        handle,
        file_size,
        lambda data: _read_legacy(data, handle, file_size, refuse_dangerous, track_spans),
    )


def _read_legacy(
    data: bytes, handle: BinaryIO, file_size: int, refuse_dangerous: bool, track_spans: bool
) -> Parsed:
    magic = load_pickle(data, 0)
    if magic.root != MAGIC_NUMBER:
        raise NotACheckpointError("not a torch legacy file (wrong magic number)")
    protocol = load_pickle(data, magic.end)
    if protocol.root != PROTOCOL_VERSION:
        raise CorruptCheckpointError(f"unsupported legacy protocol version {protocol.root!r}")
    sys_info = load_pickle(data, protocol.end)
    info = sys_info.root if isinstance(sys_info.root, dict) else {}
    byteorder = "little" if info.get("little_endian", True) else "big"
    object_start = sys_info.end

    # Pass 1: which storages the object uses (their dtype gives each record's element size).
    claimed: dict[str, tuple[str, int, str]] = {}

    def record_pid(pid: Any) -> Any:
        key, dtype, location, numel = _parse_pid(pid)
        claimed.setdefault(key, (dtype, numel, location))
        return StorageRecord(key, dtype, numel, location, "", 0)

    first = load_pickle(
        data, object_start, persistent_load=record_pid, refuse_dangerous=refuse_dangerous
    )
    keys_result = load_pickle(data, first.end)
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
            raise CorruptCheckpointError(f"file truncated before storage {key!r}")
        (count,) = struct.unpack("<q", count_bytes)
        nbytes = count * ITEMSIZE.get(claimed[key][0], 1)
        if count < 0 or offset + 8 + nbytes > file_size:
            raise CorruptCheckpointError(
                f"legacy storage {key!r} claims {max(count, 0):,} elements but the file ends first"
            )
        spans[key] = (offset + 8, nbytes)
        offset += 8 + nbytes
    missing = set(claimed) - set(spans)
    if missing:
        raise CorruptCheckpointError(f"legacy storages missing from the file: {sorted(missing)}")

    storages: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> StorageRecord:
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
    details = {"byteorder": byteorder, "trailing_bytes": file_size - offset}
    return Parsed(
        format="torch-legacy",
        root=result.root,
        span=lambda storage: spans[storage.key],
        pickle=result,
        details=details,
        storages=list(storages.values()),
    )


def _parse_pid(pid: Any) -> tuple[str, str, str, int]:
    if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
        raise CorruptCheckpointError(f"unexpected legacy persistent id {pid!r:.80}")
    _, storage_type, key, location, numel, view_metadata = pid
    if view_metadata is not None:
        raise CorruptCheckpointError(
            "legacy storage views (files from torch < 0.4) are not supported"
        )
    if not isinstance(numel, int) or numel < 0 or not fits_int64(numel):
        raise CorruptCheckpointError(f"legacy storage {key!r:.80} has a bad size {numel!r:.40}")
    return str(key), storage_dtype(storage_type), str(location), numel
