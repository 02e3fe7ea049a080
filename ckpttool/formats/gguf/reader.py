"""GGUF v2/v3 read lazily: the header, the metadata key/values, the tensor infos, and where the
data section starts; never a tensor's bytes.

A GGUF file (llama.cpp's ``gguf.h``, ``gguf-py``'s ``GGUFReader``) is, little-endian:
``GGUF``, a u32 version, u64 tensor count, u64 key/value count; the key/values (a string key,
a u32 value type, the value: a number, a bool, a string as u64 length + UTF-8 bytes, or an
array: u32 item type, u64 count, the items); the tensor infos (a string name, u32 dimension
count, u64 per dimension, u32 GGML type, u64 offset into the data section); padding to
``general.alignment`` (32 when absent), where the data section starts.

Every length is checked against the bytes left in the file before anything is read or
allocated: a lying count or length is a one-line error, never a huge allocation. A huge array
(``tokenizer.ggml.tokens``: a 150,000-string vocabulary) is stepped over and kept as its item
type and length. Reads go through :func:`ckpttool.io.source.read_range`, so a remote file is
read by ranges like any other format.
"""

from __future__ import annotations

import math
import struct
from typing import Any, BinaryIO

from ckpttool.errors import CorruptCheckpointError, NotACheckpointError
from ckpttool.formats.base import Parsed
from ckpttool.io.source import read_range, source_of
from ckpttool.model.dtypes import BY_NAME
from ckpttool.model.records import GGML_BLOCKS, QuantInfo, StorageRecord, TensorRecord

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
#: Longest key, tensor name or string value accepted (llama.cpp's own names are under 64
#: bytes; a chat template is some KB): a longer one is a damaged or hostile file.
MAX_STRING = 16 << 20
#: Arrays of at most this many items are kept in ``details``; longer ones by type and length.
KEPT_ITEMS = 16
#: Strings kept in ``details`` are cut to this many characters (a chat template is long).
KEPT_CHARS = 200
CHUNK = 1 << 20  # bytes read at a time from the header region

#: GGML type id -> name (ggml.h's ``enum ggml_type``; gguf-py's ``GGMLQuantizationType``).
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip
#: The GGML types that are plain element types: their torch dtype.
PLAIN_TYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
}  # fmt: skip

#: GGUF value type -> (name, struct code of a fixed-size value; "" for string and array).
VALUE_TYPES: dict[int, tuple[str, str]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
    4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"),
    8: ("STRING", ""), 9: ("ARRAY", ""), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"),
    12: ("FLOAT64", "<d"),
}  # fmt: skip
STRING, ARRAY = 8, 9


class _Cursor:
    """Sequential reads of the header region through ``read_range``, a chunk at a time, with
    every length checked against the file's size before it is read."""

    def __init__(self, handle: BinaryIO, file_size: int) -> None:
        self._source = source_of(handle)
        self.size = file_size
        self.position = 0
        self._buffer = b""
        self._start = 0  # file offset of self._buffer[0]

    def left(self) -> int:
        return self.size - self.position

    def need(self, length: int, what: str) -> None:
        if length > self.left():
            raise CorruptCheckpointError(
                f"GGUF {what} needs {length:,} bytes at byte {self.position:,}, but the file "
                f"has {self.left():,} left (truncated file?)"
            )

    def take(self, length: int, what: str) -> bytes:
        self.need(length, what)
        offset = self.position - self._start
        if offset + length > len(self._buffer):
            self._buffer = bytes(
                read_range(self._source, max(length, min(CHUNK, self.left())), self.position)
            )
            self._start, offset = self.position, 0
            if len(self._buffer) < length:
                raise CorruptCheckpointError(f"GGUF {what}: the file ends early (truncated)")
        self.position += length
        return self._buffer[offset : offset + length]

    def skip(self, length: int, what: str) -> None:
        self.need(length, what)
        self.position += length

    def unpack(self, code: str, what: str) -> Any:
        return struct.unpack(code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str, keep: bool = True) -> str:
        length = self.unpack("<Q", what)
        self.need(length, what)
        if length > MAX_STRING:
            raise CorruptCheckpointError(
                f"GGUF {what} claims a string of {length:,} bytes (at most {MAX_STRING:,} read)"
            )
        if not keep:
            self.skip(length, what)
            return ""
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptCheckpointError(f"GGUF {what} is not UTF-8") from None


def check_magic(head: bytes) -> None:
    """Refuse, in one line, what is a GGUF but not one this reader reads (v1, big-endian)."""
    if len(head) < 8:
        raise CorruptCheckpointError("GGUF header cut short: no version")
    version = struct.unpack("<I", head[4:8])[0]
    if version in VERSIONS:
        return
    swapped = struct.unpack(">I", head[4:8])[0]
    if swapped in (1, *VERSIONS):
        raise NotACheckpointError(
            f"a big-endian GGUF file (version {swapped}): ckpttool reads little-endian GGUF "
            "v2 and v3 only"
        )
    if version == 1:
        raise NotACheckpointError(
            "a GGUF v1 file: ckpttool reads GGUF v2 and v3 only (convert it with llama.cpp's "
            "gguf tools)"
        )
    raise NotACheckpointError(f"GGUF version {version} is not one ckpttool reads (v2, v3)")


def read_gguf(handle: BinaryIO, file_size: int, *, strict: bool) -> Parsed:
    """The file's tensors as records (torch-order shapes), its metadata in ``details``, and
    the problems found (raised, the first one, when ``strict``)."""
    cursor = _Cursor(handle, file_size)
    head = cursor.take(min(8, file_size), "header")
    if head[:4] != MAGIC:
        raise NotACheckpointError(f"not a GGUF file (first bytes {head[:4]!r})")
    check_magic(head)
    version = struct.unpack("<I", head[4:8])[0]
    n_tensors = cursor.unpack("<Q", "tensor count")
    n_kv = cursor.unpack("<Q", "metadata count")
    # each key/value takes at least 13 bytes (a key length, a type, a one-byte value), each
    # tensor info at least 24 (a name length, a dimension count, a type, an offset)
    cursor.need(n_kv * 13 + n_tensors * 24, f"header of {n_kv:,} key/values, {n_tensors:,} tensors")
    metadata: dict[str, Any] = {}
    for index in range(n_kv):
        key = cursor.string(f"metadata key {index}")
        metadata[key] = _value(cursor, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    problems: list[str] = []
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise CorruptCheckpointError(f"GGUF general.alignment is {alignment!r}: not a power of two")
    infos = [_tensor_info(cursor, index) for index in range(n_tensors)]
    data_start = -(-cursor.position // alignment) * alignment
    root: dict[str, TensorRecord] = {}
    starts: dict[str, int] = {}
    extents: list[tuple[int, int, str]] = []
    types: dict[str, int] = {}
    for name, ne, type_id, offset in infos:
        record, problem = _record(name, ne, type_id)
        if problem is not None:
            problems.append(problem)
            continue
        if name in root:
            problems.append(f"tensor {name!r}: listed twice")
            continue
        assert record is not None and record.storage is not None
        root[name] = record
        starts[name] = offset
        kind = GGML_TYPES[type_id]
        types[kind] = types.get(kind, 0) + 1
        nbytes = record.storage.data_size
        extents.append((offset, offset + nbytes, name))
        if offset % alignment:
            problems.append(
                f"tensor {name!r}: its offset {offset:,} is not a multiple of the alignment "
                f"{alignment}"
            )
    problems += _layout_problems(extents, data_start, file_size, alignment)
    if problems and strict:
        raise CorruptCheckpointError(f"invalid GGUF file: {problems[0]}")

    def span(storage: StorageRecord) -> tuple[int, int]:
        # the bytes the file has for it (a tensor cut short, or past the end, is refused when
        # read, before anything is allocated for it; verify reports it above)
        begin = data_start + starts[storage.key]
        return begin, max(0, min(storage.data_size, file_size - begin))

    from ckpttool.formats.gguf.quants import decode  # NumPy: imported when a value is read

    return Parsed(
        format="gguf",
        root=root,
        span=span,
        region=span,  # known without reading: a remote file's plan
        details=_details(version, metadata, alignment, data_start, types),
        storages=[r.storage for r in root.values() if r.storage is not None],
        problems=problems,
        dequantize=decode,
    )


def _value(cursor: _Cursor, key: str) -> Any:
    type_id = cursor.unpack("<I", f"type of {key!r}")
    if type_id == ARRAY:
        return _array(cursor, key)
    return _scalar(cursor, type_id, key)


def _scalar(cursor: _Cursor, type_id: int, key: str, keep: bool = True) -> Any:
    kind = VALUE_TYPES.get(type_id)
    if kind is None or type_id == ARRAY:
        raise CorruptCheckpointError(f"GGUF metadata {key!r} has unknown value type {type_id}")
    if type_id == STRING:
        return cursor.string(f"metadata {key!r}", keep=keep)
    code = kind[1]
    if not keep:
        cursor.skip(struct.calcsize(code), f"metadata {key!r}")
        return None
    return cursor.unpack(code, f"metadata {key!r}")


def _array(cursor: _Cursor, key: str) -> dict[str, Any]:
    """An array as ``{"array": item type, "length": n}``, with its ``items`` when it has at
    most :data:`KEPT_ITEMS` (a vocabulary is stepped over, never held)."""
    item_type = cursor.unpack("<I", f"array type of {key!r}")
    count = cursor.unpack("<Q", f"array length of {key!r}")
    kind = VALUE_TYPES.get(item_type)
    if kind is None:
        raise CorruptCheckpointError(f"GGUF metadata {key!r}: array of unknown type {item_type}")
    if item_type == ARRAY:  # arrays of arrays: the spec allows them; nothing uses them
        raise CorruptCheckpointError(f"GGUF metadata {key!r}: an array of arrays")
    size = struct.calcsize(kind[1]) if kind[1] else 8  # a string: at least its length field
    cursor.need(count * size, f"array {key!r} of {count:,} {kind[0]}")
    keep = count <= KEPT_ITEMS
    if item_type != STRING and not keep:
        cursor.skip(count * size, f"array {key!r}")
        return {"array": kind[0], "length": count}
    out: dict[str, Any] = {"array": kind[0], "length": count}
    if not keep:  # a vocabulary: each string's length read, its bytes stepped over
        for _ in range(count):
            _scalar(cursor, item_type, key, keep=False)
        return out
    out["items"] = [_kept(_scalar(cursor, item_type, key)) for _ in range(count)]
    return out


def _kept(value: Any) -> Any:
    if isinstance(value, str) and len(value) > KEPT_CHARS:
        return value[:KEPT_CHARS] + f"... ({len(value):,} characters)"
    return value


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(f"tensor {index}'s name")
    n_dims = cursor.unpack("<I", f"tensor {name!r}'s dimension count")
    if n_dims > MAX_DIMS:
        raise CorruptCheckpointError(
            f"GGUF tensor {name!r} has {n_dims} dimensions (GGML has at most {MAX_DIMS})"
        )
    ne = struct.unpack(f"<{n_dims}Q", cursor.take(8 * n_dims, f"tensor {name!r}'s dimensions"))
    type_id = cursor.unpack("<I", f"tensor {name!r}'s type")
    offset = cursor.unpack("<Q", f"tensor {name!r}'s offset")
    return name, ne, type_id, offset


def _record(name: str, ne: tuple[int, ...], type_id: int) -> tuple[TensorRecord | None, str | None]:
    """The tensor's record, or why there is none. GGUF stores ``ne[0]`` as the fastest
    (innermost) dimension; the shape is reported reversed, in torch's order, as gguf-py's
    reader and llama.cpp's converters present it (a [4096, 11008] ``ne`` is a torch
    ``[11008, 4096]`` weight)."""
    kind = GGML_TYPES.get(type_id)
    if kind is None:
        return None, f"tensor {name!r}: unknown GGML type {type_id}"
    shape = tuple(reversed(ne))
    if any(size >= 1 << 62 for size in shape) or math.prod(shape) >= 1 << 62:
        return None, f"tensor {name!r}: its shape {list(shape)} is too large"
    numel = math.prod(shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    plain = PLAIN_TYPES.get(kind)
    if plain is not None:
        nbytes = numel * BY_NAME[plain].itemsize
        storage = StorageRecord(name, plain, numel, "cpu", "gguf", nbytes)
        return TensorRecord(name, plain, shape, stride, 0, storage), None
    block = BY_NAME[kind]
    if ne and ne[0] % block.per_byte:
        return None, (
            f"tensor {name!r}: its rows of {ne[0]:,} values are not whole {kind} blocks of "
            f"{block.per_byte}"
        )
    nbytes = numel // block.per_byte * block.itemsize
    storage = StorageRecord(name, "uint8", nbytes, "cpu", "gguf", nbytes)
    quant = QuantInfo(GGML_BLOCKS)
    return TensorRecord(name, kind, shape, stride, 0, storage, quant=quant), None


def _layout_problems(
    extents: list[tuple[int, int, str]], data_start: int, file_size: int, alignment: int
) -> list[str]:
    """Each tensor inside the file, none overlapping another, nothing after the last one but
    its padding to the alignment."""
    problems = []
    position, previous = 0, ""
    for begin, end, name in sorted(extents):
        if begin < position:
            problems.append(
                f"tensor {name!r}: overlaps tensor {previous!r} by {position - begin:,} bytes"
            )
        if data_start + end > file_size:
            problems.append(
                f"tensor {name!r}: ends at byte {data_start + end:,}, past the end of the file "
                f"({file_size:,} bytes; truncated?)"
            )
        if end > position:
            position, previous = end, name
    if extents:
        padded = data_start + -(-position // alignment) * alignment
        if file_size > padded:
            problems.append(f"{file_size - padded:,} trailing bytes after the last tensor")
    return problems


def _details(
    version: int, metadata: dict[str, Any], alignment: int, data_start: int, types: dict[str, int]
) -> dict[str, Any]:
    """What ``show`` prints of the file: its version, layout, model facts, GGML types and
    every metadata key (long strings cut, long arrays by type and length)."""
    architecture = metadata.get("general.architecture")
    facts: dict[str, Any] = {}
    if isinstance(architecture, str):
        facts["architecture"] = architecture
        for fact, suffix in (
            ("context_length", "context_length"),
            ("block_count", "block_count"),
            ("embedding_length", "embedding_length"),
        ):
            value = metadata.get(f"{architecture}.{suffix}")
            if value is not None:
                facts[fact] = value
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, dict):
        facts["vocabulary"] = tokens["length"]
    return {
        "gguf_version": version,
        "alignment": alignment,
        "data_offset": data_start,
        "gguf_model": facts,
        "ggml_types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
        "gguf_metadata": {key: _kept(value) for key, value in metadata.items()},
    }
