"""The torch.save zip ``convert`` (and DeepSpeed's universal checkpoint) write.

The writer takes the tensor *descriptions* first and the bytes afterwards, one tensor at a
time, so a file of any size is written with one tensor in memory. The zip's ``data.pkl`` is
generated here opcode by opcode, mirroring what ``torch.save`` emits for a state dict, so the
writer needs no torch. (safetensors' writer is beside its reader:
:mod:`ckpttool.formats.safetensors_file`.)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpttool.errors import InputError
from ckpttool.formats.base import OutTensor
from ckpttool.formats.torch_zip.zip_writer import TorchZipWriter
from ckpttool.model import dtypes
from ckpttool.model.records import ITEMSIZE
from ckpttool.pickle.edit import dtype_opcodes, emit_global, emit_ndarray, memo_get, memo_put

#: The zip folder of a written .pth (what torch.save uses when saving to a buffer).
PTH_PREFIX = "archive"

#: torch's typed storage class per dtype (``torch.storage._dtype_to_storage_type_map``); the
#: other dtypes (uint16, float8...) are saved by torch as an UntypedStorage plus the dtype
#: (the one dtype table's, :mod:`ckpttool.model.dtypes`).
STORAGE_CLASSES = dtypes.STORAGE_CLASSES


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


# --- torch.save's data.pkl ------------------------------------------------------------------


@dataclass(frozen=True)
class PickledTensor:
    """One state-dict entry: ``name`` is a view of the whole storage ``storage_key``."""

    name: str
    storage_key: str
    tensor: OutTensor


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True)
class _Call:
    func: _Global
    args: tuple[Any, ...]


@dataclass(frozen=True)
class _PersistentId:
    pid: tuple[Any, ...]


_ORDERED_DICT = _Global("collections", "OrderedDict")


def _encode(value: Any, out: bytearray) -> None:
    """Append the protocol-2 opcodes that build ``value`` (no memo: every value is small)."""
    if isinstance(value, bool):
        out += b"\x88" if value else b"\x89"  # NEWTRUE / NEWFALSE
    elif isinstance(value, int):
        if 0 <= value < 0x100:
            out += b"K" + bytes([value])  # BININT1
        elif 0 <= value < 0x10000:
            out += b"M" + struct.pack("<H", value)  # BININT2
        elif -(2**31) <= value < 2**31:
            out += b"J" + struct.pack("<i", value)  # BININT
        else:
            data = value.to_bytes((value.bit_length() >> 3) + 1, "little", signed=True)
            out += b"\x8a" + bytes([len(data)]) + data  # LONG1
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE
    elif isinstance(value, tuple):
        if not value:
            out += b")"  # EMPTY_TUPLE
            return
        if len(value) > 3:
            out += b"("  # MARK
        for item in value:
            _encode(item, out)
        out += b"t" if len(value) > 3 else b"\x85\x86\x87"[len(value) - 1 : len(value)]
    elif isinstance(value, _Global):
        out += f"c{value.module}\n{value.name}\n".encode("ascii")  # GLOBAL
    elif isinstance(value, _Call):
        _encode(value.func, out)
        _encode(value.args, out)
        out += b"R"  # REDUCE
    elif isinstance(value, _PersistentId):
        _encode(value.pid, out)
        out += b"Q"  # BINPERSID
    else:  # pragma: no cover - only the types above are ever passed
        raise TypeError(f"cannot encode {type(value).__name__}")


_REBUILD_PARAMETER = _Global("torch._utils", "_rebuild_parameter")


def _rebuild_call(
    entry: PickledTensor,
    storage_offset: int = 0,
    stride: tuple[int, ...] | None = None,
    storage_numel: int | None = None,
) -> _Call:
    """The call that rebuilds ``entry``: by default the whole of its storage, contiguous; else
    a view of a storage of ``storage_numel`` elements at ``storage_offset`` with ``stride``."""
    tensor = entry.tensor
    numel = math.prod(tensor.shape) if storage_numel is None else storage_numel
    size = tuple(tensor.shape)
    stride = contiguous_stride(tensor.shape) if stride is None else tuple(stride)
    hooks = _Call(_ORDERED_DICT, ())
    storage_class = STORAGE_CLASSES.get(tensor.dtype)
    if storage_class is not None:
        pid = ("storage", _Global("torch", storage_class), entry.storage_key, "cpu", numel)
        args: tuple[Any, ...] = (_PersistentId(pid), storage_offset, size, stride, False, hooks)
        return _Call(_Global("torch._utils", "_rebuild_tensor_v2"), args)
    if tensor.dtype.startswith(("q", "bits")):  # torch rebuilds these differently
        raise InputError(f"{tensor.name}: cannot write {tensor.dtype} tensors to a .pth")
    nbytes = numel * ITEMSIZE[tensor.dtype]
    storage = _Global("torch.storage", "UntypedStorage")
    pid = ("storage", storage, entry.storage_key, "cpu", nbytes)
    args = (_PersistentId(pid), storage_offset, size, stride, False, hooks,
            _Global("torch", tensor.dtype))  # fmt: skip
    return _Call(_Global("torch._utils", "_rebuild_tensor_v3"), args)


def state_dict_pickle(entries: Sequence[PickledTensor]) -> bytes:
    """``data.pkl`` of ``torch.save(OrderedDict(entries))``: the same opcodes, minus the memo.

    Entries that name the same ``storage_key`` share one storage when loaded (tied weights).
    """
    out = bytearray(b"\x80\x02")  # PROTO 2
    _encode(_Call(_ORDERED_DICT, ()), out)
    if entries:
        out += b"("  # MARK
        for entry in entries:
            _encode(entry.name, out)
            _encode(_rebuild_call(entry), out)
        out += b"u"  # SETITEMS
    out += b"."  # STOP
    return bytes(out)


def write_pth(
    handle: BinaryIO,
    entries: Sequence[PickledTensor],
    storages: Iterable[tuple[str, bytes | bytearray | memoryview]],
) -> None:
    """Write a torch.save zip: ``data.pkl`` for ``entries``, then each storage as it arrives.

    ``storages`` yields ``(key, bytes)`` one at a time (a generator), in the order the file
    should hold them; only one is alive at once.
    """
    _write_archive(handle, state_dict_pickle(entries), storages)


# --- any object tree (DeepSpeed's universal checkpoint files) --------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """A tensor inside an object written by :func:`write_torch_object`: by default the whole of
    storage ``storage_key``, contiguous; else (``storage_numel`` given) a view of that storage of
    ``storage_numel`` elements at ``storage_offset`` with ``stride``, as ``torch.save`` keeps
    views (several tensors may view one storage)."""

    storage_key: str
    tensor: OutTensor
    storage_offset: int = 0
    stride: tuple[int, ...] | None = None
    storage_numel: int | None = None
    # an nn.Parameter (a pickled module's): rebuilt as torch pickles one, around the tensor
    parameter: bool = False
    requires_grad: bool = False


@dataclass(frozen=True)
class CopiedStorage:
    """A storage's bytes as a range of another file, copied in the kernel, its CRC-32 known."""

    fd: int
    offset: int
    size: int
    crc: int


@dataclass(frozen=True)
class NumpyArray:
    """A NumPy array inside an object written by :func:`write_torch_object`, pickled as NumPy
    pickles it (its bytes inside ``data.pkl``, as ``torch.save`` keeps them)."""

    dtype: str  # the dtype's name ("uint32": ckpttool.model.dtypes)
    little_endian: bool
    shape: tuple[int, ...]
    fortran: bool  # column-major bytes
    data: bytes


#: A storage's bytes for :func:`write_torch_object`: in memory, or a range of a file to copy.
StorageBytes = bytes | bytearray | memoryview | CopiedStorage


def object_pickle(value: Any) -> bytes:
    """``data.pkl`` of ``torch.save(value)`` for a tree of plain values (None, bool, int,
    float, str, tuple, list, dict), :class:`StoredTensor` s and what the reader read: objects
    read as :class:`~ckpttool.model.records.OpaqueObject` (rebuilt by class name as the pickle
    built them, ``cls(*args)`` or ``cls.__new__(cls, *args)``, then their items and state; a
    :class:`~ckpttool.model.records.CalledObject` by calling the object it was built from),
    classes and functions held as values (``GlobalRef``) and dtypes (``TorchDtypeText``,
    ``NumpyDtypeText``). The class is named, never imported here."""
    out = bytearray(b"\x80\x02")
    _encode_object(value, out, 0, {})
    return bytes(out + b".")


#: An object written once, by its id: (its memo index, the object, kept alive for its id).
_Memo = dict[int, tuple[int, Any]]


def _encode_object(value: Any, out: bytearray, depth: int, memo: _Memo) -> None:
    """``value`` pickled; a tensor or object met again (a tied weight, a submodule two modules
    hold) is fetched from the memo, so the file gives one object again, as pickle would."""
    from ckpttool.model.records import OpaqueObject

    if isinstance(value, (StoredTensor, OpaqueObject)):
        known = memo.get(id(value))
        if known is not None:
            index = known[0]
            out += memo_get(index)
            return
        _encode_shared(value, out, depth, memo)
        index = len(memo)
        memo[id(value)] = (index, value)
        out += memo_put(index)
        return
    _encode_shared(value, out, depth, memo)


def _encode_shared(value: Any, out: bytearray, depth: int, memo: _Memo) -> None:
    from ckpttool.model.records import (
        CalledObject,
        GlobalRef,
        NumpyDtypeText,
        OpaqueObject,
        TensorSubclassObject,
        TorchDtypeText,
    )

    if depth > 64:
        raise InputError("the object nests too deeply to write")
    if value is None:
        out += b"N"
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)  # BINFLOAT
    elif isinstance(value, (TorchDtypeText, NumpyDtypeText)):
        out += dtype_opcodes(value)
    elif isinstance(value, (bool, int, str)):
        _encode(value, out)
    elif isinstance(value, tuple):
        out += b"("
        for item in value:
            _encode_object(item, out, depth + 1, memo)
        out += b"t"  # TUPLE
    elif isinstance(value, list):
        out += b"]("
        for item in value:
            _encode_object(item, out, depth + 1, memo)
        out += b"e"  # APPENDS
    elif isinstance(value, dict):
        out += b"}("
        for key, item in value.items():
            _encode_object(key, out, depth + 1, memo)
            _encode_object(item, out, depth + 1, memo)
        out += b"u"  # SETITEMS
    elif isinstance(value, (set, frozenset)):  # a module's _non_persistent_buffers_set
        # as protocol 2 pickles one: cls([items]); items in a stable order (a set has none)
        _encode(_Global("builtins", type(value).__name__), out)
        out += b"(]"
        if value:
            out += b"("
            for item in sorted(value, key=repr):
                _encode_object(item, out, depth + 1, memo)
            out += b"e"
        out += b"tR"
    elif isinstance(value, NumpyArray):
        _encode_numpy(value, out)
    elif isinstance(value, StoredTensor):
        entry = PickledTensor("", value.storage_key, value.tensor)
        call = _rebuild_call(entry, value.storage_offset, value.stride, value.storage_numel)
        if value.parameter:  # Parameter.__reduce_ex__: _rebuild_parameter(data, grad, hooks)
            call = _Call(_REBUILD_PARAMETER, (call, value.requires_grad, _Call(_ORDERED_DICT, ())))
        _encode(call, out)
    elif isinstance(value, TensorSubclassObject):
        raise InputError(
            f"cannot write a {value.cls} (a tensor subclass, such as torchao's quantized "
            "weights) back into a torch.save file; ckpttool convert writes its inner tensors, "
            "or with --dequantize its values"
        )
    elif isinstance(value, GlobalRef):  # a class or function held as a value
        opcodes = emit_global(value.module, value.name)
        if opcodes is None:
            raise InputError(f"cannot write the global {value.qualname!r}")
        out += opcodes
    elif isinstance(value, CalledObject):  # what an object the file built made, called
        _encode_object(value.args[0], out, depth + 1, memo)
        _encode_object(tuple(value.args[1:]), out, depth + 1, memo)
        out += b"\x81" if value.built_new() else b"R"  # NEWOBJ or REDUCE, as read
        _encode_contents(value, out, depth, memo)
    elif isinstance(value, OpaqueObject):
        module, _, name = value.cls.rpartition(".")
        if not module or "\n" in value.cls:
            raise InputError(f"cannot write an object of class {value.cls!r}")
        _encode(_Global(module, name), out)
        _encode_object(tuple(value.args or ()), out, depth + 1, memo)
        out += b"\x81" if value.built_new() else b"R"  # NEWOBJ or REDUCE
        _encode_contents(value, out, depth, memo)
    else:
        raise InputError(f"cannot write a {type(value).__name__} into a torch.save file")


def _encode_contents(value: Any, out: bytearray, depth: int, memo: _Memo) -> None:
    """An object's list items, dict items and state, onto the object just built."""
    if value.listitems:
        out += b"("
        for item in value.listitems:
            _encode_object(item, out, depth + 1, memo)
        out += b"e"
    if value.dictitems:
        out += b"("
        for key, item in value.dictitems.items():
            _encode_object(key, out, depth + 1, memo)
            _encode_object(item, out, depth + 1, memo)
        out += b"u"
    if value.state is not None:
        _encode_object(value.state, out, depth + 1, memo)
        out += b"b"  # BUILD


def _encode_numpy(array: NumpyArray, out: bytearray) -> None:
    code = dtypes.NUMPY_CODES.get(array.dtype)
    if code is None:
        raise InputError(f"cannot write a NumPy array of {array.dtype}")
    order = "|" if ITEMSIZE.get(array.dtype, 1) == 1 else "<" if array.little_endian else ">"
    out += emit_ndarray(code, order, array.shape, array.fortran, array.data)


def write_torch_object(
    handle: BinaryIO, value: Any, storages: Iterable[tuple[str, StorageBytes]]
) -> None:
    """Write a torch.save zip of ``value`` (see :func:`object_pickle`); its storages' bytes
    arrive one at a time from ``storages``."""
    _write_archive(handle, object_pickle(value), storages)


def _write_archive(
    handle: BinaryIO,
    data_pkl: bytes,
    storages: Iterable[tuple[str, StorageBytes]],
) -> None:
    """The records of a torch.save zip, in torch's order, around ``data.pkl``."""
    name = f"{PTH_PREFIX}/"
    with TorchZipWriter(handle) as writer:
        writer.write(name + "data.pkl", data_pkl)
        writer.write(name + ".format_version", b"1")
        writer.write(name + ".storage_alignment", b"64")
        writer.write(name + "byteorder", b"little")
        for key, data in storages:
            if isinstance(data, CopiedStorage):
                writer.write_copy(f"{name}data/{key}", data.fd, data.offset, data.size, data.crc)
            else:
                writer.write(f"{name}data/{key}", data)
        writer.write(name + "version", b"3\n")
