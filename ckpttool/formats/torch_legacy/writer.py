"""A tree written as torch.save's legacy stream (``repair``'s output for a legacy file).

The layout of ``torch.save(obj, f, _use_new_zipfile_serialization=False)``: the magic number,
protocol version and system info pickles (the very bytes torch writes on a little-endian
machine), the object pickle, the sorted list of storage keys, then each storage as an 8-byte
little-endian element count and its bytes, in that list's order. The object pickle is protocol
2 generated opcode by opcode (memoized only where an object is met again), each tensor a ``_rebuild_tensor_v2`` call on a
persistent id ``("storage", torch.<Type>Storage, key, "cpu", numel, None)``, as torch's legacy
pickler writes it; ``torch.load(weights_only=True)`` reads it. The writer needs no torch.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, BinaryIO

from ckpttool.errors import LayoutError
from ckpttool.model.dtypes import NUMPY_CODES, STORAGE_CLASSES
from ckpttool.model.records import (
    ITEMSIZE,
    CalledObject,
    GlobalRef,
    NumpyDtypeText,
    OpaqueObject,
    TensorRecord,
    TorchDtypeText,
    rebuildable_storage,
    with_fields,
)
from ckpttool.pickle.edit import (
    dtype_opcodes,
    emit,
    emit_global,
    emit_ndarray,
    memo_get,
    memo_put,
)

#: The first three pickles of a legacy file as torch.save writes them (protocol 2, little-endian):
#: the magic number, the protocol version (1001) and the system info dict.
HEADER = (
    b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
    b"\x80\x02M\xe9\x03."
    b"\x80\x02}q\x00(X\x10\x00\x00\x00protocol_versionq\x01M\xe9\x03"
    b"X\r\x00\x00\x00little_endianq\x02\x88X\n\x00\x00\x00type_sizesq\x03}q\x04("
    b"X\x05\x00\x00\x00shortq\x05K\x02X\x03\x00\x00\x00intq\x06K\x04"
    b"X\x04\x00\x00\x00longq\x07K\x04uu."
)

_MAX_DEPTH = 64
_Region = tuple[str, int, int]  # (source storage key, first byte, byte length)


def write_legacy(handle: BinaryIO, root: Any, read: Callable[[str], bytes]) -> None:
    """Write ``root`` as a legacy torch.save file: each tensor the same view (offset, shape,
    strides) of the same whole storage as in the source (tensors that shared one share it
    again); NumPy arrays in the pickle, as NumPy pickles them. ``read(key)`` gives a source
    storage's bytes, read once per storage written."""
    regions: dict[_Region, tuple[str, str]] = {}  # -> (new key, dtype)
    body = bytearray(b"\x80\x02")
    _encode(root, body, regions, 0, {})
    body += b"."
    keys = sorted(key for key, _ in regions.values())  # torch sorts its keys (as strings)
    listed = bytearray(b"\x80\x02]")
    if keys:
        listed += b"("
        for key in keys:
            listed += emit(key)
        listed += b"e"
    listed += b"."
    handle.write(HEADER)
    handle.write(bytes(body))
    handle.write(bytes(listed))
    by_key = {key: (region, dtype) for region, (key, dtype) in regions.items()}
    for key in keys:
        (source, first, nbytes), dtype = by_key[key]
        data = read(source)[first : first + nbytes]
        if len(data) != nbytes:
            raise LayoutError(f"storage {source!r} holds fewer bytes than its tensors need")
        handle.write(struct.pack("<q", nbytes // ITEMSIZE[dtype]))
        handle.write(data)


#: An object written once, by its id: (its memo index, the object, kept alive for its id).
_Memo = dict[int, tuple[int, Any]]


def _encode(
    value: Any, out: bytearray, regions: dict[_Region, tuple[str, str]], depth: int, memo: _Memo
) -> None:
    """``value`` pickled; a tensor or object met again (a tied weight, a submodule two modules
    hold) is fetched from the memo, so the file gives one object again, as pickle would."""
    if isinstance(value, (TensorRecord, OpaqueObject)):
        known = memo.get(id(value))
        if known is not None:
            index = known[0]
            out += memo_get(index)
            return
        if isinstance(value, TensorRecord):
            _encode_tensor(value, out, regions, memo)
        else:
            _encode_object(value, out, regions, depth, memo)
        index = len(memo)
        memo[id(value)] = (index, value)
        out += memo_put(index)
        return
    if depth > _MAX_DEPTH:
        raise LayoutError("the object nests too deeply to write")
    if isinstance(value, (TorchDtypeText, NumpyDtypeText)):
        out += dtype_opcodes(value)
    elif value is None or isinstance(value, (bool, int, float, str)):
        out += emit(value)
    elif isinstance(value, tuple):
        if not value:
            out += b")"  # EMPTY_TUPLE
            return
        out += b"("
        for item in value:
            _encode(item, out, regions, depth + 1, memo)
        out += b"t"  # TUPLE
    elif isinstance(value, list):
        out += b"]"
        if value:
            out += b"("
            for item in value:
                _encode(item, out, regions, depth + 1, memo)
            out += b"e"  # APPENDS
    elif isinstance(value, dict):
        out += b"}"
        if value:
            _items(value, out, regions, depth, memo)
    elif isinstance(value, (set, frozenset)):  # a module's _non_persistent_buffers_set
        # as protocol 2 pickles one: cls([items]); items in a stable order (a set has none)
        out += _global("builtins", type(value).__name__) + b"(]"
        if value:
            out += b"("
            for item in sorted(value, key=repr):
                _encode(item, out, regions, depth + 1, memo)
            out += b"e"
        out += b"tR"
    elif isinstance(value, GlobalRef):  # a class or function held as a value
        opcodes = emit_global(value.module, value.name)
        if opcodes is None:
            raise LayoutError(f"cannot write the global {value.qualname!r}")
        out += opcodes
    else:
        raise LayoutError(f"cannot write a {type(value).__name__} into a legacy torch.save file")


def _items(value: dict[Any, Any], out: bytearray, regions: dict[_Region, tuple[str, str]],
           depth: int, memo: _Memo) -> None:  # fmt: skip
    out += b"("
    for key, item in value.items():
        _encode(key, out, regions, depth + 1, memo)
        _encode(item, out, regions, depth + 1, memo)
    out += b"u"  # SETITEMS


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode("ascii")


def _encode_object(value: OpaqueObject, out: bytearray, regions: dict[_Region, tuple[str, str]],
                   depth: int, memo: _Memo) -> None:  # fmt: skip
    """An object read as opaque, rebuilt as the pickle built it: by class name, ``cls(*args)``
    or ``cls.__new__(cls, *args)`` (the class is named, never imported), or by calling the object
    a :class:`~ckpttool.model.records.CalledObject` was built from; then its items and state."""
    if isinstance(value, CalledObject):  # what an object the file built made, called
        _encode(value.args[0], out, regions, depth + 1, memo)
        _encode(tuple(value.args[1:]), out, regions, depth + 1, memo)
        out += b"\x81" if value.built_new() else b"R"  # NEWOBJ or REDUCE, as read
    else:
        module, _, name = value.cls.rpartition(".")
        if not module or "\n" in value.cls or not value.cls.isascii():
            raise LayoutError(f"cannot write an object of class {value.cls!r}")
        out += _global(module, name)
        _encode(tuple(value.args or ()), out, regions, depth + 1, memo)
        out += b"\x81" if value.built_new() else b"R"  # NEWOBJ or REDUCE
    if value.listitems:
        out += b"("
        for item in value.listitems:
            _encode(item, out, regions, depth + 1, memo)
        out += b"e"
    if value.dictitems:
        _items(value.dictitems, out, regions, depth, memo)
    if value.state is not None:
        _encode(value.state, out, regions, depth + 1, memo)
        out += b"b"  # BUILD


def _encode_tensor(
    record: TensorRecord, out: bytearray, regions: dict[_Region, tuple[str, str]], memo: _Memo
) -> None:
    storage = record.storage
    storage_class = STORAGE_CLASSES.get(record.dtype)
    if record.kind == "ndarray" and record.inline_data is not None and storage is not None:
        code = NUMPY_CODES.get(record.dtype)  # a NumPy array: its bytes are in the pickle
        if code is None:
            raise LayoutError(f"{record.key}: cannot write a NumPy array of {record.dtype}")
        fortran = len(record.shape) > 1 and not record.is_contiguous
        order = "|" if ITEMSIZE[record.dtype] == 1 else ">" if storage.byteorder == "big" else "<"
        out += emit_ndarray(code, order, tuple(record.shape), fortran, record.inline_data)
        return
    if record.kind == "parameter":  # Parameter.__reduce_ex__: _rebuild_parameter(data, ...)
        out += _global("torch._utils", "_rebuild_parameter") + b"("
        _encode_tensor(with_fields(record, kind="tensor", requires_grad=False), out, regions, memo)
        out += emit(bool(record.requires_grad))
        out += _global("collections", "OrderedDict") + b")R"  # backward hooks: OrderedDict()
        out += b"tR"  # TUPLE, REDUCE
        return
    storage = rebuildable_storage(record)
    if storage_class is None:
        raise LayoutError(f"{record.key}: cannot rebuild a {record.dtype} {record.layout} tensor")
    # the whole storage, and the tensor as the same view of it (offset, strides) as torch kept
    region = (storage.key, 0, storage.nbytes)
    key, _ = regions.setdefault(region, (str(len(regions)), record.dtype))
    out += _global("torch._utils", "_rebuild_tensor_v2")
    out += b"("  # the call's arguments
    out += b"(" + emit("storage") + _global("torch", storage_class) + emit(key) + emit("cpu")
    out += emit(storage.nbytes // ITEMSIZE[record.dtype]) + b"Nt"  # view_metadata None, TUPLE
    out += b"Q"  # BINPERSID
    out += emit(record.storage_offset)
    _encode(tuple(record.shape), out, regions, 0, memo)
    _encode(tuple(record.stride), out, regions, 0, memo)
    out += emit(bool(record.requires_grad))
    out += _global("collections", "OrderedDict") + b")R"  # backward hooks: OrderedDict()
    out += b"tR"  # TUPLE, REDUCE
