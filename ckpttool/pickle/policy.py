"""What the safe unpickler allows: the data constructs it emulates and the names it refuses.

The policy is an allow-list: a call is *emulated* (never performed) only for the constructs
below — torch's tensor rebuilders, ``OrderedDict``, NumPy arrays/scalars/dtypes,
``argparse.Namespace``, a few builtins; anything else becomes an
:class:`~ckpttool.records.OpaqueObject`. The deny-list of
dangerous names only decides whether to refuse a file outright (and how ``scan`` classes a
global); safety never depends on it, since nothing named is ever imported or called.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckpttool.errors import CorruptCheckpointError, ResourceLimitError
from ckpttool.records import (
    ITEMSIZE,
    GlobalRef,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    fits_int64,
    numel_fits_int64,
)

if TYPE_CHECKING:
    from ckpttool.pickle.interpreter import SafeUnpickler


# Modules (and builtins) whose only use in a checkpoint is to run code or touch the system.
_DANGEROUS_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "posixpath",
        "ntpath",
        "subprocess",
        "sys",
        "runpy",
        "importlib",
        "imp",
        "pty",
        "shutil",
        "socket",
        "pickle",
        "_pickle",
        "cPickle",
        "marshal",
        "ctypes",
        "code",
        "codeop",
        "pdb",
        "bdb",
        "pydoc",  # pydoc.pipepager(text, cmd) runs a shell: a known block-list bypass
        "webbrowser",
        "multiprocessing",
        "asyncio",
        "functools",
        "operator",
        "types",
        "inspect",
        "platform",
        "pip",
        "setuptools",
        "tempfile",
        "io",
        "_io",
        "signal",
        "threading",
        "_thread",
        "timeit",
        "trace",
        "cProfile",
        "profile",
        "doctest",
        "ensurepip",
        "venv",
        "sysconfig",
        "zipimport",
        "pkgutil",
        "site",
        "commands",
        "popen2",
        "urllib",
        "http",
        "ftplib",
        "telnetlib",
        "smtplib",
        "requests",
        "shelve",
        "dbm",
        "sqlite3",
        "glob",
        "fcntl",
        "resource",
        "gc",
        "weakref",
        "copy",
        "nturl2path",
        "_posixsubprocess",
        "_osx_support",
        "distutils",
        "xmlrpc",
        "logging",
        "unittest",
    }
)
_DANGEROUS_PREFIXES = ("torch.hub", "torch.jit", "torch._C", "torch.ops", "torch._dynamo")
_DANGEROUS_NAMES = frozenset(
    {
        "builtins.eval",
        "builtins.exec",
        "builtins.compile",
        "builtins.open",
        "builtins.__import__",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.input",
        "builtins.breakpoint",
        "builtins.exit",
        "builtins.quit",
        "builtins.help",
        "builtins.memoryview",
        "builtins.type",
        "builtins.object",
        "builtins.super",
        "builtins.classmethod",
        "builtins.staticmethod",
        "builtins.property",
        "torch.load",
        "torch.serialization.load",
        "torch.save",
        "numpy.load",
        "numpy.save",
        "numpy.fromfile",
        "numpy.testing._private.utils.runstring",
        "numpy.lib.npyio.load",
        "numpy.f2py",
        "copyreg.__newobj_ex__",
    }
)
# py2 names written by protocol 0/1 pickles
_RENAMED_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg", "_compat_pickle": "pickle"}

_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
}

# NumPy type codes (without byte order) -> torch dtype names.
_NUMPY_DTYPES = {
    "f8": "float64",
    "f4": "float32",
    "f2": "float16",
    "i8": "int64",
    "i4": "int32",
    "i2": "int16",
    "i1": "int8",
    "u8": "uint64",
    "u4": "uint32",
    "u2": "uint16",
    "u1": "uint8",
    "b1": "bool",
    "c16": "complex128",
    "c8": "complex64",
}
_STRUCT_CODES = {
    "f8": "d",
    "f4": "f",
    "f2": "e",
    "i8": "q",
    "i4": "i",
    "i2": "h",
    "i1": "b",
    "u8": "Q",
    "u4": "I",
    "u2": "H",
    "u1": "B",
    "b1": "?",
}


def classify_global(module: str, name: str) -> str:
    """'safe' (emulated data construct), 'dangerous' (code execution) or 'unknown'."""
    module = _RENAMED_MODULES.get(module, module)
    qualname = f"{module}.{name}"
    if qualname in _EMULATED or qualname in _TORCH_DTYPE_GLOBALS or _is_storage_class(qualname):
        return "safe"
    if qualname in _DATA_RECORDS:
        return "safe"
    root = module.split(".")[0]
    if (
        qualname in _DANGEROUS_NAMES
        or root in _DANGEROUS_MODULES
        or module.startswith(_DANGEROUS_PREFIXES)
        or (module == "builtins" and name not in _SAFE_BUILTIN_NAMES)
    ):
        return "dangerous"
    return "unknown"


# What a torch.distributed.checkpoint ``.metadata`` pickle names: dataclasses of plain fields,
# a layout lookup, an enum, a path; and the BytesIO that DCP users store values as (its state
# is its bytes; the rest of ``io`` stays dangerous). Known data records, classed "safe" for
# ``scan``; like any class they are never imported or called here: each becomes an
# OpaqueObject with its state, which :mod:`ckpttool.formats.dcp_metadata` interprets.
_DCP = "torch.distributed.checkpoint"
_DATA_RECORDS = frozenset(
    {f"{_DCP}.metadata.{name}" for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )}
    | {f"{_DCP}.filesystem._StorageInfo", "torch.serialization._get_layout"}
    | {"pathlib.PosixPath", "pathlib.WindowsPath", "_io.BytesIO", "io.BytesIO"}
)  # fmt: skip

_SAFE_BUILTIN_NAMES = frozenset(
    {"set", "frozenset", "bytearray", "slice", "complex", "range", "bytes", "int", "float",
     "str", "bool", "tuple", "list", "dict", "Exception", "ValueError", "KeyError"}
)  # fmt: skip


def _is_storage_class(qualname: str) -> bool:
    module, _, name = qualname.rpartition(".")
    return module in ("torch", "torch.storage", "torch.cuda") and (
        name in _STORAGE_DTYPES or name == "TypedStorage"
    )


@dataclass(frozen=True)
class _TorchDtype:
    name: str  # "float16"

    def __str__(self) -> str:
        return f"torch.{self.name}"


_TORCH_DTYPE_GLOBALS = {
    f"torch.{name}": _TorchDtype(name)
    for name in [
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8",
        "bits16", "bits1x8", "bits2x4", "bits4x2",
    ]
}  # fmt: skip


class _NdarrayBuilder:
    """What ``numpy.core.multiarray._reconstruct`` returns until BUILD gives it its data."""

    __slots__ = ("record",)

    def __init__(self) -> None:
        self.record: TensorRecord | OpaqueObject = OpaqueObject("numpy.ndarray")


class AttributeDict(dict[Any, Any]):
    """An ``argparse.Namespace`` being read: plain data (its instances only carry attributes),
    emulated as the dict of its attributes, which ``BUILD`` fills in. The tree holds a plain
    dict in its place. (``torch.load(weights_only=True)`` refuses the class unless it is
    allow-listed with ``torch.serialization.add_safe_globals``; with ``weights_only=False`` it
    only sets attributes.)"""

    __slots__ = ()


#: Classes whose instances are only a bag of attributes: read as the dict of them.
ATTRIBUTE_CLASSES = frozenset({"argparse.Namespace"})


class _NumpyDtype:
    __slots__ = ("byteorder", "code")

    def __init__(self, code: str) -> None:
        self.code = code.lstrip("<>=|")
        self.byteorder = ">" if code.startswith(">") else "<"

    def __repr__(self) -> str:
        return f"numpy.dtype({self.byteorder}{self.code})"


# ---------------------------------------------------------------------------------------
# Emulated calls: the data constructs the allow-list knows. Each returns plain data.


def _opaque_call(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return OpaqueObject(func.qualname, args)


def _ordered_dict(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    out: dict[Any, Any] = {}
    if args and isinstance(args[0], (list, tuple)):
        for pair in args[0]:
            key, value = pair
            out[key] = value
    return out


def _set_call(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    items = args[0] if args else ()
    return set(items) if func.name == "set" else frozenset(items)


def _plain_call(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    constructors: dict[str, Callable[..., Any]] = {
        "bytearray": bytearray, "complex": complex, "slice": slice, "range": range,
        "bytes": bytes, "int": int, "float": float, "str": str, "bool": bool,
        "tuple": tuple, "list": list, "dict": dict,
    }  # fmt: skip
    if func.name in ("bytes", "bytearray") and args and isinstance(args[0], int):
        raise ResourceLimitError(f"pickle asks for {func.name}({args[0]:,}) (an allocation)")
    if all(isinstance(a, (int, float, str, bytes, bool, type(None), list, tuple)) for a in args):
        return constructors[func.name](*args)
    return OpaqueObject(func.qualname, args)


def _codecs_encode(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # how protocol 2 stores bytes: _codecs.encode(latin1-decoded text, "latin1")
    text, encoding = args
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        return OpaqueObject(func.qualname, args)
    return text.encode("latin-1")


def _reconstructor(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # copyreg._reconstructor(cls, base, state): how protocols 0/1 build objects
    cls = args[0]
    if isinstance(cls, GlobalRef) and cls.qualname in ATTRIBUTE_CLASSES:
        return AttributeDict()
    return OpaqueObject(cls.qualname if isinstance(cls, GlobalRef) else "?", ())


def _attributes(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # Namespace(**kwargs) pickles as NEWOBJ with no arguments, then BUILD with its __dict__
    return AttributeDict()


def _torch_size(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return tuple(args[0]) if args else ()


def _torch_device(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return ":".join(str(a) for a in args if a is not None)


def _storage_dtype(storage: Any) -> str:
    if not isinstance(storage, StorageRecord):
        raise ValueError("tensor rebuilt from something that is not a storage")
    return storage.dtype


def _tensor(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: str, requires_grad: Any = False
) -> TensorRecord:
    if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)):
        raise ValueError("tensor with malformed offset/size/stride")
    if len(size) != len(stride) or not all(isinstance(v, int) and v >= 0 for v in size + stride):
        raise ValueError(f"tensor with a malformed shape or stride ({len(size)}/{len(stride)})")
    if offset < 0:
        raise ValueError("tensor with a negative storage offset")
    if not (numel_fits_int64(size) and fits_int64(*stride, offset)):
        raise ValueError("tensor sizes beyond torch's int64 range")
    return TensorRecord("", dtype, size, stride, offset, storage, bool(requires_grad))


def _rebuild_tensor(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    storage, offset, size, stride = args[:4]
    requires_grad = args[4] if len(args) > 4 and func.name != "_rebuild_tensor" else False
    return _tensor(storage, offset, size, stride, _storage_dtype(storage), requires_grad)


def _rebuild_tensor_v3(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    storage, offset, size, stride, requires_grad, _hooks, dtype = args[:7]
    if not isinstance(dtype, _TorchDtype):
        raise ValueError("_rebuild_tensor_v3 without a torch dtype")
    if isinstance(storage, StorageRecord) and storage.dtype == "uint8" and dtype.name != "uint8":
        # v3 tensors view an untyped (byte) storage; re-express it in the tensor's dtype
        itemsize = _itemsize(dtype.name)
        storage = replace(storage, dtype=dtype.name, numel=storage.numel // itemsize)
    return _tensor(storage, offset, size, stride, dtype.name, requires_grad)


def _itemsize(dtype: str) -> int:
    return ITEMSIZE.get(dtype, 1)


def _rebuild_parameter(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    from dataclasses import replace

    data, requires_grad = args[0], args[1] if len(args) > 1 else True
    if not isinstance(data, TensorRecord):
        return OpaqueObject(func.qualname, args)
    return replace(data, kind="parameter", requires_grad=bool(requires_grad))


def _rebuild_from_type_v2(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    inner, new_type, inner_args, _state = args
    tensor = u._call(inner, inner_args)
    if isinstance(tensor, TensorRecord) and isinstance(new_type, GlobalRef):
        if new_type.name == "Parameter":
            return replace(tensor, kind="parameter")
        return tensor
    return OpaqueObject(func.qualname, args)


def _rebuild_meta(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    dtype, size, stride, requires_grad = args[:4]
    name = dtype.name if isinstance(dtype, _TorchDtype) else "float32"
    return _tensor(None, 0, tuple(size), tuple(stride), name, requires_grad)


def _np_reconstruct(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return _NdarrayBuilder()


def _np_dtype(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return (
        _NumpyDtype(str(args[0]))
        if args and isinstance(args[0], str)
        else OpaqueObject(func.qualname, args)
    )


def _np_scalar(u: SafeUnpickler, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    dtype, raw = args[0], args[1] if len(args) > 1 else b""
    if isinstance(dtype, _NumpyDtype) and isinstance(raw, bytes) and dtype.code in _STRUCT_CODES:
        order = ">" if dtype.byteorder == ">" else "<"
        return struct.unpack(order + _STRUCT_CODES[dtype.code], raw)[0]
    return OpaqueObject(func.qualname, args)


def _ndarray_from_state(builder: _NdarrayBuilder, state: Any, pos: int) -> Any:
    # ndarray.__setstate__((version, shape, dtype, is_fortran, rawdata))
    if not (isinstance(state, tuple) and len(state) == 5):
        return OpaqueObject("numpy.ndarray", (), state)
    _, shape, dtype, fortran, raw = state
    if not isinstance(dtype, _NumpyDtype) or dtype.code not in _NUMPY_DTYPES:
        return OpaqueObject("numpy.ndarray", (), state)
    if not isinstance(raw, (bytes, bytearray)) or not isinstance(shape, tuple):
        return OpaqueObject("numpy.ndarray", (), state)  # object arrays carry a list
    name = _NUMPY_DTYPES[dtype.code]
    itemsize = _itemsize(name)
    numel = 1
    for n in shape:
        numel *= n
    if numel * itemsize != len(raw):
        raise CorruptCheckpointError(
            f"invalid pickle at byte {pos}: NumPy array of shape {shape} carries {len(raw)} bytes"
        )
    strides: list[int] = []
    acc = 1
    dims = list(shape) if fortran else list(reversed(shape))
    for n in dims:
        strides.append(acc)
        acc *= n
    stride = tuple(strides) if fortran else tuple(reversed(strides))
    byteorder = "big" if dtype.byteorder == ">" else "little"
    storage = StorageRecord("", name, numel, "cpu", "inline", len(raw), byteorder)
    return TensorRecord(
        "", name, tuple(shape), stride, 0, storage, kind="ndarray", inline_data=bytes(raw)
    )


_EMULATED: dict[str, Callable[[SafeUnpickler, GlobalRef, tuple[Any, ...]], Any]] = {
    "collections.OrderedDict": _ordered_dict,
    "collections.defaultdict": lambda u, f, a: {},
    "builtins.set": _set_call,
    "builtins.frozenset": _set_call,
    **{f"builtins.{name}": _plain_call for name in _SAFE_BUILTIN_NAMES - {"set", "frozenset"}},
    "_codecs.encode": _codecs_encode,
    "copyreg._reconstructor": _reconstructor,
    **{qualname: _attributes for qualname in ATTRIBUTE_CLASSES},
    "torch.Size": _torch_size,
    "torch.device": _torch_device,
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta,
    "torch.nn.parameter.Parameter": _opaque_call,
    "torch.Tensor": _opaque_call,
    "numpy.core.multiarray._reconstruct": _np_reconstruct,
    "numpy._core.multiarray._reconstruct": _np_reconstruct,
    "numpy.ndarray": _opaque_call,
    "numpy.dtype": _np_dtype,
    "numpy.core.multiarray.scalar": _np_scalar,
    "numpy._core.multiarray.scalar": _np_scalar,
}
