"""The formats, in the order ``torch.load`` tries them, and one checkpoint file opened through them.

Each format is one module or folder under ``formats/`` with a
:class:`~ckpttool.formats.base.FileFormat` object, listed here by an import string: a format is
imported only when the sniffing reaches it (opening a zip imports no other reader) or when a
command asks for it by id (``verify``'s and ``scan``'s hooks, ``convert``'s writer). Adding a
format is its module, one line in :data:`FILE_FORMATS` (or :data:`DIRECTORY_FORMATS`), its
tests.

The order is ``torch.load``'s: a zip, then safetensors (which ``torch.load`` reads only under a
``*.safetensors`` name: a file that is also a tar or a pickle reads two ways, refused unless the
caller asks, as ``scan`` does), then torch's tar format (refused by name; ``torch.load`` tries it
before a pickle stream), then a pickle stream (legacy or bare). A gzip or tar archive, or
anything else, is no checkpoint. Directories are the door's (:mod:`ckpttool.checkpoint`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from ckpttool.errors import (
    AmbiguousFileError,
    CkptError,
    CorruptCheckpointError,
    NotACheckpointError,
    name_file,
)
from ckpttool.formats.base import (
    Checkpoint,
    FieldRewrite,
    FileFormat,
    Findings,
    Parsed,
    Recovered,
)
from ckpttool.io.source import is_url, local_path, open_local, open_source, shown_name, source_size
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    TensorRecord,
    stored_records,
    tensors,
)

#: Single-file formats, in sniffing order (``torch.load``'s): ``module:attribute`` of each
#: format's :class:`~ckpttool.formats.base.FileFormat`.
FILE_FORMATS = (
    "ckpttool.formats.torch_zip.format:FORMAT",
    "ckpttool.formats.safetensors_file:FORMAT",
    "ckpttool.formats.gguf.format:FORMAT",  # torch.load reads none: its magic is no other's
    "ckpttool.formats.torch_tar:FORMAT",  # before a pickle stream, as torch.load tries them
    "ckpttool.formats.torch_legacy.format:FORMAT",
)
#: Directory formats (one checkpoint in several files, recognised by an index file).
DIRECTORY_FORMATS = ("ckpttool.formats.dcp.format:FORMAT",)
#: How a checkpoint file's top-level fields are rewritten, its pickle spliced and every other
#: byte copied (``rescale-step``): a torch zip's records, or a legacy stream's bytes around it.
FIELD_REWRITE = "ckpttool.formats.torch_zip.rewrite"
#: ``scan``'s walk of a file every reader refused: the pickles ``torch.load`` would still run.
SALVAGE = "ckpttool.formats.torch_legacy.salvage:salvage_pickles"

_loaded: dict[str, Any] = {}


def _load(spec: str) -> Any:
    found = _loaded.get(spec)
    if found is None:
        module, _, attribute = spec.partition(":")
        found = _loaded[spec] = getattr(importlib.import_module(module), attribute)
    return found


def file_formats() -> Iterator[FileFormat]:
    """The single-file formats in sniffing order, each imported when reached."""
    return (_load(spec) for spec in FILE_FORMATS)


def directory_formats() -> Iterator[FileFormat]:
    return (_load(spec) for spec in DIRECTORY_FORMATS)


def format_by_id(format_id: str) -> FileFormat:
    """The format whose reader gives checkpoints of ``format_id`` (a vocabulary name)."""
    found = find_format(format_id)
    if found is None:
        raise KeyError(format_id)
    return found


def find_format(format_id: str) -> FileFormat | None:
    """:func:`format_by_id`, or None for a checkpoint no format module opened (a framework's
    directory)."""
    for spec in (*FILE_FORMATS, *DIRECTORY_FORMATS):
        fmt: FileFormat = _load(spec)
        if format_id in fmt.ids:
            return fmt
    return None


def format_lines(format_id: str, details: dict[str, Any]) -> list[str]:
    """``show``'s lines for a checkpoint's format facts (:meth:`FileFormat.show_lines`)."""
    found = find_format(format_id)
    return found.show_lines(details) if found is not None else []


def carries_metadata(format_id: str) -> bool:
    """Whether checkpoints of ``format_id`` carry string metadata (:attr:`FileFormat.string_metadata`)."""
    found = find_format(format_id)
    return found is not None and found.string_metadata


def holds_weights_only(format_id: str) -> bool:
    """Whether checkpoints of ``format_id`` hold tensors only (:attr:`FileFormat.weights_only`)."""
    found = find_format(format_id)
    return found is not None and found.weights_only


def as_checkpoint(
    name: str,
    parsed: Parsed,
    handle: Any,
    file_size: int,
    records: list[TensorRecord] | None = None,
    problems: list[str] | None = None,
) -> Checkpoint:
    """The :class:`Checkpoint` of a parsed file or directory (``handle`` None: several files,
    read through ``parsed.read``); ``records`` None: listed from the tree when first asked;
    ``problems`` None: the parse's own."""
    return Checkpoint(
        name=name,
        format=parsed.format,
        root=parsed.root,
        file_size=file_size,
        details=parsed.details,
        metadata=parsed.metadata,
        problems=list(parsed.problems) if problems is None else problems,
        pickle=parsed.pickle,
        _parsed=parsed,
        _handle=handle,
        _all_tensors=records,
    )


def checked(parsed: Parsed, strict: bool) -> tuple[list[TensorRecord], list[str]]:
    """The tensors of a parsed file and its problems (the first one raised when ``strict``)."""
    records = tensors(parsed.root, in_place=True)  # the tree is this parse's own
    # a pickled nn.Module's attributes that its state dict leaves out are bytes of the file too
    stored = records if parsed.objects is None else tensors(parsed.objects)
    problems = list(parsed.problems) + check_extents(parsed, stored)
    if problems and strict:
        raise CorruptCheckpointError(problems[0])
    return records, problems


def open_file(
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
        records, problems = checked(parsed, strict)
    except BaseException as error:
        close_on_error(error, name, handle, parsed)
        raise
    return as_checkpoint(name, parsed, handle, file_size, records, problems)


def field_rewrite(ckpt: Checkpoint, changes: Mapping[str, Any]) -> FieldRewrite:
    """The planned rewrite of ``ckpt``'s file with ``changes`` set on its top-level dict
    (:data:`FIELD_REWRITE`; raises :class:`~ckpttool.errors.LayoutError` when it cannot be)."""
    rewrite: FieldRewrite = _load(f"{FIELD_REWRITE}:FieldRewrite")(ckpt, changes)
    return rewrite


def verify_rewrite(
    old: Checkpoint, new_path: str | os.PathLike[str], changes: Mapping[str, Any]
) -> None:
    """Reopen ``new_path`` and check it is ``old`` with exactly ``changes`` applied."""
    _load(f"{FIELD_REWRITE}:verify_rewrite")(old, new_path, changes)


def open_path(
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    refuse_dangerous: bool = True,
    track_spans: bool = False,
) -> Checkpoint:
    """One local checkpoint file opened by its path (a written file read back, for instance)."""
    name = local_path(os.fspath(path))
    return open_file(name, open_local(name), strict, refuse_dangerous, track_spans)


def open_directory_format(
    fmt: FileFormat, name: str, index: BinaryIO, strict: bool, refuse_dangerous: bool
) -> Checkpoint:
    """A directory checkpoint of ``fmt`` (local, or a URL) whose index file is open."""
    parsed: Parsed | None = None
    try:
        directory: Any = name
        if not is_url(name):
            from pathlib import Path

            directory = Path(name)
        parsed = fmt.open_directory(
            directory, index, strict=strict, refuse_dangerous=refuse_dangerous
        )
        files = parsed.details.get("files", {})
        file_size = source_size(index) + sum(size for size in files.values() if size)
        records, problems = checked(parsed, strict)
    except BaseException as error:
        close_on_error(error, name, index, parsed)
        raise
    return as_checkpoint(name, parsed, index, file_size, records, problems)


def directory_format_of(path: str | os.PathLike[str]) -> FileFormat | None:
    """The directory format of a local directory (None: none recognises it)."""
    for fmt in directory_formats():
        if fmt.recognises_directory(path):
            return fmt
    return None


def incomplete_directory(path: str) -> CkptError | None:
    """The refusal of a local directory a directory format would read but cannot (DCP: data
    files without their ``.metadata``); None when no format claims it."""
    if not os.path.isdir(path):
        return None
    for fmt in directory_formats():
        refusal = fmt.incomplete_directory(path)
        if refusal is not None:
            return refusal
    return None


def scan_findings(path: Any, directory: bool) -> Findings | None:
    """``scan``'s own walk of ``path`` by its format's scan hook (``directory``: a directory
    checkpoint; a URL's directory is DCP's, the one directory format read from URLs); None
    when no format walks it itself (the file is then opened as usual)."""
    if directory:
        fmt = next(directory_formats()) if is_url(os.fspath(path)) else directory_format_of(path)
        return fmt.scan(path, open_any) if fmt is not None else None
    if not is_url(os.fspath(path)) and not os.path.isfile(path):
        return None  # a FIFO would block the hook's read: the reader refuses it in one line
    for fmt in file_formats():
        found = fmt.scan(path, open_any)
        if found is not None:
            return found
    return None


def recover_file(handle: BinaryIO, file_size: int) -> Recovered | None:
    """What a damaged local checkpoint file still holds, by the recover hook of the first
    format that recognises it (:meth:`FileFormat.recover`); None when no format recognises it
    or the one that does cannot recover."""
    head = handle.read(512)
    handle.seek(0)
    for fmt in file_formats():
        if fmt.recognises(head, file_size, handle):
            handle.seek(0)
            return fmt.recover(handle, file_size)
    return None


def salvage(path: Any, error: CkptError) -> tuple[str, Any, list[str], list[str]] | None:
    """``scan``'s walk of a file every reader refused (``error``): (format, globals, notes,
    problems), or None when the file is positively something else, or no regular file at all
    (the error stands: a FIFO would block the read, ``/dev/zero`` never ends)."""
    if not is_url(os.fspath(path)) and not os.path.isfile(path):
        return None

    def other_format(head: bytes, size: int) -> bool:  # a zip, or safetensors: no pickle
        safetensors = format_by_id("safetensors")
        return head.startswith(b"PK") or safetensors.recognises(head, size, None)  # type: ignore[arg-type]

    salvage_pickles = _load(SALVAGE)
    return salvage_pickles(path, error, other_format)


def open_any(path: Any) -> Any:
    """A local file, or a URL's remote file (read by ranges): what a scan hook reads."""
    return open_source(path) if isinstance(path, str) and is_url(path) else open(path, "rb")


def close_on_error(error: BaseException, name: str, handle: Any, parsed: Parsed | None) -> None:
    handle.close()
    if parsed is not None and parsed.close is not None:
        parsed.close()
    if isinstance(error, CkptError):
        name_file(error, shown_name(name))


def _read_pickled_module(parsed: Parsed) -> None:
    """``torch.save(model)`` pickles the module object, ultralytics two of them in a dict
    (``model``, ``ema``); every command wants what ``model.state_dict()`` would give, under its
    names: make that the tree (the object tree as pickled stays in ``parsed.objects``)."""
    from ckpttool.model.roles import PICKLED_MODULE, module_view

    result = parsed.pickle
    if result is not None and parsed.root is result.root and result.objects == 0:
        return  # the walk's tree holds no object, so no module: no walk of it (object_table)
    view = module_view(parsed.root)
    if view is None:
        return
    parsed.objects = parsed.root
    parsed.root = view.root
    if "" in view.classes:
        parsed.details["layout"] = PICKLED_MODULE
        parsed.details["module_class"] = view.classes[""]
    else:
        parsed.details["module_classes"] = view.classes


def _parse(
    handle: BinaryIO, file_size: int, strict: bool, refuse_dangerous: bool, track_spans: bool
) -> Parsed:
    """The file's bytes, read by the first format that recognises them (in torch.load's order);
    a gzip or tar archive, or anything else, is refused."""
    head = handle.read(512)  # a tar header's "ustar" is at byte 257
    handle.seek(0)
    formats = list(FILE_FORMATS)
    for index, spec in enumerate(formats):
        fmt: FileFormat = _load(spec)
        if not fmt.recognises(head, file_size, handle):
            continue
        other = (
            _other_reading(formats[index + 1 :], handle, file_size) if fmt.read_two_ways else None
        )
        parsed = fmt.open(
            handle,
            file_size,
            strict=strict,
            refuse_dangerous=refuse_dangerous,
            track_spans=track_spans,
        )
        if other is not None:
            parsed.details["ambiguous"] = (
                f"a {fmt.id} file that is also {other[0]}: torch.load reads it as {fmt.id} "
                f"under a *.{fmt.id} name and unpickles it under any other"
            )
            parsed.details["pickle_globals"] = other[1]  # what scan reports
        return parsed
    if head.startswith(b"\x1f\x8b") or head[257:262] == b"ustar":
        raise NotACheckpointError("a compressed or tar archive, not a checkpoint")
    raise NotACheckpointError(
        f"not a checkpoint: unrecognised format (first bytes {head[:8]!r}); ckpttool reads "
        "torch.save files (zip or legacy), safetensors, GGUF and pickles"
    )


def _other_reading(
    later: list[str], handle: BinaryIO, file_size: int
) -> tuple[str, list[Any]] | None:
    """What ``torch.load`` would read the file as, under a name not its format's own: the
    first later format that also reads it (its description and the globals it names)."""
    for spec in later:
        fmt: FileFormat = _load(spec)
        other = fmt.also_reads_as(handle, file_size)
        handle.seek(0)
        if other is not None:
            return other
    return None


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
