"""The protocol every format implements (:class:`FileFormat`), what its reader returns
(:class:`Parsed`), what every command reads: an opened :class:`Checkpoint`, and the planned
rewrite of a file's top-level fields (:class:`FieldRewrite`).

A format is one module or folder under ``formats/`` with one :class:`FileFormat` object,
listed by an import string in :mod:`ckpttool.formats.registry`; nothing above ``formats/``
imports a format by name.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol

from ckpttool.errors import CkptError, CorruptCheckpointError, InputError, name_file
from ckpttool.io.source import is_url, read_into, read_range, shown_name, source_of
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    StorageRecord,
    TensorRecord,
    get_path,
    tensors,
)
from ckpttool.pickle.interpreter import PickleResult

if TYPE_CHECKING:
    from pathlib import Path

    from ckpttool.io.blocks import FileRange
    from ckpttool.io.progress import ProgressCallback
    from ckpttool.io.read_batch import InOrder
    from ckpttool.pickle.scan import Counts, Written

#: Names of files that are usually checkpoints: what ``show DIR`` lists of a plain directory,
#: the parts of a folder or zip of checkpoint files, and the members of such a zip that whoever
#: reads it hands to ``torch.load`` (``scan``).
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar")


@dataclass
class Parsed:
    format: str  # "torch-zip", "torch-legacy", "safetensors", "pickle", "dcp"
    root: Any  # the object tree (records.py types and plain values)
    span: Callable[[StorageRecord], tuple[int, int]]  # storage -> (file offset, byte length)
    pickle: PickleResult | None = None
    details: dict[str, Any] = field(default_factory=dict)  # format facts shown by `show`
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    storages: list[StorageRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # found in non-strict mode
    # For storages that are not one span of one file (DCP's chunked storages): bytes
    # [start, stop) of the storage, assembled; and what to close with the checkpoint.
    read: Callable[[StorageRecord, int, int], bytearray] | None = None
    close: Callable[[], None] | None = None
    # For a checkpoint assembled from several remote files: raise if one of them changed.
    unchanged: Callable[[], None] | None = None
    # The format's own index, parsed (DCP: its DcpMetadata), for verify not to parse it again.
    index: Any = None
    # For tensors quantized in the format's own blocks (QuantInfo.in_blocks: GGUF's Q8_0...):
    # (record, its stored bytes) -> its values, a float32 NumPy array of the record's shape.
    dequantize: Callable[[TensorRecord, bytes | bytearray], Any] | None = None
    # storage -> (file offset, byte length) of a region holding its bytes and what must be read
    # to find them (a zip member's local header), known without reading: the plan a remote
    # file fetches in few large requests (Checkpoint.plan_reads). None: no plan.
    region: Callable[[StorageRecord], tuple[int, int]] | None = None
    # storage -> the CRC-32 the format keeps of its bytes (a torch zip record's, when torch
    # computed them), or None: what a copy of those bytes can be checked against. None: no CRCs.
    crc: Callable[[StorageRecord], int | None] | None = None
    # Whether several threads may read values at once (--jobs reads a directory's members
    # ahead): a framework directory's members are checkpoints of their own, each read by pread
    # or ranged requests; DCP's reads take a lock. Assembled views (DeepSpeed's fp32, per-rank
    # sets) leave it False: read on one thread.
    concurrent_reads: bool = False
    # The object tree as pickled when ``root`` is a view of it (pickled nn.Modules read as
    # their state dicts: ckpttool.model.roles.module_view); None when ``root`` is that tree.
    objects: Any = None


#: How a finding's place inside an archive is written: ``data/sample_inputs/model.pt › model/data.pkl``.
PLACE_SEPARATOR = " › "


@dataclass
class Findings:
    """What ``scan`` found in one checkpoint, walked by its format's own :meth:`FileFormat.scan`."""

    format: str  # the vocabulary name reported ("torchscript" for a zip that carries code)
    counts: Counts = field(default_factory=Counter)
    written: Written = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # attacks, ambiguity: "dangerous"
    problems: list[str] = field(default_factory=list)  # where a walk had to stop
    # where inside an archive each global was named, when not in the plain data.pkl of a
    # torch.save zip ("data/sample_inputs/model.pt › model/data.pkl")
    places: dict[tuple[str, str], list[str]] = field(default_factory=dict)


@dataclass
class Recovered:
    """What a damaged file still holds (:meth:`FileFormat.recover`).

    ``root`` is the object tree as the file's index (a zip's ``data.pkl``, a safetensors
    header) describes it, every tensor included; ``intact`` gives, by storage key, where the
    bytes of each storage that checks out lie in the file (a tensor whose storage key is not
    there is lost). ``write(handle, root, read)`` writes a tree of the same kind (``root`` with
    entries left out) as a file of this format, ``read(storage_key)`` giving a storage's bytes.
    """

    format: str
    root: Any
    intact: dict[str, tuple[int, int]]  # storage key -> (file offset, byte length)
    damage: list[str]  # what is wrong with the file, one line each
    write: Callable[[BinaryIO, Any, Callable[[str], bytes]], None]
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    # storage key -> the CRC-32 its intact bytes were checked with, where the format keeps one
    # (a torch zip): the repaired file's read-back checks its copy against it
    crcs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class OutTensor:
    """One tensor as a writer writes it: contiguous, in its output dtype."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


class FileFormat:
    """One checkpoint format: the protocol :mod:`ckpttool.formats.registry` drives.

    Each format module or folder defines one instance, named by an import string in the
    registry's list. The registry calls, in this order:

    1. :meth:`recognises` (files) or :meth:`recognises_directory` (directories), format by
       format in the registry's order (``torch.load``'s), until one says yes. It must be cheap:
       the first bytes and the size, touching the handle only where the format needs to (a tar
       archive's checksum); it leaves the handle at offset 0 and imports no heavy reader.
    2. :meth:`open` (or :meth:`open_directory`): the file's bytes parsed into a
       :class:`Parsed`, or a :class:`~ckpttool.errors.CkptError` (a format may refuse here:
       torch's tar format). When :attr:`read_two_ways` is set, the registry then asks the later
       formats' :meth:`also_reads_as` whether ``torch.load`` would read the file another way.
    3. Optional hooks, each found by the checkpoint's format id (:attr:`ids`):
       :meth:`verify` (``verify``'s checks beyond opening, given the opened
       :class:`Checkpoint`), :meth:`scan` (``scan``'s own walk of every pickle ``torch.load``
       would run, instead of opening the file; ``None``: open it as usual), :meth:`write`
       (``convert``'s output in this format), :meth:`recover` (what a damaged file still
       holds, found without the parts that may be lost; ``None``: it cannot recover) and
       :meth:`show_lines` (``show``'s lines for the format's own facts).
    """

    #: The vocabulary name (:data:`ckpttool.model.vocabulary.FORMATS`) of what it opens.
    id: ClassVar[str] = ""
    #: Every format id its reader may give a :class:`Parsed` (a bare pickle is "pickle").
    ids: ClassVar[tuple[str, ...]] = ()
    #: Whether the file may read two ways: the later formats are asked :meth:`also_reads_as`.
    read_two_ways: ClassVar[bool] = False
    #: Whether :meth:`write` takes a tensor's bytes as a :class:`~ckpttool.io.blocks.FileRange`
    #: too (copied in the kernel, :func:`~ckpttool.io.blocks.write_data`): ``convert`` then
    #: leaves a large tensor it writes as it is in its (local) source file.
    copies_ranges: ClassVar[bool] = False
    #: Whether its files carry a table of string metadata (``Checkpoint.metadata``: safetensors'
    #: ``__metadata__``): ``convert`` carries it over, ``diff`` compares it.
    string_metadata: ClassVar[bool] = False
    #: Whether it holds tensors only, never training state (``rescale-step`` refuses it).
    weights_only: ClassVar[bool] = False

    def recognises(self, head: bytes, file_size: int, handle: BinaryIO) -> bool:
        """Whether this file is this format (``head``: its first 512 bytes)."""
        return False

    def open(
        self,
        handle: BinaryIO,
        file_size: int,
        *,
        strict: bool,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> Parsed:
        raise NotImplementedError

    #: A directory format: the file it is recognised by and opened from (DCP: ``.metadata``),
    #: what the directory is called, and why ``rescale-step`` cannot rewrite it.
    index_name: ClassVar[str] = ""
    directory_title: ClassVar[str] = ""
    no_rescale_why: ClassVar[str] = ""

    def recognises_directory(self, path: str | os.PathLike[str]) -> bool:
        """Whether a local directory is one checkpoint of this format."""
        return False

    def incomplete_directory(self, path: str) -> CkptError | None:
        """The refusal of a local directory that is this format's but cannot be read (DCP: data
        files without their ``.metadata``), where the door would otherwise say it knows no such
        directory; None when it is not."""
        return None

    def open_directory(
        self, directory: Any, index: BinaryIO, *, strict: bool, refuse_dangerous: bool
    ) -> Parsed:
        """A directory checkpoint whose index file (DCP: ``.metadata``) is open as ``index``."""
        raise NotImplementedError

    def also_reads_as(self, handle: BinaryIO, file_size: int) -> tuple[str, list[Any]] | None:
        """What ``torch.load`` would read a file another format opened as, when it is also this
        format (a description, and the globals its pickles name); None when it is not."""
        return None

    def verify(
        self, ckpt: Checkpoint, progress: ProgressCallback | None
    ) -> tuple[list[str], list[str]]:
        """(problems, what was checked) beyond what opening checked."""
        return [], []

    def scan(self, path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
        """Every global the pickles ``torch.load`` would run name (``opener(path)`` opens the
        file, local or remote); None to leave the file to the reader."""
        return None

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        """``show``'s header lines for what this format put in a checkpoint's ``details``
        (GGUF: its version, model facts and metadata); none by default."""
        return []

    def rewrite_directory(
        self,
        source: Path,
        root: Any,
        target: Path,
        casts: Mapping[str, tuple[str, Callable[[Any], bytes]]],
    ) -> None:
        """``edit`` of a directory of this format: write ``root`` (the tree read from the
        directory ``source``, with entries dropped, tensors renamed or given another of its
        tensors' values) as a directory of this format into the empty directory ``target``.
        ``casts``: output key -> (dtype, function from a piece of the tensor's elements, a
        NumPy array in the source dtype's stored type, to its bytes in that dtype). Raises a
        :class:`~ckpttool.errors.CkptError` for what it cannot write."""
        raise InputError(f"ckpttool does not rewrite {self.id} directories")

    def recover(self, handle: BinaryIO, file_size: int) -> Recovered | None:
        """What a damaged (cut short, torn) file of this format still holds, read from what
        survives: the tree, and which storages' bytes check out (a
        :class:`~ckpttool.errors.CkptError` when nothing can be rebuilt); None when this format
        cannot recover files. Called after :meth:`recognises` said yes; the handle is local."""
        return None

    def write(
        self,
        handle: BinaryIO,
        tensors: Sequence[OutTensor],
        data: Iterable[bytes | bytearray | memoryview | FileRange],
        names: Sequence[str],
        aliases: Mapping[str, str],
        metadata: Mapping[str, str],
    ) -> int:
        """Write a state dict of plain tensors (``convert``'s output): ``tensors`` in storage
        order with their bytes, in that order, in ``data`` (a :class:`FileRange` only where
        :attr:`copies_ranges`); ``names`` every output name in source order, ``aliases`` alias
        name -> stored name. Returns the size the file must have."""
        raise NotImplementedError(f"ckpttool does not write {self.id} files")


def no_span(storage: StorageRecord) -> tuple[int, int]:
    raise ValueError(f"storage {storage.key!r} has no bytes in this file")


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
    def without_objects(self) -> bool:
        """Whether ``root`` is a pickle walk's tree that holds no opaque object
        (``PickleResult.objects``): no tensor subclass, no pickled module, no class to name,
        so questions about objects need no walk of it (bench/object_table.py)."""
        result = self.pickle
        return result is not None and self.root is result.root and result.objects == 0

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

    @property
    def objects(self) -> Any:
        """The object tree as the file pickled it: ``root`` itself, or, where ``root`` reads
        pickled ``nn.Module`` objects as their state dicts, the modules as they were pickled
        (every attribute, the class of each: ``show --tree --objects``)."""
        return self._parsed.objects if self._parsed.objects is not None else self.root

    def section(self, name: str, *, objects: bool = False) -> Any:
        """The subtree at dotted key ``name`` (of :attr:`objects` with ``objects``)."""
        try:
            return get_path(self.objects if objects else self.root, name)
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

    def stored_crc(self, storage: StorageRecord) -> int | None:
        """The CRC-32 this checkpoint's format keeps of ``storage``'s bytes (the bytes
        :meth:`storage_span` gives), or None where it keeps none."""
        return self._parsed.crc(storage) if self._parsed.crc is not None else None

    @property
    def concurrent_reads(self) -> bool:
        """Whether several threads may read this checkpoint's values at once (see Parsed)."""
        return self._parsed.concurrent_reads

    @property
    def parallel_reads(self) -> bool:
        """Whether several threads may read this checkpoint's values at once, each its own
        tensors (``diff --jobs`` compares runs of tensors on threads): :attr:`concurrent_reads`,
        or one local file whose storages are spans of it: every read is a ``pread`` of its
        descriptor, and a zip's local headers are read under a lock. A URL's file is read on
        one thread (its planned windows, in order), as are storages the format assembles."""
        if self._parsed.concurrent_reads:
            return True
        if self._parsed.read is not None or self._handle is None or is_url(self.name):
            return False
        try:
            return isinstance(source_of(self._handle), int)
        except (AttributeError, OSError, ValueError):  # a stream without a descriptor
            return False

    def plan_reads(self, records: Sequence[TensorRecord]) -> bool:
        """A hint: the bytes of ``records`` will be read, in this order. A remote file then
        fetches the regions that hold them (and their zip local headers) in few large
        requests, each byte once (:meth:`ckpttool.io.remote.RemoteFile.plan`); a local file
        ignores it. Whether a plan was made (a remote file of a format that gives regions)."""
        plan = getattr(self._handle, "plan", None)
        region = self._parsed.region
        if plan is None or region is None or self._parsed.read is not None:
            return False
        spans = []
        seen: set[str] = set()
        for record in records:
            storage = record.storage
            if storage is None or record.inline_data is not None or storage.key in seen:
                continue
            seen.add(storage.key)
            try:
                spans.append(region(storage))
            except (CkptError, KeyError):  # reported when the tensor is read
                continue
        plan(spans)
        return True

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
            raise name_file(error, shown_name(self.name)) from None

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

    def file_range(self, record: TensorRecord) -> FileRange | None:
        """:meth:`file_span` of ``record`` in this checkpoint's local file, as a
        :class:`~ckpttool.io.blocks.FileRange` a writer copies in the kernel (None: not one
        range of a local file)."""
        from ckpttool.io.blocks import FileRange  # (not at start-up: show never writes)

        span = self.file_span(record)
        if span is None or self._handle is None:
            return None
        source = source_of(self._handle)
        return FileRange(source, span[0], span[1]) if isinstance(source, int) else None

    def read_file_into(self, offset: int, into: memoryview) -> int:
        """:meth:`read_file` into a buffer the caller reuses (:mod:`ckpttool.io.blocks`);
        how many bytes were read."""
        assert self._handle is not None
        return read_into(source_of(self._handle), offset, into)

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

    def dequantize(self, record: TensorRecord) -> Any:
        """The values of a tensor quantized in its format's blocks (``record.quant.in_blocks``:
        GGUF's Q8_0, Q4_K...), decoded by the format that read the file: a float32 NumPy array
        of ``record.shape``. Reads the tensor's bytes, nothing more; errors name the file."""
        decode = self._parsed.dequantize
        if decode is None:
            raise InputError(f"{self.name}: {record.key}: no decoder for its {record.dtype} blocks")
        data, first = self.read_bytes(record)
        assert first == 0  # a block-quantized tensor is read whole
        try:
            return decode(record, data)
        except CkptError as error:
            raise name_file(error, shown_name(self.name)) from None

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
                raise name_file(error, shown_name(self.name)) from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        if self._parsed.close is not None:
            self._parsed.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FieldRewrite(Protocol):
    """The planned rewrite of ``ckpt`` with ``changes`` set on its top-level dict, every other
    byte copied (``rescale-step``): what :func:`ckpttool.formats.registry.field_rewrite` gives.

    Creating it validates the edit without writing anything, so a dry run sees the same
    refusals as a real one; :meth:`write` writes the new file and :meth:`close` lets go of the
    source.
    """

    ckpt: Checkpoint
    changes: dict[str, Any]

    def write(self, out: BinaryIO, progress: ProgressCallback | None = None) -> None:
        """Write the new file to ``out`` (seekable, positioned at 0)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> FieldRewrite: ...

    def __exit__(self, *exc: object) -> None: ...
