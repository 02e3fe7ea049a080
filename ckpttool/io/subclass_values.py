"""The values of a wrapper tensor subclass (torchao's ``Int8Tensor``, ``Float8Tensor``...)
computed from its inner tensors, as its own ``dequantize()`` would: ``convert --dequantize``.

torchao's affine scheme: each block of ``block_size`` elements of ``qdata`` shares one
``scale`` (and ``zero_point``): value = (q - zero_point) * scale, in float32, cast to the
logical dtype. Float8 tensors have no zero point. torchao's Int4 weights for the tinygemm
kernel (``Int4TilePackedTo4dTensor``) keep eight 4-bit values per int32 in the kernel's tiles and
one bfloat16 scale and zero per group in ``scale_and_zero``: value = (q - 8) * scale + zero
(:func:`_tinygemm_values`). torch does the arithmetic; torchao is never imported and nothing
from the file runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import InputError
from ckpttool.io.values import MAX_DENSE_BYTES, read_tensor
from ckpttool.model.records import (
    ITEMSIZE,
    OpaqueObject,
    RecordReader,
    StorageRecord,
    TensorRecord,
    TensorSubclassObject,
    get_path,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DATA_NAMES", "AffineScheme", "dequantized_subclass", "subclass_scheme", "tinygemm_int4"]

#: The inner tensor holding the quantized values, by its name in torchao's classes (the
#: current tensors' ``qdata``; AffineQuantizedTensor's plain ``tensor_impl``'s ``int_data``).
DATA_NAMES = ("qdata", "int_data")

#: torchao's ``ZeroPointDomain`` members, by the value an enum member pickles as its argument.
_INT_DOMAIN, _FLOAT_DOMAIN, _NO_DOMAIN = 1, 2, 3


@dataclass(frozen=True)
class AffineScheme:
    """Where an affine-quantized subclass keeps its parts (dotted paths below it)."""

    data: str  # "qdata", "tensor_impl.int_data"
    scale: str
    zero_point: str | None  # None: no zero point (float8, symmetric, ZeroPointDomain.NONE)
    block_size: tuple[int, ...]  # elements sharing one scale, per dimension
    packing: str | None = None  # TINYGEMM: data in tinygemm's tiles, scale the scale_and_zero


#: torchao's ``tile_packed_to_4d`` Int4 layout (``Int4TilePackedTo4dTensor``: ``qdata``,
#: ``scale_and_zero``), the one its CUDA tinygemm kernel ``_weight_int4pack_mm`` reads.
TINYGEMM = "tinygemm"
#: The layout of tinygemm's tiles ckpttool reads: inner_k_tiles 8 (the one torchao's
#: ``Int4TilePackedTo4dTensor`` writes), checked nibble by nibble against torch's own
#: ``_convert_weight_to_int4pack`` (tests/fixtures/torchao/README.md).
_TILE_LANES, _TILE_WORDS = 32, 4


def subclass_scheme(obj: TensorSubclassObject) -> AffineScheme:
    """How ``obj`` (or the one subclass it wraps, down to the one holding the data) maps its
    stored values to real ones, or an :class:`InputError` saying why ckpttool cannot
    dequantize it."""
    holder, path = obj, ""
    while True:
        inner = holder.inner_tensors()
        data = next((name for name in DATA_NAMES if name in inner), None)
        if data is not None:
            break
        nested = holder.nested()
        if len(nested) != 1:
            raise InputError(
                f"{holder.cls} holds {', '.join(inner) or 'no tensors'}, not the quantized data "
                "and scale ckpttool dequantizes (a packed layout?); convert without "
                "--dequantize keeps its inner tensors"
            )
        path = f"{path}{nested[0][0]}."
        holder = nested[0][1]
    if "scale" not in inner and "scale_and_zero" in inner and data == "qdata":
        return _tinygemm_scheme(obj, path, inner)
    if "scale" not in inner:
        raise InputError(f"{holder.cls} holds no scale; convert without --dequantize")
    shape = inner[data].shape
    if obj.shape and math.prod(shape) != math.prod(obj.shape):  # torchao's plain Int4Tensor...
        raise InputError(
            f"{obj.cls}: {data} {inner[data].dtype} {list(shape)} packs {list(obj.shape)} "
            "(several values per element), a layout ckpttool does not dequantize; convert "
            "without --dequantize keeps its inner tensors"
        )
    block = obj.fact("block_size")
    if isinstance(block, (list, tuple)) and all(isinstance(b, int) and b > 0 for b in block):
        block_size = tuple(block)
    else:  # the scale's shape says it: one scale per block
        scale_shape = inner["scale"].shape
        if len(scale_shape) != len(shape) or not all(scale_shape):
            raise InputError(f"{obj.cls}: no block_size, and its scale does not say one")
        block_size = tuple(n // s for n, s in zip(shape, scale_shape))
    if len(block_size) != len(shape) or any(n % b for n, b in zip(shape, block_size)):
        raise InputError(f"{obj.cls}: block_size {list(block_size)} does not tile {list(shape)}")
    domain = _zero_point_domain(obj.fact("zero_point_domain"))
    if domain == _FLOAT_DOMAIN:
        raise InputError(
            f"{obj.cls} with ZeroPointDomain.FLOAT is not dequantized by ckpttool; convert "
            "without --dequantize keeps its inner tensors"
        )
    zero = "zero_point" if "zero_point" in inner and domain != _NO_DOMAIN else None
    return AffineScheme(
        path + data, path + "scale", None if zero is None else path + zero, block_size
    )


def _tinygemm_scheme(
    obj: TensorSubclassObject, path: str, inner: dict[str, TensorRecord]
) -> AffineScheme:
    """The scheme of torchao's tile-packed Int4 weight, once its tensors' shapes are the ones
    :func:`_tinygemm_values` reads: ``qdata`` int32 ``[N/8, K/128, 32, 4]``, ``scale_and_zero``
    ``[K/group, N, 2]``, a 2-d logical shape inside ``[N, K]`` (torchao pads both)."""
    packed, pairs = inner["qdata"], inner["scale_and_zero"]
    shape = packed.shape
    if (
        packed.dtype != "int32"
        or len(shape) != 4
        or shape[2:] != (_TILE_LANES, _TILE_WORDS)
        or len(pairs.shape) != 3
        or pairs.shape[1:] != (shape[0] * 8, 2)
        or not pairs.shape[0]
        or (shape[1] * 128) % pairs.shape[0]
        or len(obj.shape) != 2
        or obj.shape[0] > shape[0] * 8
        or obj.shape[1] > shape[1] * 128
    ):
        raise InputError(
            f"{obj.cls}: qdata {packed.dtype} {list(shape)} with scale_and_zero "
            f"{list(pairs.shape)} for {list(obj.shape)} is not the int4 tile layout ckpttool "
            "reads (inner_k_tiles 8); convert without --dequantize keeps its inner tensors"
        )
    group = shape[1] * 128 // pairs.shape[0]
    return AffineScheme(path + "qdata", path + "scale_and_zero", None, (1, group), TINYGEMM)


def tinygemm_int4(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values (int64, ``[N, K]``, padding included) of tinygemm's tiles ``packed``
    (int32 ``[N/8, K/128, 32, 4]``, eight values per word).

    Nibble ``i`` (lowest first) of word ``j`` of lane ``L`` in tile ``(n, k)`` holds the element
    at row ``8n + L // 4``, column ``128k + 32j + 8(i % 4) + 2(L % 4) + i // 4``: the layout
    torch's ``_convert_weight_to_int4pack`` writes with inner_k_tiles 8, as its output on known
    grids reads (``tests/fixtures/torchao/int4_tile_probes.safetensors``)."""
    import torch

    n_tiles, k_tiles = packed.shape[:2]
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1)
    # [n, k, L: (row 8, t 4), j, i: (hi 2, lo 4)] -> rows (n, row), columns (k, j, lo, t, hi)
    tiles = nibbles.reshape(n_tiles, k_tiles, 8, 4, _TILE_WORDS, 2, 4)
    return tiles.permute(0, 2, 1, 4, 6, 3, 5).reshape(n_tiles * 8, k_tiles * 128)


def _tinygemm_values(packed: torch.Tensor, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """The float32 values ``[N, K]`` (padding included) of a tile-packed Int4 weight: each
    group of columns has one scale and one zero, value = (q - 8) * scale + zero, the tinygemm
    kernel's; in float32 this gives its bfloat16 results bit for bit (the fixture's
    manifest)."""
    import torch

    q = tinygemm_int4(packed)
    group = q.shape[1] // scale_and_zero.shape[0]
    pairs = scale_and_zero.to(torch.float32).transpose(0, 1)  # [N, groups, 2]
    scale = pairs[..., 0].repeat_interleave(group, dim=1)
    zero = pairs[..., 1].repeat_interleave(group, dim=1)
    return (q - 8).to(torch.float32) * scale + zero


def _zero_point_domain(value: Any) -> int:
    """torchao's ``ZeroPointDomain`` as pickled (an enum member: the class with its value)."""
    if value is None:
        return _INT_DOMAIN
    if isinstance(value, OpaqueObject) and value.cls.endswith("ZeroPointDomain"):
        args = value.args
        if isinstance(args, tuple) and len(args) == 1 and args[0] in (1, 2, 3):
            return int(args[0])
    raise InputError(f"an unknown zero_point_domain {value!r}; convert without --dequantize")


def _per_block(
    param: torch.Tensor, shape: tuple[int, ...], block_size: tuple[int, ...]
) -> torch.Tensor:
    """A scale or zero point (one per block) spread over the elements of its block."""
    blocks = tuple(n // b for n, b in zip(shape, block_size))
    if param.numel() != math.prod(blocks):
        raise InputError(
            f"a scale or zero point of {param.numel()} values for {math.prod(blocks)} blocks"
        )
    out = param.reshape(blocks)
    for dim, size in enumerate(block_size):
        if size > 1:
            out = out.repeat_interleave(size, dim=dim)
    return out


def dequantized_subclass(ckpt: RecordReader, obj: TensorSubclassObject, key: str) -> TensorRecord:
    """The logical tensor ``obj`` stands for, as an ordinary record holding its values inline
    under ``key``: what torchao's ``dequantize()`` gives (float32 arithmetic, then the logical
    dtype)."""
    import torch

    scheme = subclass_scheme(obj)
    block_size = scheme.block_size
    data = get_path(obj, scheme.data)
    if obj.dtype not in ITEMSIZE or data.numel * max(ITEMSIZE[obj.dtype], 4) > MAX_DENSE_BYTES:
        raise InputError(f"{key}: a {obj.dtype} {list(data.shape)} tensor is not dequantized")
    if scheme.packing == TINYGEMM:
        padded = _tinygemm_values(
            read_tensor(ckpt, data), read_tensor(ckpt, get_path(obj, scheme.scale))
        )
        rows, columns = obj.shape
        return _inline(padded[:rows, :columns], obj, data, key)
    values = read_tensor(ckpt, data).to(torch.float32)
    if scheme.zero_point is not None:
        zero = read_tensor(ckpt, get_path(obj, scheme.zero_point)).to(torch.float32)
        values = values - _per_block(zero, data.shape, block_size)
    scale = read_tensor(ckpt, get_path(obj, scheme.scale)).to(torch.float32)
    values = values * _per_block(scale, data.shape, block_size)
    return _inline(values, obj, data, key)


def _inline(
    values: torch.Tensor, obj: TensorSubclassObject, data: TensorRecord, key: str
) -> TensorRecord:
    """``values`` (float32) cast to ``obj``'s logical dtype, as a record holding them inline."""
    import torch

    out: Any = values.to(getattr(torch, obj.dtype)).contiguous()
    if tuple(out.shape) != obj.shape:
        out = out.reshape(obj.shape)
    raw = out.reshape(-1).view(torch.uint8).numpy().tobytes() if out.numel() else b""
    storage = StorageRecord(key, obj.dtype, out.numel(), data.location, "inline", len(raw))
    stride = tuple(out.stride())
    kind = "parameter" if data.kind == "parameter" else "tensor"
    return TensorRecord(
        key, obj.dtype, obj.shape, stride, 0, storage, obj.requires_grad, kind, inline_data=raw
    )
