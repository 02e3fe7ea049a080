"""Floating-point casts done with NumPy, bit-identical to torch's ``tensor.to(dtype)``.

``convert`` casts weights without importing torch (importing it costs about a second and a
few hundred MB of memory, more than the conversion of a MiniMind model itself). NumPy's
float32 -> float16 cast rounds to nearest even, as torch does; NumPy has no bfloat16, so that
cast is done on the bits (round to nearest even on the float32's upper half, NaN -> 0x7FC0,
as ``c10::BFloat16`` does). float64 goes through float32 first because that is what torch's
kernels do (``static_cast<float>`` then the narrow cast); a direct cast would round once
instead of twice and differ from torch in rare ties. ``tests/test_cast.py`` checks every cast
against torch bit for bit.

Every cast also counts what it loses: finite values that became infinite (overflow, e.g. above
65504 for float16) and non-zero values that became zero (underflow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpttool.model.dtypes import CASTABLE as CASTABLE  # re-exported: the commands import them here
from ckpttool.model.dtypes import TARGETS as TARGETS

# How each castable dtype is held in NumPy (bfloat16 as its raw bits).
_STORED: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
# elements per step: float32 temporaries of 1 MiB, which stay in the CPU cache between the
# passes of a cast (4 M elements were measured slower: bench/README.md, issue 43)
_CHUNK = 1 << 18


@dataclass(frozen=True)
class CastCounts:
    """What a cast lost, for one tensor."""

    overflow: int  # finite values that became +-inf
    underflow: int  # non-zero values that became zero
    max_abs: float  # largest finite |value| in the source when some overflowed, else 0.0


def stored_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype that holds a castable torch dtype's elements (bfloat16: uint16 bits)."""
    return _STORED[name]


def widen(values: np.ndarray, dtype: str) -> np.ndarray:
    """Exact float32 (float64 for float64) values of an array held as ``stored_dtype(dtype)``."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float64":
        return values.astype(np.float64, copy=False)
    return values.astype(np.float32, copy=False)


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even; every NaN becomes 0x7FC0."""
    bits = values.view(np.uint32)
    rounded = bits >> 16  # in place from here on: one temporary for the whole computation
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    result = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        result[nan] = 0x7FC0
    return result


def _narrow(wide: np.ndarray, target: str) -> np.ndarray:
    single = wide.astype(np.float32, copy=False)  # float64 -> float32 first, as torch does
    if target == "float32":
        return single
    if target == "float16":
        return single.astype(np.float16)
    return to_bfloat16_bits(single)


# Casts that can lose range: finite -> inf, or non-zero -> zero. The others are exact.
_LOSSLESS = {("float16", "float32"), ("bfloat16", "float32"), ("float16", "bfloat16")}
_SIGNLESS = np.uint16(0x7FFF)


def cast_array(values: np.ndarray, source: str, target: str) -> tuple[np.ndarray, CastCounts]:
    """Cast a C-contiguous array from ``source`` to ``target`` (torch dtype names).

    ``values`` is held as :func:`stored_dtype` (source); the result is held as
    ``stored_dtype(target)``, flat. Works in chunks so temporaries stay small.
    """
    flat = values.reshape(-1)
    out = np.empty(flat.size, dtype=_STORED[target])
    overflow = underflow = 0
    max_abs = 0.0
    for start in range(0, flat.size, _CHUNK):
        wide = widen(flat[start : start + _CHUNK], source)
        with np.errstate(over="ignore", invalid="ignore"):  # counted below, not warned about
            narrow = _narrow(wide, target)
        out[start : start + _CHUNK] = narrow
        if (source, target) in _LOSSLESS or not wide.size:
            continue
        lost, largest = _overflow(wide, narrow, target)
        overflow += lost
        max_abs = max(max_abs, largest)
        # zeros (either sign) that were not zeros before; NaN is non-zero on both sides
        out_bits = narrow.view(np.uint32 if target == "float32" else np.uint16)
        out_nonzero = int(
            np.count_nonzero(out_bits & (0x7FFFFFFF if target == "float32" else _SIGNLESS))
        )
        if out_nonzero < narrow.size:  # no zero out means no zero in: nothing underflowed
            underflow += int(np.count_nonzero(wide)) - out_nonzero
    return out, CastCounts(overflow, underflow, max_abs)


def count_overflow(
    values: np.ndarray, source: str, narrowed: np.ndarray, target: str
) -> tuple[int, float]:
    """The overflow check of :func:`cast_array` for a cast done elsewhere (``save_checkpoint``'s,
    by torch): (finite ``values`` that are inf in ``narrowed``, the largest finite |value| if
    any are). Both arrays are held as :func:`stored_dtype` of their dtype, in the same order."""
    if (source, target) in _LOSSLESS or source == target:
        return 0, 0.0
    flat, narrow = values.reshape(-1), narrowed.reshape(-1)
    lost, largest = 0, 0.0
    for start in range(0, flat.size, _CHUNK):
        chunk = widen(flat[start : start + _CHUNK], source)
        chunk_lost, chunk_largest = _overflow(chunk, narrow[start : start + _CHUNK], target)
        lost, largest = lost + chunk_lost, max(largest, chunk_largest)
    return lost, largest


def _overflow(wide: np.ndarray, narrow: np.ndarray, target: str) -> tuple[int, float]:
    """(finite values that became inf, largest finite |value| if any did)."""
    with np.errstate(invalid="ignore"):
        extreme = max(abs(float(wide.max())), abs(float(wide.min())))
    if math.isfinite(extreme):
        # rounding is monotone: if the largest magnitude stays finite, every value does
        probe = np.array([extreme], dtype=wide.dtype)
        with np.errstate(over="ignore"):
            if math.isfinite(float(widen(_narrow(probe, target), target)[0])):
                return 0, 0.0
    finite = np.isfinite(wide)
    lost = int(np.count_nonzero(finite & np.isinf(widen(narrow, target))))
    return lost, float(np.abs(wide[finite]).max()) if lost else 0.0
