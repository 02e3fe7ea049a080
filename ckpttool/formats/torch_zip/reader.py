"""torch.save's zip format (torch >= 1.6): ``<prefix>/data.pkl`` plus one record per storage.

The prefix folder is whatever the writer chose (``archive/``, the file's stem, anything), and
storage keys are any strings. Records are stored uncompressed and 64-byte aligned, so a
storage's bytes can be read in place once its local header has been located.
"""

from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

from ckpttool.errors import (
    AmbiguousFileError,
    CorruptCheckpointError,
    NotACheckpointError,
    ResourceLimitError,
)
from ckpttool.formats.base import Parsed
from ckpttool.formats.torch_zip.kinds import (
    TORCH_EXPORT,
    TORCH_PACKAGE,
    TORCHSCRIPT,
    archive_kind,
)
from ckpttool.formats.torch_zip.zip_index import (
    LOCAL_HEADER,
    ZIP_STORED,
    AmbiguousZipError,
    ZipIndex,
    ZipMember,
    case_collision,
    encoded_name,
    fold,
    read_local_header,
)  # fmt: skip
from ckpttool.io.source import source_size
from ckpttool.model.records import StorageRecord, fits_int64
from ckpttool.pickle.emulation import storage_class_dtype
from ckpttool.pickle.interpreter import PersistentLoad, PickleResult, load_pickle

MAX_DATA_PKL = 1 << 30  # 1 GiB of pickle: far beyond any real checkpoint's object tree
# torch stores records uncompressed; a compressed one (a re-zipped file) is inflated in memory,
# so its inflated size is bounded: 300 KB of deflated zeros would otherwise become 300 MB.
MAX_INFLATED = 64 << 20
# What reading a hostile archive can raise: BadZipError (a ValueError), bad names
# (UnicodeDecodeError, a ValueError), short reads, broken deflate streams.
ZIP_ERRORS = (OSError, EOFError, ValueError, struct.error, OverflowError, zlib.error)
# A walk is reused only for pickles up to this size (a DCP chunk's is ~150 bytes), so a cache
# of PICKLE_CACHE_ENTRIES walks holds at most a few hundred KB of keys and small trees.
MAX_CACHED_PICKLE = 4096
PICKLE_CACHE_ENTRIES = 128


class _Walk(NamedTuple):
    """One walk of a pickle: the persistent ids it loaded, in order, what they gave, its result."""

    pids: list[Any]
    storages: list[Any]
    result: PickleResult


class PickleCache:
    """Walks of small ``data.pkl`` pickles, reused for archives whose pickle is the same bytes.

    A DCP directory stores one archive per tensor chunk, and chunks of one shape and dtype
    have byte-identical pickles (100,000 of them in a 100,000-tensor checkpoint): walking each
    was most of the cost of reading a chunk. A walk's result depends on the bytes, the flags,
    and what ``persistent_load`` gives for each persistent id (the archive's storage records:
    member name, size, byteorder). So a walk is reused only after the new archive's own
    ``persistent_load`` ran on every id the first walk loaded, in the same order (every check
    it makes runs again, against this archive), and gave storages equal to the first walk's;
    on any difference or error the pickle is walked in full, so results and error messages are
    exactly those of an uncached read. The trees it hands out are shared: callers must not
    change them (DCP's values, whose tensors get their bytes inlined, are read without it).
    """

    def __init__(self, entries: int = PICKLE_CACHE_ENTRIES) -> None:
        self.entries = entries
        self._walks: OrderedDict[tuple[bytes, bool, bool], _Walk] = OrderedDict()
        self.walks = 0  # full walks of cacheable pickles (a test counts them)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._walks)

    def load(
        self,
        data: bytes,
        persistent_load: PersistentLoad,
        reset: Callable[[], None],
        *,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> PickleResult:
        """``load_pickle(data, ...)``, or an earlier walk's result where that is sound
        (``reset()`` undoes what a replay's ``persistent_load`` calls recorded)."""
        key = (data, refuse_dangerous, track_spans)
        cached = self._walks.get(key)
        if cached is not None:
            try:
                replayed = [persistent_load(pid) for pid in cached.pids]
            except Exception:  # any: the full walk below raises it again, where it would
                replayed = None
            if replayed == cached.storages:
                self._walks.move_to_end(key)
                self.hits += 1
                return cached.result
            reset()
        pids: list[Any] = []
        storages: list[Any] = []

        def recording(pid: Any) -> Any:
            storage = persistent_load(pid)
            pids.append(pid)
            storages.append(storage)
            return storage

        self.walks += 1
        result = load_pickle(
            data,
            persistent_load=recording,
            refuse_dangerous=refuse_dangerous,
            track_spans=track_spans,
        )
        self._walks[key] = _Walk(pids, storages, result)
        self._walks.move_to_end(key)
        if len(self._walks) > self.entries:
            self._walks.popitem(last=False)
        return result


def open_zip(handle: BinaryIO) -> ZipIndex:
    try:
        return ZipIndex(handle)
    except AmbiguousZipError as error:
        raise AmbiguousFileError(f"a zip archive that reads two ways: {error}") from None
    except ZIP_ERRORS as error:
        raise CorruptCheckpointError(
            f"corrupt or truncated zip archive ({error}); an interrupted torch.save leaves "
            "files like this: use the previous checkpoint, or salvage what it still holds with "
            "ckpttool repair"
        ) from None


def refuse_other_kind(names: list[str]) -> None:
    """Refuse, by its name, an archive of another torch loader than ``torch.load``
    (:mod:`ckpttool.formats.torch_zip.kinds`)."""
    kind = archive_kind(names)
    if kind == TORCHSCRIPT:
        raise NotACheckpointError(
            "this is a TorchScript archive (torch.jit.save), not a checkpoint: it holds "
            "code, and only torch.jit.load can open it (do so only if you trust it)"
        )
    if kind == TORCH_EXPORT:
        raise NotACheckpointError(
            "this is a torch.export archive (.pt2, torch.export.save), not a torch.save "
            "checkpoint: ckpttool reads its weights and constants (show, verify, diff, "
            "convert) but does not rewrite or repair it"
        )
    if kind == TORCH_PACKAGE:
        raise NotACheckpointError(
            "this is a torch.package archive (torch.package.PackageExporter), not a torch.save "
            "checkpoint: PackageImporter reads it, importing any Python source it ships "
            "(run `ckpttool scan` on it first)"
        )


def find_data_pkl(names: list[str]) -> str:
    refuse_other_kind(names)
    # torch's reader finds data.pkl whatever its ASCII case (``fold``)
    candidates = [n for n in names if len(n) >= 8 and n.count("/") <= 1]
    candidates = [n for n in candidates if fold(n.rsplit("/", 1)[-1]) == "data.pkl"]
    if len(candidates) != 1:
        what = "no data.pkl" if not candidates else f"{len(candidates)} data.pkl records"
        raise NotACheckpointError(f"a zip archive with {what}: not a torch checkpoint")
    return candidates[0]


def read_torch_zip(
    handle: BinaryIO,
    *,
    refuse_dangerous: bool,
    track_spans: bool,
    cache: PickleCache | None = None,
    directory: ZipIndex | None = None,
) -> Parsed:
    """The archive read through ``handle``: its tree, storages and where their bytes lie.

    With ``cache``, a small pickle's walk may be shared with an earlier archive's (see
    :class:`PickleCache`): the caller must not change the returned tree. ``directory``: the
    zip directory of ``handle``, if the caller has already read it (``open_zip(handle)``).
    """
    archive = open_zip(handle) if directory is None else directory
    infos = archive.infolist()
    names = [info.filename for info in infos]
    if len(archive.NameToInfo) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise CorruptCheckpointError(f"the zip archive has two records named {duplicate!r}")
    collision = case_collision(names)
    if collision is not None:
        raise AmbiguousFileError(ambiguous_names(*collision))
    pkl_name = find_data_pkl(names)
    prefix = pkl_name[: -len("data.pkl")]
    file_size = source_size(handle)
    pickle_bytes = read_record(handle, archive.getinfo(pkl_name), archive, file_size)
    byteorder = "little"
    info = archive.find(prefix + "byteorder")
    if info is not None:
        raw = read_record(handle, info, archive, file_size, limit=64)
        byteorder = raw.decode("ascii", "replace").strip()
    if byteorder not in ("little", "big"):
        raise CorruptCheckpointError(f"byteorder record says {byteorder!r:.40}")

    storages: dict[str, StorageRecord] = {}
    members = archive.NameToInfo
    data_prefix = f"{prefix}data/"

    def persistent_load(pid: Any) -> StorageRecord:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if key.__class__ is not str:
            key = str(key)
        found = storages.get(key)
        if found is not None:
            return found
        record = data_prefix + key
        member = members.get(record) or archive.find(record)
        if member is None:
            raise CorruptCheckpointError(f"storage {key!r} is missing from the archive")
        if not isinstance(numel, int) or numel < 0 or not fits_int64(numel):
            raise CorruptCheckpointError(f"storage {key!r} has a bad size {numel!r:.40}")
        if _data_start_at_least(member) + member.file_size > file_size:
            raise CorruptCheckpointError(
                f"storage record {record!r} claims {member.file_size:,} bytes, past the end of "
                "the file (truncated or tampered file)"
            )
        storage = StorageRecord(  # the member's own name: ``record`` is a copy (8 MB at 100,000)
            key, storage_class_dtype(storage_type), numel, str(location), member.filename,
            member.file_size, byteorder,
        )  # fmt: skip
        storages[key] = storage
        return storage

    if cache is not None and len(pickle_bytes) <= MAX_CACHED_PICKLE:
        result = cache.load(
            pickle_bytes,
            persistent_load,
            storages.clear,
            refuse_dangerous=refuse_dangerous,
            track_spans=track_spans,
        )
    else:
        result = load_pickle(
            pickle_bytes,
            persistent_load=persistent_load,
            refuse_dangerous=refuse_dangerous,
            track_spans=track_spans,
        )

    # each record's local header is read once; its data start is kept (the length is the
    # member's size: a tuple per record was 6 MB at 100,000)
    starts: dict[str, int] = {}

    def span(storage: StorageRecord) -> tuple[int, int]:
        member = members[storage.record]  # the member's own name (persistent_load's)
        start = starts.get(storage.record)
        if start is None:
            start = starts[storage.record] = member_span(handle, member)[0]
        return start, member.file_size

    regions: dict[str, tuple[int, int]] = {}

    def region(storage: StorageRecord) -> tuple[int, int]:
        if not regions:  # only for a remote file's plan (diff, verify and convert of a URL)
            regions.update(archive.regions())
        return regions[members[storage.record].filename]

    def crc(storage: StorageRecord) -> int | None:
        member = members[storage.record]
        stored = member.compress_type == 0 and member.compress_size == member.file_size
        return member.CRC if archive.crc_computed and stored else None

    return Parsed(
        format="torch-zip",
        root=result.root,
        span=span,
        region=region,
        crc=crc,
        pickle=result,
        details={
            "prefix": prefix.rstrip("/"),
            "byteorder": byteorder,
            "records": len(names),
            **({} if archive.crc_computed else {"crc32": "not computed"}),
        },
        storages=list(storages.values()),
    )


def ambiguous_names(first: str, second: str) -> str:
    return (
        f"the zip archive has records {first!r} and {second!r}: torch's reader ignores "
        "case in names, and which of them it reads depends on its search order"
    )


def _data_start_at_least(info: ZipMember) -> int:
    """Where a record's bytes start at the earliest (its local header, no extra field)."""
    return info.header_offset + LOCAL_HEADER.size + len(encoded_name(info))


def read_record(
    handle: BinaryIO,
    info: ZipMember,
    archive: ZipIndex,
    file_size: int,
    limit: int = MAX_DATA_PKL,
    as_torch: bool = False,
) -> bytes:
    """A small record's bytes (data.pkl, byteorder), CRC-checked, within bounded memory
    (``as_torch``: read as ``torch.load`` reads it, :meth:`ZipIndex.read`).

    Refused before anything is allocated: a size the file cannot hold (stored) or an inflated
    size over ``MAX_INFLATED`` (compressed), and anything over ``limit``.
    """
    name = info.filename
    if info.file_size > limit:
        raise ResourceLimitError(f"{name} claims {info.file_size:,} bytes (limit {limit:,})")
    if info.compress_type == ZIP_STORED:
        if _data_start_at_least(info) + info.file_size > file_size:
            raise CorruptCheckpointError(
                f"{name} claims {info.file_size:,} bytes, past the end of the file (truncated?)"
            )
    elif info.file_size > MAX_INFLATED:
        raise ResourceLimitError(
            f"{name} is compressed and inflates to {info.file_size:,} bytes (over "
            f"{MAX_INFLATED:,}); torch never compresses records: a re-zipped or hostile file"
        )
    try:
        return archive.read(info, as_torch)
    except ZIP_ERRORS as error:
        raise CorruptCheckpointError(f"cannot read {name}: {error}") from None


def member_span(handle: BinaryIO, info: ZipMember) -> tuple[int, int]:
    """(absolute offset, length) of a stored record's bytes, from its local header.

    The span is checked against the file's size: a central directory may claim anything.
    """
    try:
        header = read_local_header(handle, info)
    except ZIP_ERRORS as error:
        raise CorruptCheckpointError(str(error)) from None
    start = header.data_start
    if header.method != ZIP_STORED:
        raise CorruptCheckpointError(
            f"record {info.filename!r} is compressed; torch never writes that (re-zipped file?)"
        )
    if start + info.file_size > source_size(handle):
        raise CorruptCheckpointError(
            f"record {info.filename!r} claims {info.file_size:,} bytes, past the end of the file "
            "(truncated or tampered file)"
        )
    return start, info.file_size
