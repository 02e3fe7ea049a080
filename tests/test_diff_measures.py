"""diff's change measures (rel change, cosine, changed fraction) against references computed
here in float64 with torch, on tensors with known changes, in every floating dtype."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpttool.commands.diff import values as diff_values
from ckpttool.commands.diff.run import DIFFER, IDENTICAL, TensorDiff, diff
from ckpttool.commands.diff.values import ValueDiff

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
TOL = 1e-9  # float64 sums of a few thousand terms, in whatever order a kernel adds them


def pair(tmp_path: Path, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **options: object) -> dict[str, TensorDiff]:  # fmt: skip
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt", **options)  # type: ignore[arg-type]
    return {entry.key: entry for entry in report.tensors}


def reference(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """The measures by their definitions, over pairs where both are finite, in float64."""
    x, y = a.to(torch.float64).flatten(), b.to(torch.float64).flatten()
    unchanged = (x == y) | (x.isnan() & y.isnan())
    finite = x.isfinite() & y.isfinite()
    x, y = x[finite], y[finite]
    return {
        "relative_change": float((y - x).norm() / x.norm()),
        "cosine_similarity": float(x @ y / (x.norm() * y.norm())),
        "changed_fraction": float((~unchanged).sum()) / a.numel(),
        "norm_a": float(x.norm()),
        "norm_b": float(y.norm()),
    }


def measures(values: ValueDiff | None) -> dict[str, float | None]:
    assert values is not None
    return {
        "relative_change": values.relative_change,
        "cosine_similarity": values.cosine_similarity,
        "changed_fraction": values.changed_fraction,
        "norm_a": values.norm_a,
        "norm_b": values.norm_b,
    }


def close(actual: dict[str, float | None], expected: dict[str, float]) -> None:
    for key, value in expected.items():
        got = actual[key]
        assert got is not None, key
        assert got == pytest.approx(value, rel=TOL, abs=TOL), key


def weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.{name}": (torch.randn(32, 24, generator=g) * 0.5).to(dtype)
        for i in range(3)
        for name in ("mlp.up_proj.weight", "attn.q_proj.weight")
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_layer_scaled_by_a_known_factor(tmp_path: Path, dtype: torch.dtype) -> None:
    """x2 is exact in every dtype (no value overflows): rel change 1, cosine 1, all changed."""
    a = weights(dtype)
    b = dict(a)
    key = "layers.1.mlp.up_proj.weight"
    b[key] = (a[key].to(torch.float32) * 2).to(dtype)
    entries = pair(tmp_path, a, b)
    entry = entries[key]
    assert entry.status == DIFFER
    close(measures(entry.values), reference(a[key], b[key]))
    assert entry.values is not None
    assert entry.values.relative_change == pytest.approx(1.0, rel=1e-12)
    assert entry.values.cosine_similarity == pytest.approx(1.0, rel=1e-12)
    nonzero = float((a[key].to(torch.float32) != 0).sum()) / a[key].numel()
    assert entry.values.changed_fraction == pytest.approx(nonzero)
    frozen = entries["layers.0.mlp.up_proj.weight"]  # not touched: identical, rel change 0
    assert frozen.status == IDENTICAL and frozen.values is not None
    assert frozen.values.relative_change == 0.0 and frozen.values.changed_fraction == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_random_update_matches_the_reference(tmp_path: Path, dtype: torch.dtype) -> None:
    a = weights(dtype)
    g = torch.Generator().manual_seed(1)
    b = {k: (v.to(torch.float32) + 0.05 * torch.randn(v.shape, generator=g)).to(dtype) for k, v in a.items()}  # fmt: skip
    entries = pair(tmp_path, a, b)
    for key in a:
        close(measures(entries[key].values), reference(a[key], b[key]))


def test_a_nan_is_left_out_of_the_norms_and_counted(tmp_path: Path) -> None:
    a = weights(torch.float32)
    b = {k: v * 1.5 for k, v in a.items()}
    key = "layers.2.attn.q_proj.weight"
    b[key][3, 4] = float("nan")
    b[key][5, 6] = float("inf")
    values = pair(tmp_path, a, b)[key].values
    assert values is not None
    close(measures(values), reference(a[key], b[key]))
    assert (values.nan_a, values.nan_b, values.inf_a, values.inf_b) == (0, 1, 0, 1)
    assert values.changed_fraction == 1.0


def test_a_tensor_changed_in_one_run_has_the_whole_norm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The equal runs before the first difference are not decoded on the first pass, but
    count in ‖A‖ (read once more)."""
    monkeypatch.setattr(diff_values, "CHUNK", 100)
    a = torch.linspace(-3, 3, 1000, dtype=torch.float64)
    b = a.clone()
    b[650:700] += 0.25
    values = pair(tmp_path, {"w": a}, {"w": b})["w"].values
    close(measures(values), reference(a, b))
    assert values is not None and values.changed_fraction == 50 / 1000


def test_norms_measure_identical_tensors_too(tmp_path: Path) -> None:
    a = weights(torch.bfloat16)
    plain = pair(tmp_path, a, dict(a))
    key = "layers.0.mlp.up_proj.weight"
    values = plain[key].values
    assert values is not None and values.norm_a is None and values.cosine_similarity is None
    assert values.relative_change == 0.0
    measured = pair(tmp_path, a, dict(a), norms=True)[key].values
    assert measured is not None and measured.bitwise_equal
    expected = float(a[key].to(torch.float64).norm())
    assert measured.norm_a == pytest.approx(expected, rel=TOL)
    assert measured.norm_b == pytest.approx(expected, rel=TOL)
    assert measured.cosine_similarity == pytest.approx(1.0, rel=1e-12)


def test_a_zero_tensor_that_changes_has_an_infinite_relative_change(tmp_path: Path) -> None:
    values = pair(tmp_path, {"w": torch.zeros(4)}, {"w": torch.tensor([0.0, 1.0, 0.0, 0.0])})["w"].values  # fmt: skip
    assert values is not None
    assert values.relative_change == math.inf and values.cosine_similarity is None
    assert values.changed_fraction == 0.25


def test_integers_are_measured_as_numbers(tmp_path: Path) -> None:
    a = torch.arange(10, dtype=torch.int64)
    b = a.clone()
    b[0] = 5
    values = pair(tmp_path, {"w": a}, {"w": b})["w"].values
    close(measures(values), reference(a, b))


def test_float8_values_are_decoded_exactly() -> None:
    """The table decoding float8 agrees with torch's own cast for every code."""
    from ckpttool.commands.diff.values import _measured
    from ckpttool.model.records import TensorRecord

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = np.arange(256, dtype=np.uint8)
        record = TensorRecord("w", str(dtype).removeprefix("torch."), (256,), (1,), 0, None)
        decoded = _measured(record, codes).astype(np.float64)
        expected = torch.from_numpy(codes).view(dtype).to(torch.float64).numpy()
        np.testing.assert_array_equal(decoded, expected)
