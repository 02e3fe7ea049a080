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

import os
import struct
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, NamedTuple

from ckpttool.errors import CkptError, LayoutError, NotACheckpointError, UnrecoverableError
from ckpttool.formats.base import CHECKPOINT_SUFFIXES, OutTensor, Recovered
from ckpttool.formats.torch_zip.kinds import TORCH_ZIP, archive_kind, has_pt2_folders
from ckpttool.formats.torch_zip.reader import ZIP_ERRORS, find_data_pkl, open_zip, refuse_other_kind
from ckpttool.formats.torch_zip.writer import (
    CopiedStorage,
    NumpyArray,
    StorageBytes,
    StoredTensor,
    write_torch_object,
)
from ckpttool.formats.torch_zip.zip_index import LOCAL_HEADER, ZIP_STORED, ZipIndex, fold
from ckpttool.io.crc import crc32
from ckpttool.model.records import (
    ITEMSIZE,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    rebuildable_storage,
)
from ckpttool.pickle.emulation import storage_class_dtype
from ckpttool.pickle.interpreter import load_pickle

_LOCAL_SIGNATURE = b"PK\x03\x04"
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_DESCRIPTOR32 = struct.Struct("<4sLLL")  # signature, CRC-32, compressed and file size
_DESCRIPTOR64 = struct.Struct("<4sLQQ")  # the same with zip64 sizes
_HAS_DESCRIPTOR = 0x8
_WINDOW = 4 << 20  # bytes of the file read, searched and checked at a time


class LocalRecord(NamedTuple):
    """One record found by its local header: where its bytes are, and whether they check out."""

    name: str
    data_start: int
    size: int
    intact: bool  # bytes whole and CRC-32 checked
    crc: int = 0  # the CRC-32 its bytes have (when intact)


def walk_records(
    fd: int, file_size: int, expected: dict[str, int] | None = None, *, stop_after: int = -1
) -> tuple[list[LocalRecord], list[str]]:
    """Every record from the start of the file whose end can be found, and what is wrong
    (``stop_after``: only that many records).

    One pass over the bytes, read a window at a time (nothing mapped, memory bounded). A
    record whose size ``expected`` gives (a storage, from ``data.pkl``) is checked for its data
    descriptor right after that many bytes; any other record's bytes are searched for the
    descriptor that ends it, its CRC-32 computed as they go.
    """
    expected = expected or {}
    records: list[LocalRecord] = []
    damage: list[str] = []
    at = 0
    while at + LOCAL_HEADER.size <= file_size and os.pread(fd, 4, at) == _LOCAL_SIGNATURE:
        if len(records) == stop_after:
            return records, damage
        (_, _, flags, method, _, _, crc, compressed, _, name_len,
         extra_len) = LOCAL_HEADER.unpack(os.pread(fd, LOCAL_HEADER.size, at))  # fmt: skip
        data_start = at + LOCAL_HEADER.size + name_len + extra_len
        if data_start > file_size:
            damage.append(f"the local header at byte {at:,} is cut off")
            return records, damage
        raw = os.pread(fd, name_len, at + LOCAL_HEADER.size)
        name = raw.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        if archive_kind([name]) != TORCH_ZIP:
            refuse_other_kind([name])  # the reader's refusal of another loader's archive
        if method != ZIP_STORED:
            damage.append(f"record {name!r} is compressed (torch never writes that): walk stops")
            return records, damage
        if flags & _HAS_DESCRIPTOR:
            found = _at_expected_size(fd, data_start, expected.get(name), file_size)
            if found is None:
                found = _scan(fd, data_start, file_size)
            if found is None:
                damage.append(
                    f"record {name!r} (from byte {at:,}) is cut short: the file ends before its end"
                )
                return records, damage
            crc, size, end, computed = found
        else:
            size, end = compressed, data_start + compressed
            if end > file_size:
                damage.append(f"record {name!r} (from byte {at:,}) is cut short")
                return records, damage
            computed = _crc(fd, data_start, size)
        intact = computed == crc
        if not intact:
            damage.append(f"record {name!r}: its bytes do not match its CRC-32 (torn record)")
        records.append(LocalRecord(name, data_start, size, intact, crc))
        at = end
    if at < file_size and os.pread(fd, 4, at) != _CENTRAL_SIGNATURE:
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


def _scan(fd: int, data_start: int, file_size: int) -> tuple[int, int, int, int] | None:
    """(stored CRC-32, size, end, CRC-32 of the bytes) of the record whose bytes start at
    ``data_start``, ended by the first data descriptor after them whose sizes fit; None when
    the file ends before one. The bytes are read once, a window at a time: searched for the
    descriptor's signature and folded into the CRC as they go."""
    running, at = 0, data_start  # CRC-32 of the bytes in [data_start, at)
    buffer = bytearray(_WINDOW + len(_DESCRIPTOR) - 1)
    while at < file_size:
        want = min(len(buffer), file_size - at)
        view = memoryview(buffer)[:want]
        got = os.preadv(fd, [view], at)
        if got <= 0:
            return None
        view = view[:got]
        step = min(_WINDOW, got)  # a signature may start in the window and end after it
        pos = buffer.find(_DESCRIPTOR, 0, got)
        while 0 <= pos < step:
            found = _descriptor_at(fd, at + pos, data_start, file_size)
            if found is not None:
                crc, end = found
                return crc, at + pos - data_start, end, crc32(view[:pos], running)
            pos = buffer.find(_DESCRIPTOR, pos + 1, got)
        running = crc32(view[:step], running)
        at += step
    return None


def _at_expected_size(
    fd: int, data_start: int, size: int | None, file_size: int
) -> tuple[int, int, int, int] | None:
    """What :func:`_scan` finds, when the record's data descriptor is right after ``size``
    bytes (no search); None when it is not (the caller searches)."""
    if size is None or data_start + size > file_size:
        return None
    found = _descriptor_at(fd, data_start + size, data_start, file_size)
    if found is None:
        return None
    crc, end = found
    return crc, size, end, _crc(fd, data_start, size)


def _descriptor_at(fd: int, pos: int, data_start: int, file_size: int) -> tuple[int, int] | None:
    """(stored CRC-32, end) when a data descriptor whose sizes fit the record's bytes
    ``[data_start, pos)`` starts at ``pos``, else None."""
    size = pos - data_start
    raw = os.pread(fd, _DESCRIPTOR64.size + 2, pos)
    if len(raw) >= _DESCRIPTOR32.size:
        _, crc, compressed, inflated = _DESCRIPTOR32.unpack(raw[: _DESCRIPTOR32.size])
        end = pos + _DESCRIPTOR32.size
        # a zip64 archive's descriptors have 8-byte sizes: the 16-byte reading of an empty
        # record's fits too, but no record (or the directory) follows it
        if compressed == inflated == size and (
            end == file_size or raw[16:18] == b"PK" or pos + 24 > file_size
        ):
            return crc, end
    if len(raw) >= _DESCRIPTOR64.size:
        _, crc, compressed, inflated = _DESCRIPTOR64.unpack(raw[: _DESCRIPTOR64.size])
        if compressed == inflated == size:
            return crc, pos + _DESCRIPTOR64.size
    return None


def _crc(fd: int, start: int, size: int) -> int:
    """CRC-32 of ``size`` bytes of the file from ``start``, read a window at a time."""
    crc, buffer = 0, bytearray(min(_WINDOW, size))
    for at in range(start, start + size, _WINDOW):
        view = memoryview(buffer)[: min(_WINDOW, start + size - at)]
        got = os.preadv(fd, [view], at)
        crc = crc32(view[:got], crc)
    return crc


def _listed(handle: BinaryIO, found: dict[str, Any]) -> list[str]:
    """The record names the walk found, and those the zip's directory lists when it reads."""
    try:
        return [*found, *open_zip(handle).namelist()]
    except CkptError:
        return list(found)


def recover_torch_zip(handle: BinaryIO, file_size: int) -> Recovered:
    """The tree of a damaged torch.save archive and the storages whose bytes check out."""
    fd = handle.fileno()
    first, _ = walk_records(fd, file_size, stop_after=1)
    tree = None
    if first and first[0].intact and _is_data_pkl(first[0].name):  # as torch writes it
        tree = _Tree(os.pread(fd, first[0].size, first[0].data_start), first[0].name)
    records, damage = walk_records(fd, file_size, tree.expected if tree else None)
    if not damage:
        broken = _directory_damage(handle)
        if broken is not None:
            damage.append(broken)
    by_name = {record.name: record for record in records}
    refuse_other_kind(list(by_name))  # a .pt2 or a package is no damaged torch.save file
    try:
        pkl_name = find_data_pkl(list(by_name))
    except NotACheckpointError:
        if has_pt2_folders(by_name):  # a .pt2 cut before its archive_format record
            refuse_other_kind([f"{next(iter(by_name)).split('/', 1)[0]}/archive_format"])
        if any(fold(name).endswith(CHECKPOINT_SUFFIXES) for name in _listed(handle, by_name)):
            raise NotACheckpointError(  # stable-baselines3's model.zip: no data.pkl to lose
                "a zip of checkpoint files, not one torch.save file: this command rewrites one "
                "checkpoint file (unzip it and name one; convert --component NAME takes a part)"
            ) from None
        pkl_name = ""
    pkl = by_name.get(pkl_name)
    if pkl is None or not pkl.intact:
        why = "lost" if pkl is None else "torn (its CRC-32 does not check)"
        raise _no_tree(f"data.pkl is {why}", records)
    prefix = pkl_name[: -len("data.pkl")]
    pickle_bytes = os.pread(fd, pkl.size, pkl.data_start)
    byteorder_record = next(
        (r for r in records if fold(r.name) == fold(prefix + "byteorder")), None
    )
    byteorder = "little"
    if byteorder_record is not None and byteorder_record.intact:
        start = byteorder_record.data_start
        byteorder = os.pread(fd, byteorder_record.size, start).decode("ascii", "replace")
    if byteorder.strip() != "little":
        raise LayoutError(f"byteorder record says {byteorder!r:.40}: only little-endian is rebuilt")
    data_prefix = prefix + "data/"
    intact = {
        record.name[len(data_prefix) :]: (record.data_start, record.size)
        for record in records
        if record.intact and record.name.startswith(data_prefix)
    }
    if tree is None or tree.name != pkl_name:
        tree = _Tree(pickle_bytes, pkl_name)
    copies = {
        record.name[len(data_prefix) :]: CopiedStorage(
            handle.fileno(), record.data_start, record.size, record.crc
        )
        for record in records
        if record.intact and record.name.startswith(data_prefix)
    }
    return Recovered(
        format="torch-zip", root=tree.root, intact=intact, damage=damage,
        write=_tree_writer(copies), crcs={key: copy.crc for key, copy in copies.items()},
    )  # fmt: skip


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


def _is_data_pkl(name: str) -> bool:
    prefix, _, base = name.rpartition("/")
    return base == "data.pkl" and "/" not in prefix


class _Tree:
    """``data.pkl`` read by the safe walker: the tree (every storage as ``data.pkl`` claims
    it), and each storage record's size by record name (``expected``)."""

    def __init__(self, pickle_bytes: bytes, name: str) -> None:
        self.name = name
        data_prefix = name[: -len("data.pkl")] + "data/"
        storages: dict[str, StorageRecord] = {}

        def persistent_load(pid: Any) -> StorageRecord:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise UnrecoverableError(f"data.pkl: unexpected persistent id {pid!r:.80}")
            _, storage_type, key, location, numel = pid
            if not isinstance(numel, int) or numel < 0:
                raise UnrecoverableError(
                    f"data.pkl: storage {key!r:.40} has a bad size {numel!r:.40}"
                )
            key = str(key)
            found = storages.get(key)
            if found is None:
                dtype = storage_class_dtype(storage_type)
                nbytes = numel * ITEMSIZE.get(dtype, 1)
                found = storages[key] = StorageRecord(
                    key, dtype, numel, str(location), data_prefix + key, nbytes, "little"
                )
            return found

        result = load_pickle(pickle_bytes, persistent_load=persistent_load, refuse_dangerous=True)
        self.root = result.root
        self.expected = {record.record: record.nbytes for record in storages.values()}


def _tree_writer(copies: dict[str, CopiedStorage]) -> Callable[..., None]:
    """:func:`write_tree` with the storages that checked out (``copies``, by storage key)
    copied from the source file in the kernel; other storages (taken from elsewhere) come from
    ``read``."""

    def write(handle: BinaryIO, root: Any, read: Callable[[str], bytes]) -> None:
        write_tree(handle, root, read, copies=copies)

    return write


def write_tree(
    handle: BinaryIO,
    root: Any,
    read: Callable[[str], bytes],
    *,
    copies: dict[str, CopiedStorage] | None = None,
) -> None:
    """``root`` written as a torch.save archive, every tensor the same view (offset, shape,
    stride) of the same storage as in the source, each storage whole (tensors that shared one
    share it again); non-tensor values as they are. A storage's bytes are ``copies[key]``
    (a range of the source, copied in the kernel) where given, else ``read(key)``."""
    used: dict[str, str] = {}  # storage key -> its key in the output ("0", "1"... as torch)
    # one written object per object of the tree: a tied weight, a shared submodule stay one
    converted: dict[int, tuple[Any, Any]] = {}  # id -> (the node, kept alive; its output)

    def convert(node: Any) -> Any:
        if isinstance(node, (TensorRecord, OpaqueObject)):
            known = converted.get(id(node))
            if known is None:
                known = converted[id(node)] = (node, convert_once(node))
            return known[1]
        return convert_once(node)

    def convert_once(node: Any) -> Any:
        if isinstance(node, TensorRecord):
            if node.kind == "ndarray" and node.inline_data is not None:  # bytes in data.pkl
                return _numpy(node)
            return _stored(node, used)
        if isinstance(node, dict):
            return {key: convert(value) for key, value in node.items()}
        if isinstance(node, list):
            return [convert(value) for value in node]
        if isinstance(node, tuple):
            return tuple(convert(value) for value in node)
        if isinstance(node, OpaqueObject):
            out = node.rebuilt(convert(node.args), convert(node.state))
            out.dictitems = convert(node.dictitems)
            out.listitems = convert(node.listitems)
            return out
        return node

    value = convert(root)
    copies = copies or {}

    def storages() -> Iterator[tuple[str, StorageBytes]]:
        for key, new_key in used.items():
            copy = copies.get(key)
            yield new_key, copy if copy is not None else read(key)

    write_torch_object(handle, value, storages())


def _numpy(record: TensorRecord) -> NumpyArray:
    assert record.inline_data is not None and record.storage is not None
    fortran = len(record.shape) > 1 and not record.is_contiguous
    little = record.storage.byteorder != "big"
    return NumpyArray(record.dtype, little, tuple(record.shape), fortran, record.inline_data)


def _stored(record: TensorRecord, used: dict[str, str]) -> StoredTensor:
    storage = rebuildable_storage(record)
    return StoredTensor(
        used.setdefault(storage.key, str(len(used))),
        OutTensor(record.key, record.dtype, tuple(record.shape)),
        storage_offset=record.storage_offset,
        stride=tuple(record.stride),
        storage_numel=storage.nbytes // ITEMSIZE[record.dtype],
        parameter=record.kind == "parameter",
        requires_grad=record.requires_grad,
    )
