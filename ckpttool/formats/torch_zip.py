"""torch.save's zip format (torch >= 1.6): ``<prefix>/data.pkl`` plus one record per storage.

The prefix folder is whatever the writer chose (``archive/``, the file's stem, anything), and
storage keys are any strings. Records are stored uncompressed and 64-byte aligned, so a
storage's bytes can be read in place once its local header has been located.
"""

from __future__ import annotations

import struct
import zipfile
from typing import Any, BinaryIO

from ckpttool.errors import CorruptCheckpointError, NotACheckpointError, ResourceLimitError
from ckpttool.formats.base import Parsed
from ckpttool.pickle_safe import _STORAGE_DTYPES, load_pickle
from ckpttool.records import GlobalRef, StorageRecord

MAX_DATA_PKL = 1 << 30  # 1 GiB of pickle: far beyond any real checkpoint's object tree
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")


def storage_dtype(storage_type: Any) -> str:
    if isinstance(storage_type, GlobalRef) and storage_type.name in _STORAGE_DTYPES:
        return _STORAGE_DTYPES[storage_type.name]
    raise CorruptCheckpointError(f"unknown storage type {storage_type!s} in the pickle")


def is_torchscript(names: list[str]) -> bool:
    return any(n.endswith("constants.pkl") or "/code/" in n or n.startswith("code/") for n in names)


def open_zip(handle: BinaryIO) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(handle)
    except zipfile.BadZipFile as error:
        raise CorruptCheckpointError(
            f"corrupt or truncated zip archive ({error}); an interrupted torch.save leaves "
            "files like this: use the previous checkpoint"
        ) from None


def find_data_pkl(names: list[str]) -> str:
    if is_torchscript(names):
        raise NotACheckpointError(
            "this is a TorchScript archive (torch.jit.save), not a checkpoint: it holds "
            "code, and only torch.jit.load can open it (do so only if you trust it)"
        )
    candidates = [n for n in names if n.endswith("data.pkl") and n.count("/") <= 1]
    candidates = [n for n in candidates if n.rsplit("/", 1)[-1] == "data.pkl"]
    if len(candidates) != 1:
        what = "no data.pkl" if not candidates else f"{len(candidates)} data.pkl records"
        raise NotACheckpointError(f"a zip archive with {what}: not a torch checkpoint")
    return candidates[0]


def read_torch_zip(handle: BinaryIO, *, refuse_dangerous: bool, track_spans: bool) -> Parsed:
    archive = open_zip(handle)
    infos = archive.infolist()
    names = [info.filename for info in infos]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise CorruptCheckpointError(f"the zip archive has two records named {duplicate!r}")
    pkl_name = find_data_pkl(names)
    prefix = pkl_name[: -len("data.pkl")]
    info = archive.getinfo(pkl_name)
    if info.file_size > MAX_DATA_PKL:
        raise ResourceLimitError(f"data.pkl claims {info.file_size:,} bytes")
    try:
        pickle_bytes = archive.read(pkl_name)
        byteorder = "little"
        if prefix + "byteorder" in archive.NameToInfo:
            byteorder = archive.read(prefix + "byteorder").decode("ascii", "replace").strip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise CorruptCheckpointError(f"cannot read {pkl_name}: {error}") from None
    if byteorder not in ("little", "big"):
        raise CorruptCheckpointError(f"byteorder record says {byteorder!r}")

    storages: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> StorageRecord:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        key = str(key)
        if key in storages:
            return storages[key]
        record = f"{prefix}data/{key}"
        member = archive.NameToInfo.get(record)
        if member is None:
            raise CorruptCheckpointError(f"storage {key!r} is missing from the archive")
        if not isinstance(numel, int) or numel < 0:
            raise CorruptCheckpointError(f"storage {key!r} has a bad size {numel!r}")
        storage = StorageRecord(
            key, storage_dtype(storage_type), numel, str(location), record, member.file_size,
            byteorder,
        )  # fmt: skip
        storages[key] = storage
        return storage

    result = load_pickle(
        pickle_bytes,
        persistent_load=persistent_load,
        refuse_dangerous=refuse_dangerous,
        track_spans=track_spans,
    )

    def span(storage: StorageRecord) -> tuple[int, int]:
        return member_span(handle, archive.NameToInfo[storage.record])

    return Parsed(
        format="torch-zip",
        root=result.root,
        span=span,
        pickle=result,
        details={"prefix": prefix.rstrip("/"), "byteorder": byteorder, "records": len(names)},
        storages=list(storages.values()),
    )


def member_span(handle: BinaryIO, info: zipfile.ZipInfo) -> tuple[int, int]:
    """(absolute offset, length) of a stored record's bytes, from its local header."""
    handle.seek(info.header_offset)
    header = handle.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise CorruptCheckpointError(f"record {info.filename!r} is cut off (truncated file)")
    signature, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise CorruptCheckpointError(f"record {info.filename!r} has no local header")
    if method != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(
            f"record {info.filename!r} is compressed; torch never writes that (re-zipped file?)"
        )
    local_name = handle.read(name_len)
    if local_name.decode("utf-8", "replace") != info.filename:
        raise CorruptCheckpointError(
            f"the zip's central directory says {info.filename!r} where the local header "
            f"says {local_name!r}"
        )
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size
