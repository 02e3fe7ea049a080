"""torchao quantized state dicts (``tests/fixtures/torchao/``, written by torchao 0.18.0's
``quantize_`` then ``torch.save(model.state_dict())``: ``tools/torchao_fixture.py``): each tensor
subclass reads as its inner tensors under ``<key>.<name>``, noted with its logical dtype, shape
and block size, in every command; ``convert --dequantize`` writes what torchao's own
``dequantize()`` gives. The frozen ``manifest.json`` is what torchao's load gave; the live tests
run the installed torchao."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import ckpttool
from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

HERE = FIXTURES / "torchao"
MANIFEST = json.loads((HERE / "manifest.json").read_text())
FILES = sorted(MANIFEST["files"])


def _entry(tensor: torch.Tensor) -> dict[str, Any]:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _stored(name: str) -> dict[str, dict[str, Any]]:
    """The manifest's tensors as ckpttool names them: a subclass by its inner tensors."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in MANIFEST["files"][name]["state_dict"].items():
        if "inner" in value:
            out.update({f"{key}.{inner}": v for inner, v in value["inner"].items()})
        else:
            out[key] = value
    return out


def _dequantized(name: str) -> dict[str, dict[str, Any]]:
    return {
        key: value["dequantize"] if "inner" in value else value
        for key, value in MANIFEST["files"][name]["state_dict"].items()
    }


def test_the_manifest_is_what_torchao_saves() -> None:
    assert MANIFEST["torchao"] == "0.18.0"
    int8 = MANIFEST["files"]["int8_weight_only.pt"]["state_dict"]["0.weight"]
    assert int8["class"] == "torchao.quantization.Int8Tensor"
    assert list(int8["inner"]) == ["qdata", "scale", "zero_point"]
    fp8 = MANIFEST["files"]["float8_weight_only.pt"]["state_dict"]["0.weight"]
    assert fp8["inner"]["qdata"]["dtype"] == "float8_e4m3fn"
    assert all(path.stat().st_size < 100_000 for path in HERE.glob("*.pt"))


@pytest.mark.parametrize("name", FILES)
def test_load_state_dict_gives_the_inner_tensors(name: str) -> None:
    loaded = ckpttool.load_state_dict(HERE / name)
    assert {k: _entry(v) for k, v in loaded.items()} == _stored(name)
    assert list(loaded) == list(_stored(name))


@pytest.mark.parametrize("name", FILES)
def test_show_names_the_quantization(name: str) -> None:
    result = CliRunner().invoke(cli, ["show", str(HERE / name), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    tensors = {t["key"]: t for t in report["tensors"]}
    expected = _stored(name)
    assert {k: {"dtype": t["dtype"], "shape": t["shape"]} for k, t in tensors.items()} == {
        k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in expected.items()
    }
    for key, value in MANIFEST["files"][name]["state_dict"].items():
        if "inner" not in value:
            assert not tensors[key].get("notes")
            continue
        cls = value["class"].rpartition(".")[2]
        for inner in value["inner"]:
            assert tensors[f"{key}.{inner}"]["notes"] == [
                f"{inner} of {key}: torchao {cls}, {value['dtype']} {value['shape']}, "
                f"block_size {value['block_size']}"
            ]
    # the subclass is read, not an opaque object
    assert not any("torchao.quantization.Int8Tensor" in w for w in report["warnings"])
    assert not any("meta" in w for w in report["warnings"])


@pytest.mark.parametrize("name", FILES)
def test_convert_keeps_the_inner_tensors_and_the_facts(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(HERE / name), str(out)])
    assert result.exit_code == 0, result.output
    written = load_file(out)
    assert {k: _entry(v) for k, v in written.items()} == _stored(name)
    with safe_open(out, "pt") as handle:
        metadata = handle.metadata()
    state = MANIFEST["files"][name]["state_dict"]
    for key, value in state.items():
        if "inner" not in value:
            assert f"ckpttool.field.{key}.__tensor_subclass__" not in metadata
            continue
        assert json.loads(metadata[f"ckpttool.field.{key}.__tensor_subclass__"]) == {
            "class": value["class"],
            "dtype": value["dtype"],
            "shape": value["shape"],
            "block_size": value["block_size"],
            "inner": list(value["inner"]),
        }


@pytest.mark.parametrize("name", FILES)
def test_convert_dequantize_writes_what_torchao_dequantizes(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(HERE / name), str(out), "--dequantize"])
    assert result.exit_code == 0, result.output
    assert "dequantized 2 tensor subclass(es)" in result.output
    written = load_file(out)
    assert {k: _entry(v) for k, v in written.items()} == _dequantized(name)
    with safe_open(out, "pt") as handle:
        assert not any(k.endswith(".__tensor_subclass__") for k in handle.metadata())


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_convert_dequantize_to_either_output(suffix: str, tmp_path: Path) -> None:
    out = tmp_path / f"out{suffix}"
    args = ["convert", str(HERE / "int8_weight_only.pt"), str(out), "--dequantize"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    loaded = ckpttool.load_state_dict(out)
    assert {k: _entry(v) for k, v in loaded.items()} == _dequantized("int8_weight_only.pt")


def test_diff_compares_the_inner_tensors() -> None:
    a, b = HERE / "int8_weight_only.pt", HERE / "int8_dynamic_int8_weight.pt"
    same = CliRunner().invoke(cli, ["diff", str(a), str(a), "--json"])
    assert same.exit_code == 0, same.output
    result = CliRunner().invoke(cli, ["diff", str(a), str(b), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    keys = {row["key"] for row in report["tensors"]}
    assert "0.weight.qdata" in keys and "0.weight.scale" in keys


# ---- live: the installed torchao, the round trip CI checks -------------------------------


def _torchao_state_dict(path: Path) -> dict[str, Any]:
    import torchao  # noqa: F401

    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("name", FILES)
def test_live_torchao_load_matches(name: str) -> None:
    reference = _torchao_state_dict(HERE / name)
    loaded = ckpttool.load_state_dict(HERE / name)
    expected: dict[str, torch.Tensor] = {}
    for key, value in reference.items():
        if type(value) is torch.Tensor:
            expected[key] = value
        else:
            names, _ = value.__tensor_flatten__()
            expected.update({f"{key}.{n}": getattr(value, n) for n in names})
    assert list(loaded) == list(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype
        assert torch.equal(loaded[key].view(torch.uint8), tensor.view(torch.uint8)), key


@pytest.mark.parametrize("name", FILES)
def test_live_dequantize_matches_torchao(name: str, tmp_path: Path) -> None:
    reference = _torchao_state_dict(HERE / name)
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(HERE / name), str(out), "--dequantize"])
    assert result.exit_code == 0, result.output
    written = load_file(out)
    for key, value in reference.items():
        ours = written[key]
        theirs = value if type(value) is torch.Tensor else value.dequantize()
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert torch.equal(ours, theirs), key


def test_live_a_fresh_quantization_round_trips(tmp_path: Path) -> None:
    """A model quantized here and now (not the frozen files): the installed torchao's format."""
    _torchao_state_dict(HERE / FILES[0])
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    model = model.to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    path = tmp_path / "quantized.pt"
    torch.save(model.state_dict(), path)
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--dequantize"])
    assert result.exit_code == 0, result.output
    written = load_file(out)
    for key, value in model.state_dict().items():
        theirs = value.dequantize() if hasattr(value, "qdata") else value
        torch.testing.assert_close(written[key], theirs)
    loaded = ckpttool.load_state_dict(path)
    assert torch.equal(loaded["0.weight.qdata"], model[0].weight.qdata)
    assert torch.equal(loaded["1.weight.scale"], model[1].weight.scale)


def test_edit_refuses_to_write_a_subclass_back(tmp_path: Path) -> None:
    """edit rewrites the pickle: a tensor subclass would come back broken (torchao's
    ``Int8Tensor.__new__`` needs its arguments), so it is refused in one line, nothing written."""
    out = tmp_path / "edited.pt"
    args = ["edit", str(HERE / "int8_weight_only.pt"), "--drop", "2.bias", "-o", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "torchao.quantization.Int8Tensor (a tensor subclass" in result.stderr
    assert "Traceback" not in result.output
    assert not out.exists()
