"""Tensor values, read on request through the reader, one tensor at a time.

Only the bytes from a tensor's first to its last element are read (``pread``), so memory is
bounded by the largest tensor, never by the file. NumPy does the arithmetic for ``--stats``;
:func:`read_tensor` gives a torch tensor (for diff and convert) and imports torch only then.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import InputError
from ckpttool.model.dtypes import BY_NAME, NUMPY_CODES
from ckpttool.model.records import ITEMSIZE, RecordReader, StorageRecord, TensorRecord, with_key

if TYPE_CHECKING:
    import numpy as np
    import torch

# dtypes NumPy has natively; the others are read as raw integers of the same width.
_NUMPY_NATIVE = NUMPY_CODES  # the one dtype table's (model/dtypes.py)
_RAW_WIDTH = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}
CHUNK = 1 << 20  # elements per step when reducing a large tensor


def numpy_code(record: TensorRecord) -> str:
    code = _NUMPY_NATIVE.get(record.dtype) or _RAW_WIDTH[record.itemsize]
    order = ">" if record.storage is not None and record.storage.byteorder == "big" else "<"
    return order + code if code not in ("u1", "i1", "b1") else code


def read_array(ckpt: RecordReader, record: TensorRecord) -> np.ndarray:
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


#: Minifloat formats NumPy lacks, decoded through a table of every code:
#: (exponent bits, mantissa bits, exponent bias, which codes are special). "fn": no infinities,
#: all-ones exponent and mantissa is NaN; "ieee": all-ones exponent is Inf (mantissa 0) or NaN;
#: "fnuz": no infinities, no negative zero, the negative-zero code is NaN; "e8m0": no sign, no
#: mantissa, 0xFF is NaN.
_MINIFLOATS: dict[str, tuple[int, int, int, str]] = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, "e8m0"),
    "float4_e2m1fn_x2": (2, 1, 1, "none"),  # two 4-bit values per byte; no NaN, no Inf
}
#: The dtypes above: :func:`as_float` decodes them exactly.
MINIFLOATS = frozenset(_MINIFLOATS)
_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def stats_unavailable(record: TensorRecord) -> str | None:
    """Why :func:`tensor_stats` cannot describe this tensor's values (None: it can)."""
    if record.layout == "nested":
        return "a nested tensor's values are ragged; ckpttool does not pad them"
    if record.parts or record.quant is not None:
        return None  # densified / dequantized on request (dense_record)
    if record.storage is None and record.inline_data is None:
        if record.dtensor is not None:
            return "a DTensor shard: this file holds one rank's piece, not the tensor"
        return "a meta tensor stores no values"
    if record.dtype in _QUANTIZED:
        return f"{record.dtype} values need the scale and zero point, which ckpttool does not apply"
    if record.dtype.startswith("bits"):
        return f"{record.dtype} holds raw bits with no numeric meaning"
    if record.dtype not in ITEMSIZE:
        return f"unknown dtype {record.dtype!r}"
    if not BY_NAME[record.dtype].torch:  # GGUF's blocks, without the scheme that decodes them
        return f"{record.dtype} blocks are decoded by the format that read them"
    return None


def stats_basis(record: TensorRecord) -> str | None:
    """What the statistics of a tensor describe when it is not its values as they are."""
    if record.quant is not None:
        return "stats of the dequantized values"
    if record.is_sparse:
        return "stats of the dense tensor (zeros included)"
    if record.dtype.startswith("complex"):
        return "stats of |z|"
    if record.dtype == "bool":
        return "stats of False=0, True=1"
    if record.dtype == "float4_e2m1fn_x2":
        return "stats of both 4-bit values of each element"
    return None


def as_float(record: TensorRecord, array: np.ndarray) -> np.ndarray:
    """Numeric values for statistics: bfloat16 widened exactly to float32, float8/float4 decoded
    exactly to float32, complex32 to complex64; NumPy's own dtypes as they are."""
    import numpy as np

    if record.dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if record.dtype in _MINIFLOATS:
        table = _minifloat_table(record.dtype)
        if record.dtype == "float4_e2m1fn_x2":
            return np.concatenate([table[array & 0x0F], table[array >> 4]])
        return table[array]
    if record.dtype == "complex32":
        halves = np.ascontiguousarray(array).view(array.dtype.byteorder.replace("|", "") + "f2")
        return halves[0::2].astype(np.float32) + 1j * halves[1::2].astype(np.float32)
    unavailable = stats_unavailable(record)
    if unavailable is not None:
        raise InputError(f"{record.key}: no statistics: {unavailable}")
    return array


@functools.cache  # 256 values, asked for once per chunk
def _minifloat_table(dtype: str) -> np.ndarray:
    """float32 value of every code of a minifloat format (exact: each fits float32)."""
    import numpy as np

    exp_bits, man_bits, bias, special = _MINIFLOATS[dtype]
    sign_bits = 0 if special == "e8m0" else 1
    codes = np.arange(1 << (sign_bits + exp_bits + man_bits), dtype=np.int64)
    exponent = (codes >> man_bits) & ((1 << exp_bits) - 1)
    mantissa = (codes & ((1 << man_bits) - 1)).astype(np.float64) / (1 << man_bits)
    negative = ((codes >> (exp_bits + man_bits)) & 1).astype(bool) if sign_bits else codes < 0
    # exponent 0 is subnormal (no implicit 1) except in e8m0, where every code is 2**(e - bias)
    subnormal = (exponent == 0) if special != "e8m0" else np.zeros_like(codes, dtype=bool)
    magnitude = np.where(
        subnormal,
        mantissa * 2.0 ** (1 - bias),
        (1.0 + mantissa) * np.exp2((exponent - bias).astype(np.float64)),
    )
    values = np.where(negative, -magnitude, magnitude)
    top = (1 << exp_bits) - 1
    if special == "fn":
        values[(exponent == top) & (codes & ((1 << man_bits) - 1) == (1 << man_bits) - 1)] = np.nan
    elif special == "ieee":
        at_top = exponent == top
        values[at_top] = np.where(
            mantissa[at_top] == 0, np.where(negative[at_top], -np.inf, np.inf), np.nan
        )
    elif special == "fnuz":
        values[1 << (exp_bits + man_bits)] = np.nan
    elif special == "e8m0":
        values[top] = np.nan
    table = values.astype(np.float32)
    table.flags.writeable = False  # shared by every caller (cached)
    return table


@dataclass(frozen=True)
class TensorStats:
    min: float
    max: float
    mean: float
    std: float
    nan: int
    inf: int


def tensor_stats(ckpt: RecordReader, record: TensorRecord) -> TensorStats:
    """min/max/mean/std over finite values, and NaN/Inf counts, in float64, chunk by chunk.
    ``std`` is the population standard deviation (ddof=0: divided by N, NumPy's ``std()``,
    torch's ``std(unbiased=False)``).

    Every dtype with numeric values is decoded (bfloat16, float8/float4, complex as |z|, bool as
    0/1); :func:`stats_unavailable` names the ones that cannot be, for which this raises
    :class:`InputError`.
    """
    import numpy as np

    unavailable = stats_unavailable(record)
    if unavailable is not None:
        raise InputError(f"{record.key}: no statistics: {unavailable}")
    record = dense_record(ckpt, record)
    flat = read_array(ckpt, record).reshape(-1)
    lo, hi, total, total_sq, count, nan, inf = math.inf, -math.inf, 0.0, 0.0, 0, 0, 0
    # A signaling NaN in the file makes the float64 cast warn "invalid value", values near
    # float64's limit make the squares overflow: both are data, counted below, not warnings.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, flat.size, CHUNK):
            # decoded one chunk at a time: a float8 tensor widens fourfold, then eightfold
            chunk = as_float(record, flat[start : start + CHUNK])
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


#: The integer type a quantized dtype stores (its int_repr).
_QUANTIZED_STORED = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}


def read_tensor(ckpt: RecordReader, record: TensorRecord) -> torch.Tensor:
    """The tensor as a contiguous CPU torch tensor that owns its memory (views are copied).

    A sparse tensor comes back sparse (of its layout), a quantized one quantized, built from
    their parts as torch would: what ``torch.load`` gives, on the CPU. A tensor quantized in
    GGUF's blocks (which torch cannot hold) comes back as its float32 values.
    """
    import numpy as np
    import torch

    if record.quant is not None and record.quant.in_blocks:  # GGUF's: decoded by its format
        return read_tensor(ckpt, _decoded_blocks(ckpt, record))
    if record.is_sparse or record.quant is not None:
        # torch warns that sparse support is beta and quantized tensors deprecated: not news
        # to the user reading their file
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if record.quant is not None:
                return _read_quantized(ckpt, record)
            return _read_sparse(ckpt, record)
    if record.layout == "nested":
        flat, sizes, strides, offsets = (read_tensor(ckpt, p) for p in record.parts)
        _check_nested(record, flat, sizes, strides, offsets)
        return torch._nested_view_from_buffer(flat, sizes, strides, offsets).clone()

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


def _check_nested(
    record: TensorRecord,
    flat: torch.Tensor,
    sizes: torch.Tensor,
    strides: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Every component inside the buffer (torch does not check: a hostile file would make it
    read past the buffer's memory)."""
    rows = sizes.shape[0]
    if strides.shape != sizes.shape or tuple(offsets.shape) != (rows,):
        raise InputError(f"{record.key}: nested tensor with mismatched sizes/strides/offsets")
    if rows and (int(sizes.min()) < 0 or int(strides.min()) < 0 or int(offsets.min()) < 0):
        raise InputError(f"{record.key}: nested tensor with a negative size, stride or offset")
    for row in range(rows):
        dims = [(int(n), int(s)) for n, s in zip(sizes[row].tolist(), strides[row].tolist())]
        if any(n == 0 for n, _ in dims):
            continue
        last = int(offsets[row]) + sum((n - 1) * s for n, s in dims)
        if last >= flat.numel():
            raise InputError(f"{record.key}: nested component {row} reaches past its buffer")


#: Densifying a sparse tensor allocates its dense size: a few bytes of indices can claim a
#: [2**31, 2**31] shape. Past this, --stats and diff refuse rather than exhaust memory.
MAX_DENSE_BYTES = 16 << 30


def _read_sparse(ckpt: RecordReader, record: TensorRecord) -> torch.Tensor:
    import torch

    parts = [read_tensor(ckpt, part) for part in record.parts]
    # the parts come from the file: torch checks them (indices in range, sorted compressed
    # indices...) before anything densifies them, as torch.load does
    try:
        if record.layout == "sparse_coo":
            indices, values = parts
            return torch.sparse_coo_tensor(
                indices, values, record.shape, is_coalesced=record.is_coalesced,
                check_invariants=True,
            )  # fmt: skip
        compressed, plain, values = parts
        return torch.sparse_compressed_tensor(
            compressed, plain, values, record.shape, layout=getattr(torch, record.layout),
            check_invariants=True,
        )  # fmt: skip
    except (RuntimeError, ValueError) as error:
        raise InputError(f"{record.key}: invalid {record.layout} tensor: {error}") from None


def _read_quantized(ckpt: RecordReader, record: TensorRecord) -> torch.Tensor:
    """Rebuilt as ``torch._utils._rebuild_qtensor`` does: an empty quantized tensor of the
    scheme, set to the stored bytes."""
    import torch

    quant = record.quant
    assert quant is not None
    dtype = torch_dtype(record.dtype)
    if quant.axis is None:
        assert isinstance(quant.scale, float) and isinstance(quant.zero_point, (int, float))
        tensor = torch._empty_affine_quantized(
            record.shape, scale=quant.scale, zero_point=int(quant.zero_point), dtype=dtype
        )
    else:
        float_params = quant.qscheme == "per_channel_affine_float_qparams"
        scales, zero_points = (
            read_tensor(ckpt, value)
            if isinstance(value, TensorRecord)
            else torch.tensor(value, dtype=kind)
            for value, kind in (
                (quant.scale, torch.float if float_params else torch.double),
                (quant.zero_point, torch.float if float_params else torch.long),
            )
        )
        tensor = torch._empty_per_channel_affine_quantized(
            record.shape, scales=scales, zero_points=zero_points, axis=quant.axis, dtype=dtype
        )
    if record.numel == 0:
        return tensor
    data, first = ckpt.read_bytes(record)
    untyped = torch.UntypedStorage.from_buffer(bytes(data), dtype=torch.uint8)
    typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
    tensor.set_(typed, first, record.shape, record.stride)
    return tensor.contiguous()


def dense_record(ckpt: RecordReader, record: TensorRecord) -> TensorRecord:
    """What ``--stats``, diff and ``convert --densify/--dequantize`` read of a sparse or
    quantized tensor: its dense (dequantized) values as an ordinary record holding them inline.
    A nested tensor gives its flat buffer. Any other record is returned as it is. Memory: the
    dense tensor, as torch's ``to_dense``."""
    if not record.parts and record.quant is None:
        return record  # (before importing torch: diff of plain tensors never imports it)
    if record.layout == "nested":  # ragged: its values are its flat buffer
        return with_key(record.parts[0], record.key)
    if record.quant is not None and record.quant.in_blocks:
        return _decoded_blocks(ckpt, record)
    if record.nbytes > MAX_DENSE_BYTES:
        raise InputError(
            f"{record.key}: its dense values would take {record.nbytes:,} bytes (over "
            f"{MAX_DENSE_BYTES:,}); not densified"
        )
    import torch

    tensor = read_tensor(ckpt, record)
    if tensor.is_quantized:
        tensor = tensor.dequantize()
    elif tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    stride = tuple(tensor.stride())
    storage = StorageRecord(record.key, dtype, tensor.numel(), record.location, "inline", len(raw))
    return TensorRecord(
        record.key, dtype, record.shape, stride, 0, storage, record.requires_grad, record.kind,
        inline_data=raw,
    )  # fmt: skip


def _decoded_blocks(ckpt: RecordReader, record: TensorRecord) -> TensorRecord:
    """A tensor quantized in its format's blocks (GGUF's Q8_0...) as its float32 values,
    decoded by the format (``Checkpoint.dequantize``) with NumPy: torch is not imported."""
    if record.numel * 4 > MAX_DENSE_BYTES:
        raise InputError(
            f"{record.key}: its float32 values would take {record.numel * 4:,} bytes (over "
            f"{MAX_DENSE_BYTES:,}); not dequantized"
        )
    raw = ckpt.dequantize(record).tobytes() if record.numel else b""
    stride = tuple(math.prod(record.shape[i + 1 :]) for i in range(len(record.shape)))
    storage = StorageRecord(
        record.key, "float32", record.numel, record.location, "inline", len(raw)
    )
    return TensorRecord(
        record.key, "float32", record.shape, stride, 0, storage, record.requires_grad, record.kind,
        inline_data=raw,
    )  # fmt: skip
