"""Tensor values, read on request through the reader, one tensor at a time.

Only the bytes from a tensor's first to its last element are read (``pread``), so memory is
bounded by the largest tensor, never by the file. NumPy does the arithmetic for ``--stats``;
:func:`read_tensor` gives a torch tensor (for diff and convert) and imports torch only then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import InputError
from ckpttool.records import TensorRecord

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckpttool.reader import Checkpoint

# dtypes NumPy has natively; the others are read as raw integers of the same width.
_NUMPY_NATIVE = {
    "float64": "f8", "float32": "f4", "float16": "f2", "complex128": "c16", "complex64": "c8",
    "int64": "i8", "int32": "i4", "int16": "i2", "int8": "i1",
    "uint64": "u8", "uint32": "u4", "uint16": "u2", "uint8": "u1", "bool": "b1",
}  # fmt: skip
_RAW_WIDTH = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}
CHUNK = 1 << 20  # elements per step when reducing a large tensor


def numpy_code(record: TensorRecord) -> str:
    code = _NUMPY_NATIVE.get(record.dtype) or _RAW_WIDTH[record.itemsize]
    order = ">" if record.storage is not None and record.storage.byteorder == "big" else "<"
    return order + code if code not in ("u1", "i1", "b1") else code


def read_array(ckpt: Checkpoint, record: TensorRecord) -> np.ndarray:
    """The tensor's elements as a NumPy array with its shape (bfloat16/float8 as raw ints)."""
    import numpy as np

    data, first = ckpt.read_bytes(record)
    flat = np.frombuffer(data, dtype=numpy_code(record))
    if record.numel == 0:
        return np.empty(record.shape, dtype=flat.dtype)
    itemsize = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[first:],
        shape=record.shape,
        strides=tuple(s * itemsize for s in record.stride),
        writeable=False,
    )


def as_float(record: TensorRecord, array: np.ndarray) -> np.ndarray:
    """Numeric view for statistics: bfloat16 widened exactly to float32; others as they are."""
    import numpy as np

    if record.dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if record.dtype.startswith(("float8", "float4", "q", "bits", "complex32")):
        raise InputError(f"{record.key}: statistics of {record.dtype} are not supported")
    return array


@dataclass(frozen=True)
class TensorStats:
    min: float
    max: float
    mean: float
    std: float
    nan: int
    inf: int


def tensor_stats(ckpt: Checkpoint, record: TensorRecord) -> TensorStats:
    """min/max/mean/std over finite values, and NaN/Inf counts, in float64, chunk by chunk."""
    import numpy as np

    flat = as_float(record, read_array(ckpt, record)).reshape(-1)
    lo, hi, total, total_sq, count, nan, inf = math.inf, -math.inf, 0.0, 0.0, 0, 0, 0
    # A signaling NaN in the file makes the float64 cast warn "invalid value", values near
    # float64's limit make the squares overflow: both are data, counted below, not warnings.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, flat.size, CHUNK):
            chunk = flat[start : start + CHUNK]
            if np.iscomplexobj(chunk):
                chunk = np.abs(chunk)
            chunk = chunk.astype(np.float64)
            finite = np.isfinite(chunk)
            nan += int(np.isnan(chunk).sum())
            inf += int(np.isinf(chunk).sum())
            values = chunk[finite] if not finite.all() else chunk
            if values.size:
                lo, hi = min(lo, float(values.min())), max(hi, float(values.max()))
                total += float(values.sum())
                total_sq += float(np.square(values).sum())
                count += values.size
    if count == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan, nan, inf)
    mean = total / count
    variance = max(total_sq / count - mean * mean, 0.0)
    return TensorStats(lo, hi, mean, math.sqrt(variance), nan, inf)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"this torch has no dtype {name!r}")
    return dtype


def read_tensor(ckpt: Checkpoint, record: TensorRecord) -> torch.Tensor:
    """The tensor as a contiguous CPU torch tensor that owns its memory (views are copied)."""
    import numpy as np
    import torch

    dtype = torch_dtype(record.dtype)
    if record.numel == 0:
        return torch.empty(record.shape, dtype=dtype)
    data, first = ckpt.read_bytes(record)
    buffer: Any = data if isinstance(data, bytearray) else bytearray(data)
    if record.storage is not None and record.storage.byteorder == "big":
        swapped = np.frombuffer(buffer, dtype=_RAW_WIDTH[record.itemsize]).byteswap()
        buffer = bytearray(swapped.tobytes())
    flat = torch.frombuffer(buffer, dtype=dtype)
    tensor = flat.as_strided(record.shape, record.stride, first)
    if first == 0 and tensor.is_contiguous() and flat.numel() == record.numel:
        return tensor
    return tensor.contiguous()
