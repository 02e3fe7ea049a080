"""The values of a wrapper tensor subclass (torchao's ``Int8Tensor``, ``Float8Tensor``...)
computed from its inner tensors, as its own ``dequantize()`` would: ``convert --dequantize``.

torchao's affine scheme: each block of ``block_size`` elements of ``qdata`` shares one
``scale`` (and ``zero_point``): value = (q - zero_point) * scale, in float32, cast to the
logical dtype. Float8 tensors have no zero point. torch does the arithmetic; torchao is never
imported and nothing from the file runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ckpttool.errors import InputError
from ckpttool.io.values import MAX_DENSE_BYTES, read_tensor
from ckpttool.model.records import (
    ITEMSIZE,
    RecordReader,
    StorageRecord,
    TensorRecord,
    TensorSubclassObject,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DATA_NAMES", "dequantized_subclass", "subclass_scheme"]

#: The inner tensor holding the quantized values, by its name in torchao's classes (the
#: current tensors' ``qdata``; the older AffineQuantizedTensor layouts' ``int_data``).
DATA_NAMES = ("qdata", "int_data")


def subclass_scheme(obj: TensorSubclassObject) -> tuple[str, str, str | None, tuple[int, ...]]:
    """(data name, scale name, zero point name or None, block size) of an affine-quantized
    subclass, or an :class:`InputError` saying why ckpttool cannot dequantize it."""
    inner = obj.inner_tensors()
    data = next((name for name in DATA_NAMES if name in inner), None)
    if data is None or "scale" not in inner:
        raise InputError(
            f"{obj.cls} holds {', '.join(inner) or 'no tensors'}, not the quantized data and "
            "scale ckpttool dequantizes; convert without --dequantize keeps its inner tensors"
        )
    shape = inner[data].shape
    block = obj.fields().get("block_size")
    if isinstance(block, (list, tuple)) and all(isinstance(b, int) and b > 0 for b in block):
        block_size = tuple(block)
    else:  # the scale's shape says it: one scale per block
        scale_shape = inner["scale"].shape
        if len(scale_shape) != len(shape) or any(not s for s in scale_shape):
            raise InputError(f"{obj.cls}: no block_size, and its scale does not say one")
        block_size = tuple(n // s for n, s in zip(shape, scale_shape))
    if len(block_size) != len(shape) or any(n % b for n, b in zip(shape, block_size)):
        raise InputError(f"{obj.cls}: block_size {list(block_size)} does not tile {list(shape)}")
    zero = "zero_point" if "zero_point" in inner else None
    return data, "scale", zero, block_size


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

    data_name, scale_name, zero_name, block_size = subclass_scheme(obj)
    inner = obj.inner_tensors()
    data = inner[data_name]
    if obj.dtype not in ITEMSIZE or data.numel * max(ITEMSIZE[obj.dtype], 4) > MAX_DENSE_BYTES:
        raise InputError(f"{key}: a {obj.dtype} {list(data.shape)} tensor is not dequantized")
    values = read_tensor(ckpt, data).to(torch.float32)
    if zero_name is not None:
        zero = read_tensor(ckpt, inner[zero_name]).to(torch.float32)
        values = values - _per_block(zero, data.shape, block_size)
    scale = read_tensor(ckpt, inner[scale_name]).to(torch.float32)
    values = values * _per_block(scale, data.shape, block_size)
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
