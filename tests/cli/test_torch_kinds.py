"""show, --stats, diff and convert on sparse, quantized and nested tensors, zip and legacy."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpttool.cli import cli

torch = pytest.importorskip("torch")

FORMATS = pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])


def _sparse() -> Any:
    indices = torch.tensor([[0, 1, 3], [1, 2, 0]])
    return torch.sparse_coo_tensor(indices, torch.tensor([1.5, -2.0, 3.0]), (4, 3))


def _quantized() -> Any:
    return torch.quantize_per_tensor(torch.tensor([-0.2, 0.0, 0.7]), 0.1, 2, torch.quint8)


def _save(obj: Any, path: Path, legacy: bool) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return path


def _run(*args: str) -> Any:
    result = CliRunner().invoke(cli, [*args, "--json"] if args[0] != "convert" else list(args))
    return result


@FORMATS
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "sparse_csc"])
def test_show_lists_a_sparse_tensor_as_one(tmp_path: Path, legacy: bool, layout: str) -> None:
    tensor = _sparse() if layout == "sparse_coo" else getattr(_sparse(), f"to_{layout}")()
    path = _save({"s": tensor, "w": torch.ones(2)}, tmp_path / "s.pt", legacy)
    result = _run("show", str(path), "--stats")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    by_key = {t["key"]: t for t in report["tensors"]}
    assert sorted(by_key) == ["s", "w"]  # no anonymous parts
    sparse = by_key["s"]
    assert (sparse["dtype"], sparse["shape"]) == ("float32", [4, 3])
    assert f"{layout}, nnz 3, indices int64" in sparse["notes"]
    dense = tensor.to_dense()
    assert sparse["stats"]["min"] == pytest.approx(float(dense.min()))
    assert sparse["stats"]["max"] == pytest.approx(float(dense.max()))
    assert sparse["stats"]["mean"] == pytest.approx(float(dense.mean()))


@FORMATS
def test_show_lists_a_quantized_tensor(tmp_path: Path, legacy: bool) -> None:
    path = _save({"q": _quantized()}, tmp_path / "q.pt", legacy)
    result = _run("show", str(path), "--stats")
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.output)["tensors"]
    assert (entry["key"], entry["dtype"], entry["shape"]) == ("q", "quint8", [3])
    assert "quantized per_tensor_affine scale 0.1 zero_point 2" in entry["notes"]
    assert entry["stats"]["min"] == pytest.approx(-0.2)
    assert entry["stats"]["max"] == pytest.approx(0.7)


@FORMATS
def test_diff_compares_sparse_with_its_dense_twin(tmp_path: Path, legacy: bool) -> None:
    sparse = _save({"s": _sparse()}, tmp_path / "a.pt", legacy)
    dense = _save({"s": _sparse().to_dense()}, tmp_path / "b.pt", legacy)
    changed = _save({"s": _sparse().to_dense() * 2}, tmp_path / "c.pt", legacy)
    report = json.loads(_run("diff", str(sparse), str(dense)).output)
    (entry,) = report["tensors"]
    assert entry["status"] == "identical"
    assert entry["changes"] == ["layout sparse_coo -> strided (values compared dense)"]
    report = json.loads(_run("diff", str(sparse), str(changed)).output)
    assert report["tensors"][0]["status"] == "differ"
    assert report["tensors"][0]["values"]["mismatched"] == 3


@FORMATS
def test_diff_dequantizes(tmp_path: Path, legacy: bool) -> None:
    a = _save({"q": _quantized()}, tmp_path / "a.pt", legacy)
    b = _save({"q": _quantized().dequantize()}, tmp_path / "b.pt", legacy)
    result = _run("diff", str(a), str(b))
    (entry,) = json.loads(result.output)["tensors"]
    assert entry["status"] == "identical", entry


@FORMATS
@pytest.mark.parametrize("kind", ["sparse", "quantized"])
def test_convert_to_safetensors_refuses_in_one_line(
    tmp_path: Path, legacy: bool, kind: str
) -> None:
    tensor = _sparse() if kind == "sparse" else _quantized()
    path = _save({"t": tensor, "w": torch.ones(2)}, tmp_path / "in.pt", legacy)
    for target in ("safetensors",):
        out = tmp_path / f"out.{target}"
        result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--to", target])
        assert result.exit_code == 2, result.output
        line = result.output.strip()
        assert "\n" not in line
        assert line.startswith("Error: t: a ")
        assert ("--densify" if kind == "sparse" else "--dequantize") in line
        assert not out.exists()
    out = tmp_path / "w.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--filter", "w"])
    assert result.exit_code == 0, result.output


@FORMATS
def test_hostile_sparse_tensors_are_refused_not_densified(tmp_path: Path, legacy: bool) -> None:
    out_of_range = torch.sparse_coo_tensor(
        torch.tensor([[0, 9], [0, 0]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    huge = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), [1.0], (2**31, 2**31))
    path = _save({"bad": out_of_range, "huge": huge}, tmp_path / "h.pt", legacy)
    result = _run("show", str(path), "--stats")
    assert result.exit_code == 0, result.output
    entries = {t["key"]: t for t in json.loads(result.output)["tensors"]}
    assert "invalid sparse_coo tensor" in entries["bad"]["stats_unavailable"]
    assert "not densified" in entries["huge"]["stats_unavailable"]
    assert entries["huge"]["shape"] == [2**31, 2**31]


@FORMATS
@pytest.mark.parametrize("target", ["safetensors", "pth"])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "sparse_bsc", "quantized"])
def test_convert_densifies_and_dequantizes(
    tmp_path: Path, legacy: bool, target: str, layout: str
) -> None:
    if layout == "quantized":
        tensor, flag, dense = _quantized(), "--dequantize", _quantized().dequantize()
    else:
        tensor = _sparse() if layout == "sparse_coo" else _sparse().to_dense()
        if layout == "sparse_csr":
            tensor = tensor.to_sparse_csr()
        elif layout == "sparse_bsc":
            tensor = tensor.to_sparse_bsc((2, 1))
        flag, dense = "--densify", _sparse().to_dense()
    path = _save({"t": tensor, "w": torch.ones(2)}, tmp_path / "in.pt", legacy)
    out = tmp_path / f"out.{target}"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--to", target, flag])
    assert result.exit_code == 0, result.output
    assert ("densified" if flag == "--densify" else "dequantized") + " 1 tensor(s): t" in (
        result.output
    )
    if target == "safetensors":
        from safetensors.torch import load_file

        written = load_file(out)
    else:
        written = torch.load(out, weights_only=True)
    assert sorted(written) == ["t", "w"]
    assert written["t"].layout == torch.strided
    assert torch.equal(written["t"], dense)


def _kept_kinds() -> dict[str, Any]:
    """One tensor of every kind ``convert --to pth`` keeps as it is."""
    dense = _sparse().to_dense()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "coo": _sparse(),
            "coo_coalesced": _sparse().coalesce(),
            "csr": dense.to_sparse_csr(),
            "csc": dense.to_sparse_csc(),
            "bsr": dense.to_sparse_bsr((2, 1)),
            "bsc": dense.to_sparse_bsc((2, 1)),
            "per_tensor": _quantized(),
            "per_channel": torch.quantize_per_channel(
                torch.tensor([[-1.0, 0.5], [0.25, 2.0], [3.0, -0.75]]),
                torch.tensor([0.1, 0.05, 0.25], dtype=torch.float64),
                torch.tensor([0, 3, -1]),
                0,
                torch.qint8,
            ),
            "quint4x2": torch.quantize_per_tensor(
                torch.tensor([[0.0, 0.3, 1.2, 0.7]]), 0.1, 1, torch.quint4x2
            ),
            "nested": torch.nested.nested_tensor([torch.ones(2, 3), torch.arange(3.0)[None]]),
        }


def _same(a: Any, b: Any) -> bool:
    if a.is_nested:
        return b.is_nested and all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
    if (a.layout, a.dtype, a.shape, a.is_quantized) != (b.layout, b.dtype, b.shape, b.is_quantized):
        return False
    if a.is_quantized:
        if a.qscheme() != b.qscheme() or not torch.equal(a.int_repr(), b.int_repr()):
            return False
        if a.qscheme() == torch.per_tensor_affine:
            return (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point())
        return (
            a.q_per_channel_axis() == b.q_per_channel_axis()
            and torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales())
            and torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points())
        )
    if a.layout == torch.sparse_coo:
        return (
            a.is_coalesced() == b.is_coalesced()
            and torch.equal(a._indices(), b._indices())
            and torch.equal(a._values(), b._values())
        )
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense()) and torch.equal(a.values(), b.values())
    return torch.equal(a, b)


def _load(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=True)


@FORMATS
@pytest.mark.parametrize("kind", list(_kept_kinds()))
def test_convert_to_pth_keeps_the_kind(tmp_path: Path, legacy: bool, kind: str) -> None:
    tensor = _kept_kinds()[kind]
    path = _save({"t": tensor, "w": torch.arange(4.0)}, tmp_path / "in.pt", legacy)
    out = tmp_path / "out.pth"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--to", "pth"])
    assert result.exit_code == 0, result.output
    assert "kept (sparse, nested or quantized, in torch's own form) 1 tensor(s): t" in (
        result.output
    )
    # (compared with the tensor saved: torch cannot read back its own legacy nested file)
    written = _load(out)
    assert sorted(written) == ["t", "w"]
    assert _same(tensor, written["t"]), written["t"]
    assert torch.equal(written["w"], torch.arange(4.0))
    report = json.loads(_run("diff", str(path), str(out)).output)
    assert {e["key"]: e["status"] for e in report["tensors"]} == {
        "t": "identical",
        "w": "identical",
    }


def test_convert_to_pth_keeps_every_kind_in_one_file(tmp_path: Path) -> None:
    kinds = _kept_kinds()
    path = _save({**kinds, "w": torch.ones(3)}, tmp_path / "in.pt", False)
    out = tmp_path / "out.pth"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--dtype", "fp16"])
    assert result.exit_code == 0, result.output
    written = _load(out)
    assert all(_same(kinds[k], written[k]) for k in kinds)
    assert written["w"].dtype == torch.float16  # plain tensors are still cast
    assert "sparse, nested and quantized tensors are not cast" in result.output


def test_convert_to_pth_densify_still_densifies(tmp_path: Path) -> None:
    path = _save({"s": _sparse(), "q": _quantized()}, tmp_path / "in.pt", False)
    out = tmp_path / "out.pth"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--densify"])
    assert result.exit_code == 0, result.output
    written = _load(out)
    assert torch.equal(written["s"], _sparse().to_dense())
    assert _same(written["q"], _quantized())  # not dequantized: only --dequantize does that


def test_nested_tensor_is_refused_by_safetensors(tmp_path: Path) -> None:
    path = _save({"n": _kept_kinds()["nested"]}, tmp_path / "in.pt", False)
    result = CliRunner().invoke(cli, ["convert", str(path), str(tmp_path / "o.safetensors")])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: n: a nested tensor")


def test_verification_catches_a_changed_kept_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.commands.convert import torch_kinds

    path = _save({"q": _quantized()}, tmp_path / "in.pt", False)
    out = tmp_path / "out.pth"
    original = torch_kinds.save

    def tampered(handle: Any, state: dict[str, Any]) -> None:
        state["q"] = torch.quantize_per_tensor(torch.tensor([-0.2, 0.0, 0.7]), 0.1, 3, torch.quint8)
        original(handle, state)

    monkeypatch.setattr(torch_kinds, "save", tampered)
    result = CliRunner().invoke(cli, ["convert", str(path), str(out)])
    assert result.exit_code == 1, result.output
    assert "q does not read back as the same tensor" in result.output
    assert not out.exists()
