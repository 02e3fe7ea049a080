"""What a damaged torch.save archive still holds (:meth:`TorchZipFormat.recover`).

``torch.save`` writes ``data.pkl`` first, then the small records and the storages in order,
each followed by a data descriptor (its CRC-32 and sizes), and the central directory last. A
file cut short (a preempted job, a full disk, an interrupted download) has lost its directory,
so the records are found by walking their *local* headers from the start: a record counts when
its bytes and its whole descriptor are there and its CRC-32 checks (a record written with its
sizes and CRC in the local header, as ckpttool's writer does, is checked against those). The
walk stops at the first record whose end cannot be found. The tree is then read from
``data.pkl`` by the safe walker, as the reader reads it; a storage whose record is missing or
does not check out is lost, with every tensor that views it.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

from ckpttool.errors import LayoutError, NotACheckpointError, UnrecoverableError
from ckpttool.formats.base import OutTensor, Recovered
from ckpttool.formats.torch_zip.reader import ZIP_ERRORS, find_data_pkl
from ckpttool.formats.torch_zip.writer import StoredTensor, write_torch_object
from ckpttool.formats.torch_zip.zip_index import LOCAL_HEADER, ZIP_STORED, ZipIndex, fold
from ckpttool.model.records import ITEMSIZE, OpaqueObject, StorageRecord, TensorRecord
from ckpttool.pickle.emulation import storage_class_dtype
from ckpttool.pickle.interpreter import load_pickle

_LOCAL_SIGNATURE = b"PK\x03\x04"
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_DESCRIPTOR32 = struct.Struct("<4sLLL")  # signature, CRC-32, compressed and file size
_DESCRIPTOR64 = struct.Struct("<4sLQQ")  # the same with zip64 sizes
_HAS_DESCRIPTOR = 0x8
_CRC_CHUNK = 16 << 20


class LocalRecord(NamedTuple):
    """One record found by its local header: where its bytes are, and whether they check out."""

    name: str
    data_start: int
    size: int
    intact: bool  # bytes whole and CRC-32 checked


def walk_records(view: Any, file_size: int) -> tuple[list[LocalRecord], list[str]]:
    """Every record from the start of the file whose end can be found, and what is wrong."""
    records: list[LocalRecord] = []
    damage: list[str] = []
    at = 0
    while at + LOCAL_HEADER.size <= file_size and view[at : at + 4] == _LOCAL_SIGNATURE:
        (_, _, flags, method, _, _, crc, compressed, _, name_len,
         extra_len) = LOCAL_HEADER.unpack(view[at : at + LOCAL_HEADER.size])  # fmt: skip
        data_start = at + LOCAL_HEADER.size + name_len + extra_len
        if data_start > file_size:
            damage.append(f"the local header at byte {at:,} is cut off")
            return records, damage
        raw = bytes(view[at + LOCAL_HEADER.size : at + LOCAL_HEADER.size + name_len])
        name = raw.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        if method != ZIP_STORED:
            damage.append(f"record {name!r} is compressed (torch never writes that): walk stops")
            return records, damage
        if flags & _HAS_DESCRIPTOR:
            found = _descriptor(view, data_start, file_size)
            if found is None:
                damage.append(
                    f"record {name!r} (from byte {at:,}) is cut short: the file ends before its end"
                )
                return records, damage
            crc, size, end = found
        else:
            size, end = compressed, data_start + compressed
            if end > file_size:
                damage.append(f"record {name!r} (from byte {at:,}) is cut short")
                return records, damage
        intact = _crc(view, data_start, size) == crc
        if not intact:
            damage.append(f"record {name!r}: its bytes do not match its CRC-32 (torn record)")
        records.append(LocalRecord(name, data_start, size, intact))
        at = end
    if at < file_size and view[at : at + 4] != _CENTRAL_SIGNATURE:
        damage.append(f"{file_size - at:,} bytes from byte {at:,} are no whole record")
    elif at >= file_size:
        damage.append("the central directory and end records are missing (file cut short)")
    return records, damage


def _directory_damage(handle: BinaryIO) -> str | None:
    """What is wrong with the central directory of an archive whose records all check out."""
    try:
        ZipIndex(handle)
    except ZIP_ERRORS as error:
        return f"the central directory is cut short or broken ({error})"
    return None


def _descriptor(view: Any, data_start: int, file_size: int) -> tuple[int, int, int] | None:
    """(CRC-32, size, end) of the record whose bytes start at ``data_start``, from the first
    data descriptor after them whose sizes fit; None when the file ends before one."""
    find = view.find
    pos = find(_DESCRIPTOR, data_start)
    while pos >= 0:
        size = pos - data_start
        if pos + _DESCRIPTOR32.size <= file_size:
            _, crc, compressed, inflated = _DESCRIPTOR32.unpack(view[pos : pos + 16])
            end = pos + _DESCRIPTOR32.size
            # a zip64 archive's descriptors have 8-byte sizes: the 16-byte reading of an empty
            # record's fits too, but no record (or the directory) follows it
            if compressed == inflated == size and (
                end == file_size or view[end : end + 2] == b"PK" or pos + 24 > file_size
            ):
                return crc, size, end
        if pos + _DESCRIPTOR64.size <= file_size:
            _, crc, compressed, inflated = _DESCRIPTOR64.unpack(view[pos : pos + 24])
            if compressed == inflated == size:
                return crc, size, pos + _DESCRIPTOR64.size
        pos = find(_DESCRIPTOR, pos + 1)
    return None


def _crc(view: Any, start: int, size: int) -> int:
    crc = 0
    for at in range(start, start + size, _CRC_CHUNK):
        crc = zlib.crc32(view[at : min(at + _CRC_CHUNK, start + size)], crc)
    return crc


def recover_torch_zip(handle: BinaryIO, file_size: int) -> Recovered:
    """The tree of a damaged torch.save archive and the storages whose bytes check out."""
    with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        records, damage = walk_records(view, file_size)
        if not damage:
            broken = _directory_damage(handle)
            if broken is not None:
                damage.append(broken)
        by_name = {record.name: record for record in records}
        try:
            pkl_name = find_data_pkl(list(by_name))
        except NotACheckpointError:
            pkl_name = ""
        pkl = by_name.get(pkl_name)
        if pkl is None or not pkl.intact:
            why = "lost" if pkl is None else "torn (its CRC-32 does not check)"
            raise _no_tree(f"data.pkl is {why}", records)
        prefix = pkl_name[: -len("data.pkl")]
        pickle_bytes = bytes(view[pkl.data_start : pkl.data_start + pkl.size])
        byteorder_record = next(
            (r for r in records if fold(r.name) == fold(prefix + "byteorder")), None
        )
        byteorder = "little"
        if byteorder_record is not None and byteorder_record.intact:
            start = byteorder_record.data_start
            byteorder = bytes(view[start : start + byteorder_record.size]).decode(
                "ascii", "replace"
            )
    if byteorder.strip() != "little":
        raise LayoutError(f"byteorder record says {byteorder!r:.40}: only little-endian is rebuilt")
    data_prefix = prefix + "data/"
    intact = {
        record.name[len(data_prefix) :]: (record.data_start, record.size)
        for record in records
        if record.intact and record.name.startswith(data_prefix)
    }
    storages: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> StorageRecord:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnrecoverableError(f"data.pkl: unexpected persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if not isinstance(numel, int) or numel < 0:
            raise UnrecoverableError(f"data.pkl: storage {key!r:.40} has a bad size {numel!r:.40}")
        key = str(key)
        found = storages.get(key)
        if found is None:
            span = intact.get(key)
            found = storages[key] = StorageRecord(
                key, storage_class_dtype(storage_type), numel, str(location),
                data_prefix + key, span[1] if span else 0, "little",
            )  # fmt: skip
        return found

    result = load_pickle(pickle_bytes, persistent_load=persistent_load, refuse_dangerous=True)
    return Recovered(
        format="torch-zip", root=result.root, intact=intact, damage=damage, write=write_tree
    )


_LISTED = 3  # intact storage records named in the message (all are in the error's ``intact``)


def _no_tree(what: str, records: list[LocalRecord]) -> UnrecoverableError:
    """The error of an archive whose ``data.pkl`` is gone: how many storage records are intact,
    the first few by name and size (what the bytes were), all of them in ``intact``."""
    stored = [r for r in records if r.intact and "/data/" in f"/{r.name}"]
    if stored:
        named = ", ".join(f"{r.name} ({r.size:,} bytes)" for r in stored[:_LISTED])
        more = f" and {len(stored) - _LISTED:,} more" if len(stored) > _LISTED else ""
        count = (
            "1 storage record is" if len(stored) == 1 else f"{len(stored):,} storage records are"
        )
        intact = f"{count} intact: {named}{more}"
    else:
        intact = "no storage record is intact"
    return UnrecoverableError(
        f"{what}: nothing to rebuild the tree from (resume from the previous checkpoint); "
        + intact,
        [r.name for r in stored],
    )


def write_tree(handle: BinaryIO, root: Any, read: Callable[[str], bytes]) -> None:
    """``root`` written as a torch.save archive: each tensor a contiguous view of a storage
    (tensors viewing the same bytes of one storage share it), non-tensor values as they are."""
    keys: dict[tuple[str, int, int], str] = {}

    def convert(node: Any) -> Any:
        if isinstance(node, TensorRecord):
            return _stored(node, keys)
        if isinstance(node, dict):
            return {key: convert(value) for key, value in node.items()}
        if isinstance(node, list):
            return [convert(value) for value in node]
        if isinstance(node, tuple):
            return tuple(convert(value) for value in node)
        if isinstance(node, OpaqueObject):
            out = OpaqueObject(node.cls, convert(node.args), convert(node.state))
            out.dictitems = convert(node.dictitems)
            out.listitems = convert(node.listitems)
            return out
        return node

    value = convert(root)

    def storages() -> Any:
        for (key, first, nbytes), new_key in keys.items():
            yield new_key, read(key)[first : first + nbytes]

    write_torch_object(handle, value, storages())


def _stored(record: TensorRecord, keys: dict[tuple[str, int, int], str]) -> StoredTensor:
    storage = record.storage
    if (
        storage is None
        or record.inline_data is not None
        or record.parts
        or record.quant is not None
        or record.dtensor is not None
        or record.layout != "strided"
        or record.dtype not in ITEMSIZE
        or not record.is_contiguous
    ):
        raise LayoutError(f"{record.key}: cannot rebuild a {record.dtype} {record.layout} tensor")
    first = record.storage_offset * record.itemsize
    region = (storage.key, first, record.nbytes)
    new_key = keys.setdefault(region, str(len(keys)))
    return StoredTensor(new_key, OutTensor(record.key, record.dtype, tuple(record.shape)))
