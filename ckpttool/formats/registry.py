"""One checkpoint file opened: its format recognised from its first bytes, parsed, checked.

The formats are tried in the order ``torch.load`` tries them (a zip, then, under any name, what it
would unpickle); a file that reads two ways is refused unless the caller asks (``scan``).
Directories are the door's (:mod:`ckpttool.checkpoint`).
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from ckpttool.errors import (
    AmbiguousFileError,
    CkptError,
    CorruptCheckpointError,
    NotACheckpointError,
    name_file,
)
from ckpttool.formats.base import DCP_METADATA, Checkpoint, Parsed
from ckpttool.formats.safetensors_file import looks_like_safetensors, read_safetensors
from ckpttool.formats.torch_legacy import read_pickle_stream
from ckpttool.formats.torch_tar import TAR_REFUSAL, is_torch_tar
from ckpttool.formats.torch_zip.reader import read_torch_zip
from ckpttool.io.source import shown_name, source_size
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    StorageRecord,
    TensorRecord,
    stored_records,
    tensors,
)
from ckpttool.pickle.interpreter import SafeUnpickler


def as_checkpoint(
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


def checked(parsed: Parsed, strict: bool) -> tuple[list[TensorRecord], list[str]]:
    """The tensors of a parsed file and its problems (the first one raised when ``strict``)."""
    records = tensors(parsed.root, in_place=True)  # the tree is this parse's own
    problems = list(parsed.problems) + check_extents(parsed, records)
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


def close_on_error(error: BaseException, name: str, handle: Any, parsed: Parsed | None) -> None:
    handle.close()
    if parsed is not None and parsed.close is not None:
        parsed.close()
    if isinstance(error, CkptError):
        name_file(error, shown_name(name))


def _read_pickled_module(parsed: Parsed) -> None:
    """``torch.save(model)`` pickles the module object; every command wants what
    ``model.state_dict()`` would give, under its names: make that the tree."""
    from ckpttool.model.roles import PICKLED_MODULE, module_state_dict

    state_dict = module_state_dict(parsed.root)
    if state_dict is not None:
        parsed.details["layout"] = PICKLED_MODULE
        parsed.details["module_class"] = parsed.root.cls
        parsed.root = state_dict


def dcp_without_metadata(path: str) -> CorruptCheckpointError:
    """The refusal of a directory of DCP shards without its ``.metadata`` (where the door
    would otherwise say "is a directory": :func:`ckpttool.io.source.open_local`'s wording)."""
    return CorruptCheckpointError(
        f"{path}: a torch.distributed.checkpoint directory without its {DCP_METADATA} file "
        "(DCP writes it last: the save did not finish); use the previous checkpoint"
    )


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


def has_dcp_shards(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(entry.name.endswith(".distcp") for entry in entries)
    except OSError:  # unreadable: say "a directory", as for any other
        return False
