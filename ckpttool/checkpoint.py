"""The one door to checkpoint files: :func:`open_checkpoint`.

Every command reads through here. Opening a file recognises its format, walks its pickle with
:mod:`ckpttool.pickle.interpreter` (nothing in it runs), and returns a :class:`Checkpoint`: the
object tree with tensors as :class:`~ckpttool.model.records.TensorRecord` s. No tensor bytes are read;
:meth:`Checkpoint.read_bytes` reads exactly the bytes a value needs when a command asks, with
``pread`` on the open file (never the whole file). torch is not imported.

A torch.distributed.checkpoint directory (``.metadata`` plus one data file per rank) opens the
same way, as one checkpoint: :mod:`ckpttool.formats.dcp.directory` gives each tensor its global shape and
assembles its bytes from the chunks on read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.errors import (
    AmbiguousFileError,
    CheckpointCollectionError,
    CkptError,
    CorruptCheckpointError,
    EmptyFileError,
    InputError,
    NotACheckpointError,
    NotADirectoryCheckpointError,
    name_file,
)
from ckpttool.formats.base import DCP_METADATA, Parsed, is_dcp_directory
from ckpttool.formats.safetensors_file import looks_like_safetensors, read_safetensors
from ckpttool.formats.torch_legacy import read_pickle_stream
from ckpttool.formats.torch_tar import TAR_REFUSAL, is_torch_tar
from ckpttool.formats.torch_zip.reader import read_torch_zip
from ckpttool.io.source import is_url, join, local_path, read_range, source_of, source_size
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    StorageRecord,
    TensorRecord,
    get_path,
    stored_records,
    tensors,
)
from ckpttool.pickle.interpreter import PickleResult, SafeUnpickler

if TYPE_CHECKING:
    from pathlib import Path

    from ckpttool.io.read_batch import InOrder


@dataclass
class Checkpoint:
    """An opened checkpoint: its object tree, format facts, and access to tensor bytes."""

    name: str  # the path it was opened from, as text (``path`` is the same as a Path)
    format: str
    root: Any
    file_size: int
    details: dict[str, Any]
    metadata: dict[str, str]
    problems: list[str]
    pickle: PickleResult | None
    _parsed: Parsed = field(repr=False)
    _handle: BinaryIO | None = field(repr=False)  # None for a directory of several files
    _all_tensors: list[TensorRecord] | None = field(default=None, repr=False)
    _spans: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _expected: InOrder | None = field(default=None, repr=False)  # see expect_reads

    @property
    def path(self) -> Path:
        from pathlib import Path  # not at import: listing a file never needs pathlib

        return Path(self.name)

    def tensors(self, section: str | None = None) -> list[TensorRecord]:
        """Every tensor with its dotted key, in file order (``section`` limits to a subtree)."""
        if section:
            return tensors(self.section(section), section)
        if self._all_tensors is None:
            self._all_tensors = tensors(self.root)
        return list(self._all_tensors)

    def section(self, name: str) -> Any:
        try:
            return get_path(self.root, name)
        except KeyError:
            raise InputError(f"{self.name}: no section {name!r} in this checkpoint") from None

    def storage_span(self, storage: StorageRecord) -> tuple[int, int]:
        """(absolute file offset, byte length) of a storage's bytes."""
        known = self._spans.get(storage.key)
        if known is not None:
            return known
        return self._parsed.span(storage)

    def resolve_spans(self, storages: list[StorageRecord]) -> None:
        """A hint: these storages will be read. A remote file locates them all at once (each
        needs its zip local header: small reads, made concurrently); a local file ignores it."""
        spread = getattr(self._handle, "map_concurrently", None)
        if spread is None or self._parsed.read is not None or self.format != "torch-zip":
            return
        wanted = list({s.key: s for s in storages if s.key not in self._spans}.values())

        def locate(storage: StorageRecord) -> tuple[int, int] | None:
            try:
                return self._parsed.span(storage)
            except CkptError:
                return None  # reported when the tensor is read

        for storage, span in zip(wanted, spread(locate, wanted)):
            if span is not None:
                self._spans[storage.key] = span

    def read_bytes(self, record: TensorRecord) -> tuple[bytes | bytearray, int]:
        """The bytes covering ``record``'s elements and the element offset of its first one.

        Only the range from the tensor's first to its last element is read. Errors name the
        file.
        """
        expected = self._expected
        if expected is not None:
            self._expected = None  # the block reads below call read_bytes themselves
            try:
                found = expected.take(record)
            finally:
                self._expected = expected
            if found is not None:
                return found
        try:
            return self._read_bytes(record)
        except CkptError as error:
            raise name_file(error, _shown(self.name)) from None

    @contextmanager
    def expect_reads(self, records: list[TensorRecord]) -> Iterator[None]:
        """A hint: :meth:`read_bytes` will be asked for ``records`` in this order (others may
        come between): runs of small adjacent ones are then read in blocks
        (:mod:`ckpttool.io.read_batch`). What each read gives, or raises, is the same."""
        from ckpttool.io.read_batch import InOrder

        previous, self._expected = self._expected, InOrder(self, records)
        try:
            yield
        finally:
            self._expected = previous

    def _read_bytes(self, record: TensorRecord) -> tuple[bytes | bytearray, int]:
        if record.inline_data is not None:
            return record.inline_data, record.storage_offset
        if record.storage is None:
            if record.dtensor is not None:
                raise InputError(
                    f"{record.key}: a DTensor shard ({record.dtensor.describe()}): this file "
                    "holds one rank's piece, not the tensor's values"
                )
            raise InputError(f"{record.key}: a meta tensor has no values")
        itemsize = record.itemsize
        first = record.storage_offset * itemsize // ELEMENTS_PER_BYTE.get(record.dtype, 1)
        stop = record.stored_extent_bytes
        return self.read_storage(record.storage, first, stop, record.key), 0

    def file_span(self, record: TensorRecord) -> tuple[int, int] | None:
        """(absolute offset, length) of the bytes :meth:`read_bytes` reads for ``record`` when
        they are one range of this checkpoint's one file, else None (inline bytes, a meta
        tensor, a packed dtype, storages the format assembles, a range past its storage: those
        are left to :meth:`read_bytes`, which reads them or raises). For reading many small
        tensors at once (:mod:`ckpttool.io.read_batch`)."""
        storage = record.storage
        if (
            storage is None
            or record.inline_data is not None
            or self._parsed.read is not None
            or self._handle is None
            or record.dtype in ELEMENTS_PER_BYTE
        ):
            return None
        try:
            offset, length = self._spans.get(storage.key) or self._parsed.span(storage)
        except CkptError:
            return None  # read_bytes raises it, naming the file
        # record.storage_offset * itemsize and record.stored_extent_bytes, without the
        # properties' calls (this runs once per tensor of a 100,000-tensor diff or convert)
        itemsize = ITEMSIZE.get(record.dtype, 1)
        first = last = record.storage_offset
        for size, step in zip(record.shape, record.stride):
            if size == 0:
                return (offset + first * itemsize, 0) if first * itemsize <= length else None
            last += (size - 1) * step
        first *= itemsize
        stop = (last + 1) * itemsize
        if stop > length or first > stop:
            return None
        return offset + first, stop - first

    def read_file(self, offset: int, length: int) -> bytearray:
        """``length`` bytes at ``offset`` of this checkpoint's one file (fewer only at its end):
        the raw read under :meth:`file_span`."""
        assert self._handle is not None
        return read_range(source_of(self._handle), length, offset)

    def prefetch(self, record: TensorRecord) -> None:
        """A hint: ``record``'s bytes will be read next. A remote file starts fetching them
        (convert writes one tensor while the next arrives); a local file ignores it."""
        ahead = getattr(self._handle, "prefetch", None)
        if ahead is None or record.storage is None or record.inline_data is not None:
            return
        if self._parsed.read is not None:
            return
        try:
            offset, length = self.storage_span(record.storage)
        except CkptError:
            return  # reported when the tensor is read
        first = record.storage_offset * record.itemsize // ELEMENTS_PER_BYTE.get(record.dtype, 1)
        stop = record.stored_extent_bytes
        if stop <= length:
            ahead(offset + first, stop - first)

    def read_storage(
        self, storage: StorageRecord, start: int, stop: int, key: str = ""
    ) -> bytearray:
        """Bytes ``[start, stop)`` of one of this checkpoint's storages (``key`` names what they
        are for in errors). The one place storage bytes are read: from one span of the file, or
        assembled by the format (DCP's chunks, a directory's member files)."""
        what = key or repr(storage.key)
        if self._parsed.read is not None:  # not one span of one file
            if stop > storage.nbytes:
                raise CorruptCheckpointError(f"{what}: extends past its storage's bytes")
            return self._parsed.read(storage, start, stop)
        offset, length = self.storage_span(storage)
        if stop > length:
            raise CorruptCheckpointError(f"{what}: extends past its storage's bytes")
        assert self._handle is not None  # a directory's storages are read through _parsed.read
        data = read_range(source_of(self._handle), stop - start, offset + start)
        if len(data) != stop - start:
            raise CorruptCheckpointError(f"{what}: file ends inside its data (truncated)")
        return data

    @property
    def index(self) -> Any:
        """The format's own index of the checkpoint, as parsed on open (DCP: its
        :class:`~ckpttool.formats.dcp.metadata.DcpMetadata`); None for other formats."""
        return self._parsed.index

    def check_unchanged(self) -> None:
        """Raise if a remote source is no longer the object that was opened (a store whose
        ranged reads cannot carry that check on each request is asked once more here)."""
        if self._parsed.unchanged is not None:  # its member files check themselves
            self._parsed.unchanged()
        check = getattr(self._handle, "check_unchanged", None)
        if check is not None:
            try:
                check()
            except CkptError as error:
                raise name_file(error, _shown(self.name)) from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        if self._parsed.close is not None:
            self._parsed.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    refuse_dangerous: bool = True,
    track_spans: bool = False,
    allow_ambiguous: bool = False,
) -> Checkpoint:
    """Open ``path`` safely and lazily. Raises a :class:`~ckpttool.errors.CkptError` subclass
    whose message names the file (whatever part of it the error concerns).

    ``strict=False`` records structural problems in ``Checkpoint.problems`` where it can go on
    (``verify`` uses this); ``refuse_dangerous=False`` records dangerous globals instead of
    refusing the file (``scan``). A file that reads two ways (docs/safety.md, "Parser
    differentials") raises :class:`~ckpttool.errors.AmbiguousFileError`; with
    ``allow_ambiguous`` (``scan``) it is read as ``torch.load`` reads it (a file not named
    ``*.safetensors``) and ``details["ambiguous"]`` says what else it is.
    """
    name = os.fspath(path)
    if is_url(name):
        from ckpttool.io.remote import is_directory

        if name.endswith(".index.json"):
            return _open_directory(name, strict, refuse_dangerous)
        if is_directory(name):
            return _open_remote_directory(name, strict, refuse_dangerous)
        handle = open_source(name)
        return _open_file(name, handle, strict, refuse_dangerous, track_spans, allow_ambiguous)
    name = local_path(name)
    if not is_dcp_directory(name) and is_framework_path(name):
        return _open_directory(name, strict, refuse_dangerous)
    if not is_dcp_directory(name):
        handle = _open_input(name)
        return _open_file(name, handle, strict, refuse_dangerous, track_spans, allow_ambiguous)
    return _open_dcp(name, _open_input(os.path.join(name, DCP_METADATA)), strict, refuse_dangerous)


def _open_remote_directory(url: str, strict: bool, refuse_dangerous: bool) -> Checkpoint:
    """A directory under a URL: DCP when it has a ``.metadata``, else a framework's layout
    (which needs a store that lists: HTTP cannot)."""
    from ckpttool.io.remote import display_url, url_scheme

    try:
        metadata = open_source(join(url, DCP_METADATA))
    except InputError as error:
        if "no such file" not in str(error):
            raise
    else:
        return _open_dcp(url, metadata, strict, refuse_dangerous)
    if url_scheme(url) in ("http", "https", "hf"):
        raise InputError(
            f"{display_url(url)}: a directory without a {DCP_METADATA} file; HTTP cannot list a "
            "directory, so of directory checkpoints only torch.distributed.checkpoint ones are "
            "read from http(s):// and hf:// URLs (name a checkpoint file in it)"
        )
    return _open_directory(url, strict, refuse_dangerous)


def _open_dcp(name: str, handle: Any, strict: bool, refuse_dangerous: bool) -> Checkpoint:
    """A torch.distributed.checkpoint directory (local, or a URL) whose ``.metadata`` is open."""
    parsed: Parsed | None = None
    try:
        # imported here: listing a single file should not pay for the DCP reader
        from ckpttool.formats.dcp.directory import read_dcp

        directory: Any = name
        if not is_url(name):
            from pathlib import Path

            directory = Path(name)
        parsed = read_dcp(directory, handle, strict=strict, refuse_dangerous=refuse_dangerous)
        files = parsed.details.get("files", {})
        file_size = source_size(handle) + sum(size for size in files.values() if size)
        records, problems = _checked(parsed, strict)
    except BaseException as error:
        _close_on_error(error, name, handle, parsed)
        raise
    return _checkpoint(name, parsed, handle, file_size, records, problems)


def _checkpoint(
    name: str,
    parsed: Parsed,
    handle: Any,
    file_size: int,
    records: list[TensorRecord],
    problems: list[str],
) -> Checkpoint:
    return Checkpoint(
        name=name,
        format=parsed.format,
        root=parsed.root,
        file_size=file_size,
        details=parsed.details,
        metadata=parsed.metadata,
        problems=problems,
        pickle=parsed.pickle,
        _parsed=parsed,
        _handle=handle,
        _all_tensors=records,
    )


def _checked(parsed: Parsed, strict: bool) -> tuple[list[TensorRecord], list[str]]:
    """The tensors of a parsed file and its problems (the first one raised when ``strict``)."""
    records = tensors(parsed.root, in_place=True)  # the tree is this parse's own
    problems = list(parsed.problems) + check_extents(parsed, records)
    if problems and strict:
        raise CorruptCheckpointError(problems[0])
    return records, problems


def _open_file(
    name: str,
    handle: Any,
    strict: bool,
    refuse_dangerous: bool,
    track_spans: bool,
    allow_ambiguous: bool = False,
) -> Checkpoint:
    """One checkpoint file, local or remote, opened as ``handle``."""
    parsed: Parsed | None = None
    try:
        file_size = source_size(handle)
        parsed = _parse(handle, file_size, strict, refuse_dangerous, track_spans)
        ambiguity = parsed.details.get("ambiguous")
        if ambiguity and not allow_ambiguous:
            raise AmbiguousFileError(ambiguity)
        _read_pickled_module(parsed)
        records, problems = _checked(parsed, strict)
    except BaseException as error:
        _close_on_error(error, name, handle, parsed)
        raise
    return _checkpoint(name, parsed, handle, file_size, records, problems)


def _close_on_error(error: BaseException, name: str, handle: Any, parsed: Parsed | None) -> None:
    handle.close()
    if parsed is not None and parsed.close is not None:
        parsed.close()
    if isinstance(error, CkptError):
        name_file(error, _shown(name))


def _shown(name: str) -> str:
    """How errors name ``name``: a URL without credentials or a presigned query."""
    if is_url(name):
        from ckpttool.io.remote import display_url

        return display_url(name)
    return name


def open_source(name: str) -> Any:
    """``name`` opened for reading: a local file, or a remote one read by ranges (a URL)."""
    if is_url(name):
        from ckpttool.io.remote import open_remote  # fsspec and friends only for URLs

        handle = open_remote(name)
        if handle.size == 0:
            handle.close()
            raise EmptyFileError(f"{_shown(name)}: the file is empty (an interrupted save?)")
        return handle
    return _open_input(local_path(name))


def _read_pickled_module(parsed: Parsed) -> None:
    """``torch.save(model)`` pickles the module object; every command wants what
    ``model.state_dict()`` would give, under its names: make that the tree."""
    from ckpttool.model.roles import PICKLED_MODULE, module_state_dict

    state_dict = module_state_dict(parsed.root)
    if state_dict is not None:
        parsed.details["layout"] = PICKLED_MODULE
        parsed.details["module_class"] = parsed.root.cls
        parsed.root = state_dict


def is_framework_path(path: str) -> bool:
    """A directory (not DCP) or an ``*.index.json`` file: a framework's several-file layout."""
    return os.path.isdir(path) or (path.endswith(".index.json") and os.path.isfile(path))


def _open_directory(name: str, strict: bool, refuse_dangerous: bool) -> Checkpoint:
    """A framework's directory (Hugging Face, Trainer, accelerate) as one checkpoint."""
    from ckpttool.frameworks.base import COLLECTION, describe_collection, detect_directory
    from ckpttool.frameworks.tree import directory_size, read_directory

    layout = detect_directory(name)
    if layout is None:
        if os.path.isdir(name) and _has_dcp_shards(name):
            _open_input(name)  # raises the DCP-specific message
        raise NotADirectoryCheckpointError(
            f"{name}: is a directory, but not a checkpoint layout ckpttool knows (a Hugging Face "
            "model or Trainer checkpoint, an accelerate save_state folder, a DeepSpeed save or tag "
            f"directory, a DCP directory); {_files_seen(name)}"
        )
    if layout.layout == COLLECTION:
        raise CheckpointCollectionError(layout, describe_collection(layout))
    parsed = read_directory(layout, strict=strict, refuse_dangerous=refuse_dangerous)
    return Checkpoint(
        name=name,
        format=parsed.format,
        root=parsed.root,
        file_size=directory_size(layout),
        details=parsed.details,
        metadata=parsed.metadata,
        problems=list(parsed.problems),
        pickle=None,
        _parsed=parsed,
        _handle=None,
        _all_tensors=tensors(parsed.root),
    )


#: Names of files that are usually checkpoints (what ``show DIR`` lists of a plain directory).
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar")


def checkpoint_names(directory: str) -> list[str]:
    """The files directly in ``directory`` named like checkpoints, sorted (names only: nothing
    is opened)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted(
        name for name in entries
        if name.endswith(CHECKPOINT_SUFFIXES) and not name.startswith(".")
        and os.path.isfile(os.path.join(directory, name))
    )  # fmt: skip


def _files_seen(directory: str, most: int = 8) -> str:
    """What a plain directory holds, for the refusal: its checkpoint files, or that it has none."""
    names = checkpoint_names(directory)
    if not names:
        return (
            "it holds no file named like a checkpoint (*.pth, *.pt, *.bin, *.ckpt, *.safetensors)"
        )
    shown = ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")
    return (
        f"it holds {len(names)} checkpoint file{'s' if len(names) != 1 else ''}: {shown}; "
        "name one of them (verify and scan take the whole directory)"
    )


def _open_input(path: str) -> BinaryIO:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as error:
        raise InputError(f"{path}: cannot access ({error.strerror})") from None
    if stat.S_ISDIR(mode):
        if _has_dcp_shards(path):
            raise CorruptCheckpointError(
                f"{path}: a torch.distributed.checkpoint directory without its {DCP_METADATA} file "
                "(DCP writes it last: the save did not finish); use the previous checkpoint"
            )
        raise InputError(f"{path}: is a directory, not a checkpoint file")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file")
    try:
        handle = open(path, "rb")  # noqa: SIM115 - owned by the returned Checkpoint
    except OSError as error:
        raise InputError(f"{path}: cannot open ({error.strerror})") from None
    if os.fstat(handle.fileno()).st_size == 0:
        handle.close()
        raise EmptyFileError(f"{path}: the file is empty (an interrupted save?)")
    return handle


#: First bytes of the pickles torch.save writes (protocols 0 to 5: its magic number is a LONG,
#: a LONG1 or a PROTO) and of plain pickled dicts, lists and globals.
PICKLE_STARTS = (b"\x80", b"(", b"}", b"]", b"c", b"L", b"\x8a")
#: How far the safetensors reading of a file looks for a pickle reading too (a benign
#: safetensors file's first bytes may read as a pickle opcode claiming a long argument), and
#: what it reads first (the walk of a benign file's bytes fails within a few opcodes).
MAX_PICKLE_PROBE = 64 << 20
FIRST_PICKLE_PROBE = 64 << 10
#: Opcodes whose argument's length is the next 8 bytes (FRAME, BINUNICODE8, BINBYTES8,
#: BYTEARRAY8): as a safetensors file's first byte, their length is the header length's other
#: bytes and its "{", over 2**56: no file holds that, so no pickle reading is looked for.
_LONG8_OPCODES = (0x95, 0x8D, 0x8E, 0x96)


def _parse(
    handle: BinaryIO, file_size: int, strict: bool, refuse_dangerous: bool, track_spans: bool
) -> Parsed:
    head = handle.read(512)  # a tar header's "ustar" is at byte 257
    handle.seek(0)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return read_torch_zip(handle, refuse_dangerous=refuse_dangerous, track_spans=track_spans)
    if looks_like_safetensors(head, file_size):
        return _read_safetensors(handle, file_size, strict, refuse_dangerous, track_spans)
    if is_torch_tar(handle):  # before a pickle stream, as torch.load tries them
        raise NotACheckpointError(TAR_REFUSAL)
    if head[:1] in PICKLE_STARTS:
        return read_pickle_stream(
            handle, file_size, refuse_dangerous=refuse_dangerous, track_spans=track_spans
        )
    if head.startswith(b"\x1f\x8b") or head[257:262] == b"ustar":
        raise NotACheckpointError("a compressed or tar archive, not a checkpoint")
    raise NotACheckpointError(
        f"not a checkpoint: unrecognised format (first bytes {head[:8]!r}); ckpttool reads "
        "torch.save files (zip or legacy), safetensors and pickles"
    )


def _read_safetensors(
    handle: BinaryIO, file_size: int, strict: bool, refuse_dangerous: bool, track_spans: bool
) -> Parsed:
    """A safetensors file; one that is also a tar or a pickle stream reads two ways:
    ``torch.load`` reads safetensors only under a ``*.safetensors`` name, and unpickles any
    other (its first pickle runs before anything checks it)."""
    other: str | None = None
    found: list[Any] = []
    if is_torch_tar(handle):
        other = "a tar archive (torch's pre-0.4 format)"
    else:
        other, found = _pickle_probe(handle, file_size)
    parsed = read_safetensors(handle, file_size, strict=strict)
    if other is not None:
        parsed.details["ambiguous"] = (
            f"a safetensors file that is also {other}: torch.load reads it as safetensors "
            "under a *.safetensors name and unpickles it under any other"
        )
        parsed.details["pickle_globals"] = found  # what scan reports
    return parsed


def _pickle_probe(handle: BinaryIO, file_size: int) -> tuple[str | None, list[Any]]:
    """What the file is as a pickle stream, if ``torch.load`` would run or read anything of
    it (a legacy stream, or a pickle that names a global, even one that fails after), and the
    globals it names; (None, []) for bytes that are no such pickle."""
    handle.seek(0)
    head = handle.read(9)
    handle.seek(0)
    if head[0] in _LONG8_OPCODES and int.from_bytes(head[1:9], "little") > file_size:
        return None, []  # pickle.load fails on its first opcode too, having run nothing
    try:
        stream = read_pickle_stream(
            handle,
            file_size,
            refuse_dangerous=False,
            track_spans=False,
            limit=MAX_PICKLE_PROBE,
            first=FIRST_PICKLE_PROBE,
        )
    except CkptError:
        pass
    else:
        assert stream.pickle is not None
        if stream.format != "pickle":
            return "a pickle stream (torch's legacy format)", stream.pickle.globals_seen
        if stream.pickle.globals_seen:
            return "a pickle", stream.pickle.globals_seen
        return None, []
    handle.seek(0)
    data = handle.read(min(file_size, FIRST_PICKLE_PROBE))
    handle.seek(0)
    placeholder = StorageRecord("?", "uint8", 0, "cpu", "", 0)
    unpickler = SafeUnpickler(data, persistent_load=lambda pid: placeholder, refuse_dangerous=False)
    try:
        unpickler.load()
    except CkptError:
        pass  # what it named before it failed, torch.load calls before it fails
    found = unpickler.result.globals_seen
    return ("a pickle" if found else None), found


def check_extents(parsed: Parsed, records: list[TensorRecord]) -> list[str]:
    """Every tensor within its storage, every storage within the bytes the file has."""
    problems = []
    for storage in parsed.storages:
        if storage.nbytes > storage.data_size:
            problems.append(
                f"storage {storage.key!r} claims {storage.nbytes:,} bytes but the file holds "
                f"{storage.data_size:,} for it (truncated or tampered file)"
            )
    packing: dict[str, tuple[int, int]] = {}  # dtype: (elements per byte, bytes per element)
    for record in stored_records(records):
        viewed = record.storage
        if viewed is None or record.inline_data is not None:
            continue
        # record.stored_extent_bytes, without its three property calls per tensor
        offset = record.storage_offset
        shape = record.shape
        if 0 in shape:  # no elements
            extent = offset
        else:
            extent = offset + 1
            for size, stride in zip(shape, record.stride):
                extent += (size - 1) * stride
        dtype = record.dtype
        per_byte_itemsize = packing.get(dtype)
        if per_byte_itemsize is None:
            per_byte_itemsize = packing[dtype] = (
                ELEMENTS_PER_BYTE.get(dtype, 1),
                ITEMSIZE.get(dtype, 1),
            )
        needed = -(-extent // per_byte_itemsize[0]) * per_byte_itemsize[1]
        if needed > viewed.nbytes:
            problems.append(
                f"tensor {record.key!r} ({record.dtype}{list(record.shape)}) reaches byte "
                f"{needed:,} of its storage, which has {viewed.nbytes:,}"
            )
    return problems


def _has_dcp_shards(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(entry.name.endswith(".distcp") for entry in entries)
    except OSError:  # unreadable: say "a directory", as for any other
        return False
