"""NumPy casts agree with torch's ``tensor.to(dtype)`` bit for bit, and count what they lose."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.model.cast import cast_array, stored_dtype, to_bfloat16_bits, widen

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64}  # fmt: skip
RAW = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32,
       "float64": torch.int64}  # fmt: skip


def torch_cast(values: np.ndarray, source: str, target: str) -> np.ndarray:
    """torch's result of the same cast, as the raw bits convert stores."""
    tensor = torch.from_numpy(values.copy()).view(TORCH[source]).to(TORCH[target])
    return tensor.view(RAW[target]).numpy().view(stored_dtype(target))


def assert_same_bits(ours: np.ndarray, theirs: np.ndarray, target: str) -> None:
    """Bit-identical, except that any NaN may be any NaN (torch's kernels differ on that)."""
    nan_ours = np.isnan(widen(ours, target))
    nan_theirs = np.isnan(widen(theirs, target))
    assert np.array_equal(nan_ours, nan_theirs)
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[ours.dtype.itemsize]
    mismatch = (ours.view(width) != theirs.view(width)) & ~nan_ours
    assert not mismatch.any(), (ours[mismatch][:5], theirs[mismatch][:5])


ALL_16_BIT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize(
    ("source", "target"),
    [("float16", "bfloat16"), ("float16", "float32"), ("bfloat16", "float16"),
     ("bfloat16", "float32")],
)  # fmt: skip
def test_every_16_bit_value_casts_like_torch(source: str, target: str) -> None:
    values = ALL_16_BIT.view(stored_dtype(source))
    ours, _ = cast_array(values, source, target)
    assert_same_bits(ours, torch_cast(values, source, target), target)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=4, max_size=4096).filter(lambda b: len(b) % 4 == 0))
def test_float32_bit_patterns_cast_like_torch(data: bytes) -> None:
    values = np.frombuffer(data, dtype="<f4")
    for target in ("float16", "bfloat16"):
        ours, _ = cast_array(values, "float32", target)
        assert_same_bits(ours, torch_cast(values, "float32", target), target)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=8, max_size=4096).filter(lambda b: len(b) % 8 == 0))
def test_float64_casts_like_torch_including_double_rounding(data: bytes) -> None:
    values = np.frombuffer(data, dtype="<f8")
    for target in ("float16", "bfloat16", "float32"):
        ours, _ = cast_array(values, "float64", target)
        assert_same_bits(ours, torch_cast(values, "float64", target), target)


def test_float64_to_float16_rounds_through_float32_as_torch_does() -> None:
    # 1 + 2**-11 + 2**-40: a direct cast rounds up; via float32 it is a tie and rounds to even
    value = np.array([1 + 2**-11 + 2**-40], dtype="<f8")
    ours, _ = cast_array(value, "float64", "float16")
    assert ours[0] == np.float16(1.0)
    assert ours[0] == torch.tensor(value).half().item()


def test_bfloat16_rounding_ties_to_even_and_nan() -> None:
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7FC00001, 0xFF800001], dtype="<u4")
    result = to_bfloat16_bits(bits.view("<f4"))
    assert result.tolist() == [0x3F80, 0x3F82, 0x3F80, 0x7FC0, 0x7FC0]


def test_counts_overflow_and_underflow_exactly() -> None:
    values = np.array([70000.0, -1e6, 65504.0, 1e-9, -1e-10, 0.0, np.inf, np.nan, 1.0], "<f4")
    cast, counts = cast_array(values, "float32", "float16")
    assert counts.overflow == 2  # 70000 and -1e6; the input inf is not counted
    assert counts.underflow == 2  # 1e-9 and -1e-10; the input 0 is not counted
    assert counts.max_abs == 1e6
    assert np.isinf(cast[:2]).all() and cast[2] == 65504


def test_widening_loses_nothing() -> None:
    values = ALL_16_BIT.view("<f2")
    _, counts = cast_array(values, "float16", "float32")
    assert (counts.overflow, counts.underflow, counts.max_abs) == (0, 0, 0.0)


def test_large_arrays_are_cast_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckpttool.model.cast._CHUNK", 7)
    values = np.linspace(-1e5, 1e5, 100, dtype="<f4").reshape(4, 25)
    ours, counts = cast_array(values, "float32", "float16")
    assert_same_bits(ours, torch_cast(values.reshape(-1), "float32", "float16"), "float16")
    assert counts.overflow == int((np.abs(values) >= 65520).sum())


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_underflow_is_counted_per_chunk_with_and_without_zeros(
    monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """Chunks whose output holds no zero are not counted again (none of their values can have
    underflowed); the others are: the total is the same as over the whole array."""
    monkeypatch.setattr("ckpttool.model.cast._CHUNK", 3)
    tiny = 1e-9 if target == "float16" else float(np.array([1], "<u4").view("<f4")[0])
    values = np.array([1.0, 2.0, 3.0, tiny, 0.0, -tiny, 4.0, 5.0, 6.0, 0.0, 7.0], "<f4")
    cast, counts = cast_array(values, "float32", target)
    assert counts.underflow == 2  # tiny and -tiny; the input zeros are not counted
    assert_same_bits(cast, torch_cast(values, "float32", target), target)
