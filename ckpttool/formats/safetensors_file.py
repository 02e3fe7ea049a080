"""safetensors: an 8-byte header length, a JSON header, then the tensor bytes; read and written.

The header is checked by the rules the format sets (and that the reference implementation
enforces): length limit, offsets contiguous from 0 with no gap or overlap, each size equal to
numel x itemsize, nothing after the last tensor. The writer (``convert``'s) takes the tensor
descriptions first and the bytes afterwards: the header is known before any data. The format
as the registry drives it is :data:`FORMAT`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.errors import CUT_HINT, CorruptCheckpointError, InputError
from ckpttool.formats.base import FileFormat, OutTensor, Parsed, Recovered
from ckpttool.model.dtypes import SAFETENSORS_CODES, SAFETENSORS_DTYPES
from ckpttool.model.records import (
    ITEMSIZE,
    StorageRecord,
    TensorRecord,
    fits_int64,
    numel_fits_int64,
)

if TYPE_CHECKING:
    from ckpttool.io.blocks import FileRange

MAX_HEADER = 100_000_000  # the limit safetensors itself enforces
#: safetensors pads its header with spaces so that the data starts 8-byte aligned.
HEADER_ALIGNMENT = 8

#: safetensors code -> dtype, and back (the one dtype table's, :mod:`ckpttool.model.dtypes`)
DTYPES = SAFETENSORS_DTYPES
CODES = SAFETENSORS_CODES


def header_length(first_bytes: bytes) -> int:
    return int(struct.unpack("<Q", first_bytes[:8])[0])


def looks_like_safetensors(first_bytes: bytes, file_size: int) -> bool:
    if len(first_bytes) < 9:
        return False
    n = header_length(first_bytes)
    return first_bytes[8:9] == b"{" and n >= 2


def read_safetensors(handle: BinaryIO, file_size: int, *, strict: bool) -> Parsed:
    handle.seek(0)
    n = header_length(handle.read(8))
    if n > MAX_HEADER:
        raise CorruptCheckpointError(
            f"safetensors header claims {n:,} bytes (the format's limit is {MAX_HEADER:,})"
        )
    if 8 + n > file_size:
        raise CorruptCheckpointError(
            f"safetensors header claims {n:,} bytes but the file has {file_size - 8:,} after "
            "its length field (truncated file?)"
        )
    try:
        header = json.loads(handle.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptCheckpointError(f"safetensors header is not valid JSON: {error}") from None
    except RecursionError:  # what Python's decoder raises on [[[[...]]]] 100,000 deep
        raise CorruptCheckpointError("safetensors header nests JSON too deeply") from None
    except ValueError:  # the only other: a number of more than 4,300 digits
        raise CorruptCheckpointError(
            "safetensors header holds a number of more than 4,300 digits"
        ) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptCheckpointError("safetensors __metadata__ must map strings to strings")
    data_start = 8 + n
    problems: list[str] = []
    root: dict[str, Any] = {}
    extents: list[tuple[int, int, str]] = []
    # each tensor's data offsets, kept for reading; the parsed header (a dict and two lists
    # per tensor) is not: at 100,000 tensors it was a third of the memory the file held
    starts: dict[str, int] = {}  # each tensor's first data byte (its storage has its length)
    layouts: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
    # each entry is taken out of the parsed header as it becomes a record: both whole at once
    # were the peak of reading a 100,000-tensor file (about 40 MB more)
    for name in list(header):
        info = header.pop(name)
        record = _tensor(name, info, layouts)
        begin, end = info["data_offsets"]
        starts[name] = begin
        if end - begin != record.nbytes:
            problems.append(
                f"{name}: holds {end - begin:,} bytes, but {record.dtype}{list(record.shape)} "
                f"needs {record.nbytes:,}"
            )
        root[name] = record
        extents.append((begin, end, name))
    extents.sort()
    position = 0
    for begin, end, name in extents:
        if begin > position:
            problems.append(f"{name}: {begin - position:,} unused bytes before it (a gap)")
        elif begin < position:
            problems.append(f"{name}: overlaps the tensor before it by {position - begin:,} bytes")
        position = max(position, end)
    data_size = file_size - data_start
    if position > data_size:
        problems.append(
            f"tensors extend {position - data_size:,} bytes past the end of the file{CUT_HINT}"
        )
    elif position < data_size:
        problems.append(f"{data_size - position:,} trailing bytes after the last tensor")
    if problems and strict:
        raise CorruptCheckpointError(f"invalid safetensors file: {problems[0]}")

    del header, extents

    def span(storage: StorageRecord) -> tuple[int, int]:
        return data_start + starts[storage.key], storage.data_size

    return Parsed(
        format="safetensors",
        root=root,
        span=span,
        region=span,  # known without reading: a remote file's plan
        details={"header_bytes": n},
        metadata=metadata,
        storages=[t.storage for t in root.values() if t.storage is not None],
        problems=problems,
    )


def _tensor(
    name: str,
    info: Any,
    layouts: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...], tuple[int, ...]]],
) -> TensorRecord:
    """One header entry as a record. ``layouts``: (dtype code, shape) -> (dtype, shape,
    stride) of the entries already checked, so that the many tensors of one shape share their
    tuples and skip the shape's checks (a file's data offsets are checked every time)."""
    known = _known_layout(info, layouts) if type(info) is dict else None
    if known is not None:
        (dtype, shape, stride), begin, end = known
        return TensorRecord(name, dtype, shape, stride, 0, _storage(name, dtype, shape, begin, end))
    try:
        dtype_code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(
            type(v) is int and v >= 0 for v in [*shape, begin, end]
        ):
            raise ValueError("negative or non-integer size")
        if end < begin:
            raise ValueError("data_offsets end before they begin")
        if not (numel_fits_int64(shape) and fits_int64(end)):
            raise ValueError("sizes beyond int64")
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptCheckpointError(f"safetensors entry {name!r} is malformed ({error})") from None
    if not isinstance(dtype_code, str) or dtype_code not in DTYPES:
        raise CorruptCheckpointError(f"safetensors entry {name!r} has unknown dtype {dtype_code!r}")
    dtype = DTYPES[dtype_code]
    shape = tuple(shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    layouts[(dtype_code, shape)] = (dtype, shape, stride)
    return TensorRecord(name, dtype, shape, stride, 0, _storage(name, dtype, shape, begin, end))


def _known_layout(
    info: dict[str, Any],
    layouts: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...], tuple[int, ...]]],
) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], int, int] | None:
    """The checked layout of an entry whose dtype and shape were seen before, and its data
    offsets when they pass :func:`_tensor`'s checks; None: check the entry in full."""
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    for size in shape:  # (4.0, 4) would find (4, 4)'s entry
        if type(size) is not int:
            return None
    code = info.get("dtype")
    known = layouts.get((code, tuple(shape))) if type(code) is str else None
    begin, end = offsets
    if known is None or type(begin) is not int or type(end) is not int:
        return None
    if not 0 <= begin <= end or not fits_int64(end):
        return None
    return known, begin, end


def _storage(name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> StorageRecord:
    # its record: the file's data section, where the key (the tensor's name) finds its bytes
    numel = math.prod(shape)
    storage = StorageRecord(
        name, dtype, (end - begin) // ITEMSIZE[dtype], "cpu", "safetensors", end - begin
    )
    if numel * ITEMSIZE[dtype] > end - begin:
        storage = StorageRecord(name, dtype, numel, "cpu", "safetensors", end - begin)
    return storage


# --- safetensors ----------------------------------------------------------------------------


def safetensors_header(tensors: Sequence[OutTensor], metadata: Mapping[str, str]) -> bytes:
    """Length field plus JSON header for ``tensors`` stored back to back in this order.

    The text is what ``json.dumps(header, ensure_ascii=False, separators=(",", ":"))`` gives
    for the header as a dict, made one entry at a time: at 100,000 tensors the dict of dicts
    took 50 MB for a moment, for 7 MB of text.
    """
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    parts = [f'"__metadata__":{dumps(dict(metadata))}'] if metadata else []
    names = {"__metadata__"} if metadata else set()
    offset = 0
    for tensor in tensors:
        code = CODES.get(tensor.dtype)
        if code is None:
            raise InputError(
                f"{tensor.name}: safetensors cannot store {tensor.dtype} tensors; leave it out "
                "with --filter or write a .pth (--to pth)"
            )
        if tensor.name in names:
            raise InputError(f"{tensor.name!r} cannot be a tensor name in safetensors")
        names.add(tensor.name)
        end = offset + tensor.nbytes
        shape = ",".join(map(str, tensor.shape))
        parts.append(
            f'{dumps(tensor.name)}:{{"dtype":"{code}","shape":[{shape}],'
            f'"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    del parts, names
    text += b" " * ((-len(text)) % HEADER_ALIGNMENT)
    if len(text) > MAX_HEADER:
        raise InputError(
            f"the safetensors header would be {len(text):,} bytes (limit {MAX_HEADER:,}): "
            "too many tensors or too much metadata for one file; shard with --max-shard-size"
        )
    return struct.pack("<Q", len(text)) + text


def safetensors_size(tensors: Sequence[OutTensor], metadata: Mapping[str, str]) -> int:
    """The exact size of the file :func:`safetensors_header` plus the data make."""
    return len(safetensors_header(tensors, metadata)) + sum(t.nbytes for t in tensors)


class SafetensorsFormat(FileFormat):
    id = "safetensors"
    ids = ("safetensors",)
    read_two_ways = True  # torch.load unpickles it under any name but *.safetensors
    copies_ranges = True  # a tensor's bytes are written as they are: no CRC to take
    string_metadata = True  # __metadata__
    weights_only = True

    def recognises(self, head: bytes, file_size: int, handle: BinaryIO) -> bool:
        return looks_like_safetensors(head, file_size)

    def open(
        self,
        handle: BinaryIO,
        file_size: int,
        *,
        strict: bool,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> Parsed:
        return read_safetensors(handle, file_size, strict=strict)

    def recover(self, handle: BinaryIO, file_size: int) -> Recovered | None:
        """Every tensor whose bytes lie inside the file (trailing bytes dropped, a tensor cut
        short lost); a header that is cut or broken leaves nothing to recover (its error)."""
        parsed = read_safetensors(handle, file_size, strict=False)
        intact = {}
        for record in parsed.root.values():
            storage = record.storage
            offset, length = parsed.span(storage)
            if length == record.nbytes and offset + length <= file_size:
                intact[storage.key] = (offset, length)
        metadata = dict(parsed.metadata)

        def write(out: BinaryIO, root: Any, read: Callable[[str], bytes]) -> None:
            records = list(root.values())
            out_tensors = [OutTensor(name, r.dtype, tuple(r.shape)) for name, r in root.items()]
            out.write(safetensors_header(out_tensors, metadata))
            for record in records:
                out.write(read(record.storage.key)[: record.nbytes])

        return Recovered("safetensors", parsed.root, intact, list(parsed.problems), write, metadata)

    def write(
        self,
        handle: BinaryIO,
        tensors: Sequence[OutTensor],
        data: Iterable[bytes | bytearray | memoryview | FileRange],
        names: Sequence[str],
        aliases: Mapping[str, str],
        metadata: Mapping[str, str],
    ) -> int:
        from ckpttool.io.blocks import write_data  # (not at start-up: show never writes)

        header = safetensors_header(tensors, metadata)
        handle.write(header)
        for chunk in data:
            write_data(handle, chunk)
        return len(header) + sum(t.nbytes for t in tensors)


FORMAT = SafetensorsFormat()
