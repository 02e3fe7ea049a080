"""What the known globals build, as data: the calls the safe unpickler emulates.

A pickle builds objects by calling globals (``REDUCE``, ``NEWOBJ``, ``INST``, ``OBJ``) and
setting their state (``BUILD``). For a short allow-list of data constructs (torch's tensor
rebuilders, ``OrderedDict``, NumPy arrays/scalars/dtypes, ``argparse.Namespace``, a few
builtins) this module says what the call would build, without performing it: a
:class:`~ckpttool.model.records.TensorRecord` (sparse, nested and quantized tensors too: one record
each, with their layout, parts and quantization), a dict, a number... Any other call builds an
:class:`~ckpttool.model.records.OpaqueObject` that records the class name and arguments. Nothing
named is imported or called. Placeholders (:class:`TorchDtype`, :class:`NumpyDtype`,
:class:`NdarrayBuilder`) stand for objects still being built; the interpreter replaces them
when it finalizes the tree.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, TypeGuard

from ckpttool.errors import CorruptCheckpointError, ResourceLimitError
from ckpttool.model import dtypes
from ckpttool.model.records import (
    ITEMSIZE,
    PART_NAMES,
    DTensorInfo,
    GlobalRef,
    OpaqueObject,
    QuantInfo,
    StorageRecord,
    TensorRecord,
    TensorSubclassObject,
    fits_int64,
    numel_fits_int64,
)

__all__ = [
    "ATTRIBUTE_CLASSES",
    "QSCHEMES",
    "STORAGE_DTYPES",
    "AttributeDict",
    "NdarrayBuilder",
    "NestedCall",
    "NumpyDtype",
    "TorchDtype",
    "TorchLayout",
    "emulate_call",
    "global_value",
    "is_emulated",
    "set_state",
    "storage_class_dtype",
]

#: How an emulated call has the interpreter emulate a call nested in its arguments:
#: ``call(func, args)`` (``torch._tensor._rebuild_from_type_v2`` carries its inner rebuild).
NestedCall = Callable[[Any, Any], Any]

#: torch's typed storage class -> dtype (the one dtype table's, :mod:`ckpttool.model.dtypes`)
STORAGE_DTYPES = dtypes.STORAGE_DTYPES


def storage_class_dtype(storage_type: Any) -> str:
    """The dtype of a storage class a torch pickle names (``torch.FloatStorage``: "float32")."""
    if isinstance(storage_type, GlobalRef) and storage_type.name in STORAGE_DTYPES:
        return STORAGE_DTYPES[storage_type.name]
    raise CorruptCheckpointError(f"unknown storage type {storage_type!s} in the pickle")


# NumPy type codes (without byte order) -> torch dtype names, and -> struct codes
_NUMPY_DTYPES = dtypes.NUMPY_DTYPES
_STRUCT_CODES = dtypes.STRUCT_CODES


_SAFE_BUILTIN_NAMES = frozenset(
    {"set", "frozenset", "bytearray", "slice", "complex", "range", "bytes", "int", "float",
     "str", "bool", "tuple", "list", "dict", "Exception", "ValueError", "KeyError"}
)  # fmt: skip


def _is_storage_class(qualname: str) -> bool:
    module, _, name = qualname.rpartition(".")
    return module in ("torch", "torch.storage", "torch.cuda") and (
        name in STORAGE_DTYPES or name == "TypedStorage"
    )


@dataclass(frozen=True)
class TorchDtype:
    """A torch dtype a pickle names (``torch.float16``); the tree holds its string."""

    name: str  # "float16"

    def __str__(self) -> str:
        return f"torch.{self.name}"


_TORCH_DTYPE_GLOBALS = {f"torch.{name}": TorchDtype(name) for name in dtypes.TORCH_DTYPES}

#: Quantization schemes a pickle names as values (``torch.per_tensor_affine``).
QSCHEMES = frozenset(
    {"per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
     "per_channel_affine_float_qparams"}
)  # fmt: skip

#: Classes that only appear as values (the legacy typed-tensor classes: ``torch.FloatTensor``,
#: ``torch.sparse.FloatTensor``, ``torch.cuda.HalfTensor``...). Kept as their names.
_LEGACY_TENSOR_TYPES = frozenset(
    f"{module}.{kind}Tensor"
    for module in ("torch", "torch.cuda", "torch.sparse", "torch.cuda.sparse")
    for kind in ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long",
                 "Short")
)  # fmt: skip


@dataclass(frozen=True)
class TorchLayout:
    """A torch layout a pickle names (``_get_layout("torch.sparse_csr")``)."""

    name: str  # "sparse_csr"

    def __str__(self) -> str:
        return f"torch.{self.name}"


class NdarrayBuilder:
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


class NumpyDtype:
    """A NumPy dtype being read (``numpy.dtype('f4')``); the tree holds its string."""

    __slots__ = ("byteorder", "code")

    def __init__(self, code: str) -> None:
        self.code = code.lstrip("<>=|")
        self.byteorder = ">" if code.startswith(">") else "<"

    def __repr__(self) -> str:
        return f"numpy.dtype({self.byteorder}{self.code})"


# ---------------------------------------------------------------------------------------
# Emulated calls: the data constructs the allow-list knows. Each returns plain data.


def _opaque_call(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return OpaqueObject(func.qualname, args)


def _ordered_dict(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    out: dict[Any, Any] = {}
    if args and isinstance(args[0], (list, tuple)):
        for pair in args[0]:
            key, value = pair
            out[key] = value
    return out


def _set_call(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    items = args[0] if args else ()
    return set(items) if func.name == "set" else frozenset(items)


def _plain_call(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    constructors: dict[str, Callable[..., Any]] = {
        "bytearray": bytearray, "complex": complex, "slice": slice, "range": range,
        "bytes": bytes, "int": int, "float": float, "str": str, "bool": bool,
        "tuple": tuple, "list": list, "dict": dict,
    }  # fmt: skip
    if func.name in ("bytes", "bytearray") and args and isinstance(args[0], int):
        raise ResourceLimitError(f"pickle asks for {func.name}({args[0]:,}) (an allocation)")
    constructor = constructors.get(func.name)  # an exception class: kept as an opaque object
    if constructor is not None and all(
        isinstance(a, (int, float, str, bytes, bool, type(None), list, tuple)) for a in args
    ):
        return constructor(*args)
    return OpaqueObject(func.qualname, args)


def _codecs_encode(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # how protocol 2 stores bytes: _codecs.encode(latin1-decoded text, "latin1")
    text, encoding = args
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        return OpaqueObject(func.qualname, args)
    return text.encode("latin-1")


def _reconstructor(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # copyreg._reconstructor(cls, base, state): how protocols 0/1 build objects
    cls = args[0]
    if isinstance(cls, GlobalRef) and cls.qualname in ATTRIBUTE_CLASSES:
        return AttributeDict()
    return OpaqueObject(cls.qualname if isinstance(cls, GlobalRef) else "?", ())


def _attributes(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # Namespace(**kwargs) pickles as NEWOBJ with no arguments, then BUILD with its __dict__
    return AttributeDict()


def _torch_size(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return tuple(args[0]) if args else ()


def _torch_device(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return ":".join(str(a) for a in args if a is not None)


def storage_dtype(storage: Any) -> str:
    """The dtype of the storage a tensor is rebuilt from (anything else is an error)."""
    if not isinstance(storage, StorageRecord):
        raise ValueError("tensor rebuilt from something that is not a storage")
    return storage.dtype


_SMALL_DIM = 2**31


def tensor_record(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: str, requires_grad: Any = False
) -> TensorRecord:
    if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)):
        raise ValueError("tensor with malformed offset/size/stride")
    dims = size + stride
    if (
        len(size) != len(stride)
        or not all(map(isinstance, dims, repeat(int)))
        or min(dims, default=0) < 0
    ):
        raise ValueError(f"tensor with a malformed shape or stride ({len(size)}/{len(stride)})")
    if offset < 0:
        raise ValueError("tensor with a negative storage offset")
    # most tensors: at most two dimensions under 2**31 (their product fits int64), a small offset
    if not (len(size) <= 2 and max(dims, default=0) < _SMALL_DIM and offset < _SMALL_DIM) and not (
        numel_fits_int64(size) and fits_int64(*stride, offset)
    ):
        raise ValueError("tensor sizes beyond torch's int64 range")
    return TensorRecord("", dtype, size, stride, offset, storage, bool(requires_grad))


def storage_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any
) -> TensorRecord:
    """A tensor viewing ``storage`` in its dtype: what ``_rebuild_tensor(_v2)`` builds (the
    walker's fast path, ``tensor_call``, builds its tensors here too)."""
    dtype = storage.dtype if storage.__class__ is StorageRecord else storage_dtype(storage)
    return tensor_record(storage, offset, size, stride, dtype, requires_grad)


def _rebuild_tensor(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    storage, offset, size, stride = args[:4]
    requires_grad = args[4] if len(args) > 4 and func.name != "_rebuild_tensor" else False
    return storage_tensor(storage, offset, size, stride, requires_grad)


def _rebuild_tensor_v3(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    storage, offset, size, stride, requires_grad, _hooks, dtype = args[:7]
    if not isinstance(dtype, TorchDtype):
        raise ValueError("_rebuild_tensor_v3 without a torch dtype")
    if isinstance(storage, StorageRecord) and storage.dtype == "uint8" and dtype.name != "uint8":
        # v3 tensors view an untyped (byte) storage; re-express it in the tensor's dtype
        itemsize = _itemsize(dtype.name)
        storage = replace(storage, dtype=dtype.name, numel=storage.numel // itemsize)
    return tensor_record(storage, offset, size, stride, dtype.name, requires_grad)


def _itemsize(dtype: str) -> int:
    return ITEMSIZE.get(dtype, 1)


def _rebuild_parameter(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    from dataclasses import replace

    data, requires_grad = args[0], args[1] if len(args) > 1 else True
    if not isinstance(data, TensorRecord):
        return OpaqueObject(func.qualname, args)
    return replace(data, kind="parameter", requires_grad=bool(requires_grad))


def _rebuild_from_type_v2(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    inner, new_type, inner_args, state = args
    tensor = call(inner, inner_args)
    if isinstance(tensor, TensorRecord) and isinstance(new_type, GlobalRef):
        if new_type.name == "Parameter":
            return replace(tensor, kind="parameter")
        if new_type.qualname in DTENSOR_CLASSES and tensor.storage is None:
            info = _dtensor_info(state)
            return tensor if info is None else replace(tensor, dtensor=info)
        if new_type.qualname == SHARDED_TENSOR and tensor.storage is None:
            info = _sharded_tensor_info(state)
            return tensor if info is None else replace(tensor, dtensor=info)
        if tensor.is_meta and _holds_tensors(state):
            # a wrapper subclass (torchao's quantized tensors): its data are its inner tensors
            return TensorSubclassObject(
                new_type.qualname, state, tensor.dtype, tensor.shape, tensor.requires_grad
            )
        return tensor
    return OpaqueObject(func.qualname, args)


def _holds_tensors(state: Any) -> bool:
    """Whether a subclass's pickled state (its ``__dict__``) holds inner tensors."""
    return isinstance(state, dict) and any(
        isinstance(value, (TensorRecord, TensorSubclassObject)) for value in state.values()
    )


#: Where torch has defined DTensor (2.4 and earlier kept it in ``torch.distributed._tensor``).
DTENSOR_CLASSES = frozenset({
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._api.DTensor",
    "torch.distributed._tensor.api.DTensor",
    "torch.distributed._tensor.DTensor",
})  # fmt: skip


#: FSDP1's sharded tensor (``StateDictType.SHARDED_STATE_DICT``).
SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def _sharded_tensor_info(state: Any) -> DTensorInfo | None:
    """A ShardedTensor's one local shard and where it lies, from its pickled state
    (``__getstate__``: local shards, metadata, process group state, spec, rrefs). A shard is a
    ``Shard`` holding its ``tensor`` and a ``ShardMetadata`` (``shard_offsets``,
    ``shard_sizes``). None unless the rank holds exactly one shard whose sizes match its
    tensor: the record is then a tensor without values."""
    if not isinstance(state, tuple) or len(state) < 3 or not isinstance(state[0], list):
        return None
    if len(state[0]) != 1 or not isinstance(state[0][0], OpaqueObject):
        return None
    shard = state[0][0].fields()
    local, meta = shard.get("tensor"), shard.get("metadata")
    if not isinstance(local, TensorRecord) or local.storage is None:
        return None
    fields = meta.fields() if isinstance(meta, OpaqueObject) else {}
    offsets, sizes = fields.get("shard_offsets"), fields.get("shard_sizes")
    if not _ints(offsets) or not _ints(sizes) or tuple(sizes) != local.shape:
        return None
    group = state[2].fields() if isinstance(state[2], OpaqueObject) else {}
    ranks = (group.get("global_rank"), group.get("global_world_size"))
    mesh: tuple[int, ...] = ()
    coordinate: tuple[int, ...] | None = None
    if _ints(ranks) and ranks[0] < ranks[1]:
        mesh, coordinate = (ranks[1],), (ranks[0],)
    return DTensorInfo(
        local, (f"offsets {list(offsets)}",), mesh, None, coordinate,
        (("offsets", tuple(offsets)),), None, "ShardedTensor",
    )  # fmt: skip


def _dtensor_info(state: Any) -> DTensorInfo | None:
    """A DTensor's piece and placements from its pickled state: ``(None, {"_local_tensor",
    "_spec"})`` (its ``__slots__``) or a dict of them; the spec is a ``DTensorSpec`` object
    whose state names its ``placements`` (``Shard`` objects with a ``dim``...). None when the
    state is not that shape: the record is then a plain tensor without values."""
    slots: dict[Any, Any] = {}
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict):
            slots.update(part)
    local = slots.get("_local_tensor")
    if not isinstance(local, TensorRecord) or local.storage is None:
        return None
    spec = slots.get("_spec")
    spec_state = spec.state if isinstance(spec, OpaqueObject) else None
    if not isinstance(spec_state, dict):
        spec_state = {}
    placements = spec_state.get("placements")
    shown = [p for p in placements or () if isinstance(p, OpaqueObject)]
    named = tuple(_placement_name(p) for p in shown)
    kinds = tuple(_placement_kind(p) for p in shown)
    mesh = spec_state.get("mesh")
    mesh_state = mesh.fields() if isinstance(mesh, OpaqueObject) else {}
    meta = spec_state.get("tensor_meta")
    stride = meta.args[1] if isinstance(meta, OpaqueObject) and len(meta.args) >= 2 else None
    return DTensorInfo(
        local, named, _mesh_shape(mesh_state), _names(mesh_state), _coordinate(mesh_state),
        kinds, tuple(stride) if _ints(stride) else None,
    )  # fmt: skip


def _ints(value: Any) -> TypeGuard[tuple[int, ...] | list[int]]:
    return isinstance(value, (tuple, list)) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**62 for v in value
    )


def _mesh_shape(mesh: dict[str, Any]) -> tuple[int, ...]:
    """A DeviceMesh's shape: its ``_layout`` (torch 2.10+: one flat layout per mesh dim, whose
    ``shape`` is an int or a tuple of them) or its ``mesh`` tensor of ranks (earlier)."""
    layout = mesh.get("_layout")
    if isinstance(layout, OpaqueObject):
        axes = layout.fields().get("axes")
        sizes = []
        for axis in axes if isinstance(axes, (tuple, list)) else ():
            shape = axis.fields().get("shape") if isinstance(axis, OpaqueObject) else None
            shape = (shape,) if isinstance(shape, int) else shape
            if not _ints(shape):
                return ()
            sizes.append(math.prod(shape))
        return tuple(sizes)
    ranks = mesh.get("mesh")
    return ranks.shape if isinstance(ranks, TensorRecord) else ()


def _names(mesh: dict[str, Any]) -> tuple[str, ...] | None:
    names = mesh.get("_mesh_dim_names", mesh.get("mesh_dim_names"))
    if isinstance(names, (tuple, list)) and all(isinstance(n, str) and _short(n) for n in names):
        return tuple(names)
    return None


def _coordinate(mesh: dict[str, Any]) -> tuple[int, ...] | None:
    coordinate = mesh.get("_coordinate_on_dim")
    return tuple(coordinate) if _ints(coordinate) else None


def _placement_kind(placement: OpaqueObject) -> tuple[Any, ...]:
    """A placement as data: ``("shard", dim)``, ``("strided_shard", dim, split_factor)``,
    ``("replicate",)``, ``("partial", reduce_op)``; ``("unknown", class)`` otherwise."""
    name = placement.cls.rpartition(".")[2]
    state = placement.fields()
    dim = state.get("dim")
    valid_dim = isinstance(dim, int) and not isinstance(dim, bool) and -64 <= dim < 64
    if name == "Shard" and valid_dim:
        return ("shard", dim)
    if name == "_StridedShard" and valid_dim:
        factor = state.get("split_factor")
        if isinstance(factor, int) and not isinstance(factor, bool) and 0 < factor <= 2**31:
            return ("strided_shard", dim, factor)
    if name == "Replicate":
        return ("replicate",)
    if name == "Partial":
        op = state.get("reduce_op")
        return ("partial", op if isinstance(op, str) and _short(op) else "?")
    return ("unknown", name)


def _placement_name(placement: OpaqueObject) -> str:
    """A placement as torch's ``repr`` writes it: ``Shard(dim=0)``, ``Replicate()``,
    ``Partial(sum)``, ``_StridedShard(dim=0, sf=2)``; another class as its name and the fields
    of its state."""
    name = placement.cls.rpartition(".")[2]
    kind = _placement_kind(placement)
    if kind[0] == "partial" and kind[1] != "?":
        return f"Partial({kind[1]})"
    if kind[0] == "strided_shard":
        return f"_StridedShard(dim={kind[1]}, sf={kind[2]})"
    state = placement.state if isinstance(placement.state, dict) else {}
    fields = [
        f"{k}={v}" for k, v in state.items() if isinstance(k, str) and _short(k) and _short(v)
    ]
    return f"{name}({', '.join(fields)})"


def _short(value: Any) -> bool:
    """A placement's field worth printing (a hostile pickle's 10,000-digit int is not)."""
    if isinstance(value, int):
        return abs(value) <= 2**63
    return isinstance(value, str) and len(value) <= 64


def _rebuild_meta(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    dtype, size, stride, requires_grad = args[:4]
    name = dtype.name if isinstance(dtype, TorchDtype) else "float32"
    return tensor_record(None, 0, tuple(size), tuple(stride), name, requires_grad)


def _get_layout(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # torch.serialization._get_layout("torch.sparse_coo"): a layout named by a string
    name = args[0] if len(args) == 1 and isinstance(args[0], str) else None
    if name is not None and name.removeprefix("torch.") in (*PART_NAMES, "strided"):
        return TorchLayout(name.removeprefix("torch."))
    return OpaqueObject(func.qualname, args)


def _shape(size: Any) -> tuple[int, ...]:
    if not isinstance(size, (tuple, list)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size
    ):
        raise ValueError("tensor with a malformed size")
    if not numel_fits_int64(list(size)):
        raise ValueError("tensor sizes beyond torch's int64 range")
    return tuple(size)


def _rebuild_sparse(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # _rebuild_sparse_tensor(layout, data): COO data is (indices, values, size[, coalesced]),
    # compressed layouts (compressed indices, plain indices, values, size)
    layout, data = args if len(args) == 2 else (None, None)
    if (
        not isinstance(layout, TorchLayout)
        or layout.name not in PART_NAMES
        or not isinstance(data, tuple)
    ):
        return OpaqueObject(func.qualname, args)
    coalesced = None
    if layout.name == "sparse_coo":
        if len(data) == 3:
            *parts, size = data
        elif len(data) == 4:
            *parts, size, coalesced = data
        else:
            raise ValueError("sparse COO tensor with malformed data")
    elif len(data) == 4:
        *parts, size = data
    else:
        raise ValueError(f"{layout.name} tensor with malformed data")
    if not all(isinstance(p, TensorRecord) and p.layout == "strided" for p in parts):
        raise ValueError(f"{layout.name} tensor whose parts are not tensors")
    values = parts[-1]
    return TensorRecord(
        "", values.dtype, _shape(size), (), 0, None, values.requires_grad,
        layout=layout.name, parts=tuple(parts),
        is_coalesced=coalesced if isinstance(coalesced, bool) else None,
    )  # fmt: skip


def _rebuild_qtensor(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # _rebuild_qtensor(storage, offset, size, stride, quantizer_params, requires_grad, hooks)
    storage, offset, size, stride, params = args[:5]
    requires_grad = args[5] if len(args) > 5 else False
    scheme = params[0] if isinstance(params, tuple) and params else None
    if not isinstance(scheme, GlobalRef) or scheme.name not in QSCHEMES:
        return OpaqueObject(func.qualname, args)
    tensor = tensor_record(storage, offset, size, stride, storage_dtype(storage), requires_grad)
    if scheme.name == "per_tensor_affine" and len(params) == 3:
        scale, zero_point = params[1:]
        if isinstance(scale, (int, float)) and isinstance(zero_point, (int, float)):
            return replace(tensor, quant=QuantInfo(scheme.name, float(scale), zero_point))
    elif scheme.name.startswith("per_channel_affine") and len(params) == 4:
        scales, zero_points, axis = params[1:]
        if not (isinstance(axis, int) and 0 <= axis < len(tensor.shape)):
            raise ValueError(f"quantized tensor with per-channel axis {axis!r} out of range")
        channels = tensor.shape[axis]
        for given in (scales, zero_points):
            count = given.numel if isinstance(given, TensorRecord) else len(given)
            if count != channels:
                raise ValueError("quantized tensor with a scale or zero point per channel "
                                 f"for {count} channels, not {channels}")  # fmt: skip
        scale = scales if isinstance(scales, TensorRecord) else tuple(scales)
        zero = zero_points if isinstance(zero_points, TensorRecord) else tuple(zero_points)
        return replace(tensor, quant=QuantInfo(scheme.name, scale, zero, axis))
    # torch saves symmetric schemes as affine and refuses to rebuild any other
    return OpaqueObject(func.qualname, args)


def _rebuild_wrapper_subclass(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # (cls, dtype, size, stride, storage_offset, layout, device, requires_grad): a tensor
    # subclass that wraps others; torch rebuilds it without data, as do we (like a meta tensor)
    _cls, dtype, size, stride, offset = args[:5]
    requires_grad = args[7] if len(args) > 7 else False
    if not isinstance(dtype, TorchDtype):
        return OpaqueObject(func.qualname, args)
    return tensor_record(None, offset, _shape(size), tuple(stride), dtype.name, requires_grad)


def _rebuild_device_tensor(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # (data, dtype, device, requires_grad): a tensor of a device without storage access (XLA,
    # MPS...) saved through a CPU copy (a tensor) or a NumPy array
    data, dtype, device, requires_grad = args[:4] if len(args) >= 4 else (None,) * 4
    if isinstance(data, NdarrayBuilder):
        data = data.record
    if not isinstance(data, TensorRecord) or not isinstance(dtype, TorchDtype):
        return OpaqueObject(func.qualname, args)
    if data.dtype != dtype.name:  # a conversion: torch would cast; we do not
        return OpaqueObject(func.qualname, args)
    storage = data.storage
    if storage is not None and isinstance(device, str) and device:
        storage = replace(storage, location=device)
    return replace(data, storage=storage, kind="tensor", requires_grad=bool(requires_grad))


def _rebuild_nested(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # (buffer, sizes, strides, storage_offsets): the shape of each component is a row of the
    # sizes tensor, in the file's data; the record says how many components there are
    if len(args) != 4 or not all(isinstance(a, TensorRecord) for a in args):
        return OpaqueObject(func.qualname, args)
    buffer, sizes = args[0], args[1]
    if len(sizes.shape) != 2:
        raise ValueError("nested tensor whose sizes are not a matrix")
    shape = (sizes.shape[0],)
    return TensorRecord(
        "", buffer.dtype, shape, (), 0, None, buffer.requires_grad, layout="nested",
        parts=tuple(args),
    )  # fmt: skip


def _counter(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # collections.Counter({item: count}): read as the dict of counts
    if not args:
        return {}
    if isinstance(args[0], dict):
        return dict(args[0])
    return OpaqueObject(func.qualname, args)


def _np_reconstruct(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return NdarrayBuilder()


def _np_dtype(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    return (
        NumpyDtype(str(args[0]))
        if args and isinstance(args[0], str)
        else OpaqueObject(func.qualname, args)
    )


def _np_scalar(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    dtype, raw = args[0], args[1] if len(args) > 1 else b""
    if isinstance(dtype, NumpyDtype) and isinstance(raw, bytes) and dtype.code in _STRUCT_CODES:
        order = ">" if dtype.byteorder == ">" else "<"
        return struct.unpack(order + _STRUCT_CODES[dtype.code], raw)[0]
    return OpaqueObject(func.qualname, args)


#: NumPy's limit on an array's dimensions (``NPY_MAXDIMS``).
_NUMPY_MAX_DIMS = 64


def _np_frombuffer(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    # numpy._core.numeric._frombuffer(buffer, dtype, shape, order[, axis_order]): how pickle
    # protocol 5 saves a contiguous array, its PickleBuffer in-band (BYTEARRAY8, or bytes when
    # the array is read-only); numpy frombuffer()s the bytes, then reshapes (order "C" or "F"),
    # or reshapes in C order and transposes by axis_order (order "K"). Read as the array's
    # record, from the bytes the pickle carries: numel times itemsize must be their length.
    if len(args) not in (4, 5):
        return OpaqueObject(func.qualname, args)
    raw, dtype, shape, order = args[:4]
    axis_order = args[4] if len(args) == 5 else None
    if (
        not isinstance(raw, (bytes, bytearray))
        or not isinstance(shape, tuple)
        or len(shape) > _NUMPY_MAX_DIMS
        or not all(type(n) is int and 0 <= n < 1 << 63 for n in shape)
        or order not in ("C", "F", "K")
        or (order == "K") != (axis_order is not None)
        or (
            axis_order is not None
            and not (
                isinstance(axis_order, tuple)
                and all(type(axis) is int for axis in axis_order)
                and sorted(axis_order) == list(range(len(shape)))
            )
        )
        or not isinstance(dtype, NumpyDtype)
        or dtype.code not in _NUMPY_DTYPES
    ):
        return OpaqueObject(func.qualname, args)
    numel = 1
    for n in shape:
        numel *= n
    if numel * _itemsize(_NUMPY_DTYPES[dtype.code]) != len(raw):
        raise ValueError(f"NumPy array of shape {shape} carries {len(raw)} bytes")
    record = _ndarray_from_state(NdarrayBuilder(), (1, shape, dtype, order == "F", raw), 0)
    if axis_order is not None:
        shape = tuple(record.shape[axis] for axis in axis_order)
        stride = tuple(record.stride[axis] for axis in axis_order)
        record = replace(record, shape=shape, stride=stride)
    return record


def _ndarray_from_state(builder: NdarrayBuilder, state: Any, pos: int) -> Any:
    # ndarray.__setstate__((version, shape, dtype, is_fortran, rawdata))
    if not (isinstance(state, tuple) and len(state) == 5):
        return OpaqueObject("numpy.ndarray", (), state)
    _, shape, dtype, fortran, raw = state
    if not isinstance(dtype, NumpyDtype) or dtype.code not in _NUMPY_DTYPES:
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


_EMULATED: dict[str, Callable[[NestedCall, GlobalRef, tuple[Any, ...]], Any]] = {
    "collections.OrderedDict": _ordered_dict,
    "collections.defaultdict": lambda call, f, a: {},
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
    "torch.serialization._get_layout": _get_layout,
    "torch._utils._rebuild_sparse_tensor": _rebuild_sparse,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": _rebuild_device_tensor,
    "torch._utils._rebuild_device_tensor_from_numpy": _rebuild_device_tensor,
    "torch._utils._rebuild_nested_tensor": _rebuild_nested,
    "collections.Counter": _counter,
    "torch.nn.parameter.Parameter": _opaque_call,
    "torch.Tensor": _opaque_call,
    "numpy.core.multiarray._reconstruct": _np_reconstruct,
    "numpy._core.multiarray._reconstruct": _np_reconstruct,
    # protocol 5's form of a contiguous array: numpy.frombuffer of the bytes, reshaped
    "numpy.core.numeric._frombuffer": _np_frombuffer,
    "numpy._core.numeric._frombuffer": _np_frombuffer,
    "numpy.ndarray": _opaque_call,
    "numpy.dtype": _np_dtype,
    "numpy.core.multiarray.scalar": _np_scalar,
    "numpy._core.multiarray.scalar": _np_scalar,
}


def is_emulated(qualname: str) -> bool:
    """Whether this module knows what the global builds (a torch dtype, a storage class, a call
    in the allow-list): the data constructs ``scan`` classes as safe."""
    return (
        qualname in _EMULATED
        or qualname in _TORCH_DTYPE_GLOBALS
        or qualname in _LEGACY_TENSOR_TYPES
        or qualname.removeprefix("torch.") in QSCHEMES
        or _is_storage_class(qualname)
    )


def global_value(module: str, name: str) -> Any:
    """What a ``GLOBAL`` opcode pushes: a torch dtype's placeholder, or a
    :class:`~ckpttool.model.records.GlobalRef` (a name; nothing is imported)."""
    qualname = f"{module}.{name}"
    if qualname in _TORCH_DTYPE_GLOBALS:
        return _TORCH_DTYPE_GLOBALS[qualname]
    return GlobalRef(module, name)


def emulate_call(call: NestedCall, func: GlobalRef, args: tuple[Any, ...]) -> Any:
    """What ``func(*args)`` builds, as data; an :class:`~ckpttool.model.records.OpaqueObject` for any
    call outside the allow-list."""
    return _EMULATED.get(func.qualname, _opaque_call)(call, func, args)


def set_state(obj: Any, state: Any, pos: int) -> None:
    """``BUILD`` on an object the interpreter built (``pos``: the opcode's offset, for errors).

    An opaque object keeps the state as given; a namespace takes its attributes; an ndarray
    becomes a tensor record; a NumPy dtype takes its byte order.
    """
    if isinstance(obj, OpaqueObject):
        obj.state = state
    elif isinstance(obj, AttributeDict):
        if isinstance(state, dict):
            obj.update(state)
    elif isinstance(obj, NdarrayBuilder):
        obj.record = _ndarray_from_state(obj, state, pos)
    elif (
        isinstance(obj, NumpyDtype)
        and isinstance(state, tuple)
        and len(state) > 1
        and state[1] in ("<", ">", "|", "=")
    ):
        obj.byteorder = ">" if state[1] == ">" else "<"
    # dicts (OrderedDict `_metadata`), lists, tensors: the state is not part of the data.
