"""torchao quantized state dicts (``tests/fixtures/torchao/``, written by torchao 0.18.0's
``quantize_`` then ``torch.save(model.state_dict())``, and by 0.13.0 for the
AffineQuantizedTensor / LinearActivationQuantizedTensor it no longer writes:
``tools/torchao_fixture.py``): each tensor subclass reads as its inner tensors under
``<key>.<name>``, noted with its logical dtype, shape and block size, in every command;
``convert --dequantize`` writes what torchao's own ``dequantize()`` gives. The frozen
``manifest.json`` is what torchao's load gave; the live tests run the installed torchao on the
files it wrote. The Int4 file (``Int4TilePackedTo4dTensor``) was written on a CUDA GPU
(``tools/torchao_int4_fixture.py``): its dequantized values in the manifest are torchao's tinygemm
linear on the identity (no Int4 tensor of torchao 0.18 has a ``dequantize()``), held to bit
for bit here without a GPU."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import ckpttool
from ckpttool.cli import cli
from ckpttool.errors import InputError
from ckpttool.io.subclass_values import subclass_scheme
from ckpttool.model.records import OpaqueObject, StorageRecord, TensorRecord, TensorSubclassObject
from tests.support.helpers import FIXTURES

HERE = FIXTURES / "torchao"
MANIFEST = json.loads((HERE / "manifest.json").read_text())
FILES = sorted(MANIFEST["files"])
#: The files the installed torchao (the test extra's) wrote: the live tests load them with it.
CURRENT = [name for name in FILES if MANIFEST["files"][name]["torchao"] == "0.18.0"]
#: Those whose subclasses have a ``dequantize()`` to compare with here (not the Int4 one).
DEQUANTIZABLE = [name for name in CURRENT if "dequantize_by" not in MANIFEST["files"][name]]
INT4 = "int4_tile_packed.pt"


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


def _subclasses(name: str) -> dict[str, dict[str, Any]]:
    state = MANIFEST["files"][name]["state_dict"]
    return {key: value for key, value in state.items() if "inner" in value}


def test_the_manifest_is_what_torchao_saves() -> None:
    files = MANIFEST["files"]
    int8 = files["int8_weight_only.pt"]["state_dict"]["0.weight"]
    assert int8["class"] == "torchao.quantization.Int8Tensor"
    assert list(int8["inner"]) == ["qdata", "scale", "zero_point"]
    fp8 = files["float8_weight_only.pt"]["state_dict"]["0.weight"]
    assert fp8["inner"]["qdata"]["dtype"] == "float8_e4m3fn"
    aqt = files["aqt_int8_weight_only.pt"]["state_dict"]["0.weight"]
    assert aqt["class"] == "torchao.dtypes.affine_quantized_tensor.AffineQuantizedTensor"
    assert list(aqt["inner"]) == [
        "tensor_impl.int_data",
        "tensor_impl.scale",
        "tensor_impl.zero_point",
    ]
    dynamic = files["aqt_int8_dynamic_int8_weight.pt"]["state_dict"]["0.weight"]
    assert dynamic["class"].endswith(".LinearActivationQuantizedTensor")
    assert "original_weight_tensor.tensor_impl.int_data" in dynamic["inner"]
    assert {files[name]["torchao"] for name in FILES} == {"0.18.0", "0.13.0"}
    assert CURRENT and all(path.stat().st_size < 100_000 for path in HERE.glob("*.pt"))


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
    for value in _subclasses(name).values():
        assert not any(value["class"] in w for w in report["warnings"])
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
    assert f"dequantized {len(_subclasses(name))} tensor subclass(es)" in result.output
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
    import torchao  # noqa: F401 (the test extra's: an ImportError is a failure, not a skip)

    return torch.load(path, weights_only=False)


def _inner(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for name in value.__tensor_flatten__()[0]:
        inner = getattr(value, name)
        if type(inner) is torch.Tensor:
            out[prefix + name] = inner
        else:
            out.update(_inner(inner, f"{prefix}{name}."))
    return out


@pytest.mark.parametrize("name", CURRENT)
def test_live_torchao_load_matches(name: str) -> None:
    reference = _torchao_state_dict(HERE / name)
    loaded = ckpttool.load_state_dict(HERE / name)
    expected: dict[str, torch.Tensor] = {}
    for key, value in reference.items():
        if type(value) is torch.Tensor:
            expected[key] = value
        else:
            expected.update({f"{key}.{n}": t for n, t in _inner(value).items()})
    assert list(loaded) == list(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype
        assert torch.equal(loaded[key].view(torch.uint8), tensor.view(torch.uint8)), key


@pytest.mark.parametrize("name", DEQUANTIZABLE)
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
    _torchao_state_dict(HERE / CURRENT[0])
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


def _record(dtype: str, shape: tuple[int, ...]) -> TensorRecord:
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    storage = StorageRecord("0", dtype, math.prod(shape), "cpu", "archive/data/0", 0)
    return TensorRecord("", dtype, shape, stride, 0, storage)


def test_dequantize_refuses_what_it_cannot_decode_in_one_line() -> None:
    packed = TensorSubclassObject(
        "torchao.Packed", {"packed_weight": _record("int32", (4, 2))}, "bfloat16", (4, 16)
    )
    with pytest.raises(InputError, match="not the quantized data and scale"):
        subclass_scheme(packed)
    domain = OpaqueObject("torchao.quantization.quant_primitives.ZeroPointDomain", (2,))
    state = {"qdata": _record("int8", (4, 16)), "scale": _record("float32", (4, 1))}
    floating = TensorSubclassObject(
        "torchao.X", {**state, "zero_point_domain": domain}, "float32", (4, 16)
    )
    with pytest.raises(InputError, match=r"ZeroPointDomain\.FLOAT"):
        subclass_scheme(floating)
    untiled = TensorSubclassObject("torchao.X", {**state, "block_size": [1, 5]}, "float32", (4, 16))
    with pytest.raises(InputError, match="does not tile"):
        subclass_scheme(untiled)
    # no block_size: the scale's shape says one scale per row
    scheme = subclass_scheme(TensorSubclassObject("torchao.X", state, "float32", (4, 16)))
    assert (scheme.data, scheme.scale, scheme.zero_point, scheme.block_size) == (
        "qdata", "scale", None, (1, 16)
    )  # fmt: skip


def test_read_without_torchao(tmp_path: Path) -> None:
    """Nothing named in the file is imported: with torchao unimportable, every file reads and
    dequantizes the same (the frozen manifest's values)."""
    script = (
        "import sys, json, hashlib\n"
        "sys.modules['torchao'] = None\n"
        "import ckpttool\n"
        "from ckpttool.cli import main\n"
        f"here = {str(HERE)!r}\n"
        "out = {}\n"
        f"for name in {FILES!r}:\n"
        "    sd = ckpttool.load_state_dict(f'{here}/{name}')\n"
        "    out[name] = sorted(sd)\n"
        "print(json.dumps(out))\n"
        "assert not any(m.startswith('torchao.') for m in sys.modules), 'torchao imported'\n"
    )
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    keys = json.loads(result.stdout)
    assert keys == {name: sorted(_stored(name)) for name in FILES}


def test_the_note_names_the_quantization_range() -> None:
    impl = TensorSubclassObject(
        "torchao.dtypes.uintx.plain_layout.PlainAQTTensorImpl",
        {"int_data": _record("int8", (4, 16)), "scale": _record("float32", (4,))},
        "int8",
        (4, 16),
    )
    outer = TensorSubclassObject(
        "torchao.dtypes.affine_quantized_tensor.AffineQuantizedTensor",
        {"tensor_impl": impl, "block_size": (1, 16), "quant_min": -8, "quant_max": 7},
        "bfloat16",
        (4, 16),
    )
    assert outer.describe() == (
        "torchao AffineQuantizedTensor, bfloat16 [4, 16], block_size [1, 16], quant range [-8, 7]"
    )
    assert subclass_scheme(outer).data == "tensor_impl.int_data"


def test_the_int4_file_is_torchao_s_tile_packed_layout() -> None:
    entry = MANIFEST["files"][INT4]
    assert (entry["config"], entry["packing_format"], entry["saved_from"]) == (
        "Int4WeightOnlyConfig", "tile_packed_to_4d", "cpu"
    )  # fmt: skip
    weight = entry["state_dict"]["0.weight"]
    assert weight["class"] == "torchao.quantization.Int4TilePackedTo4dTensor"
    assert (weight["inner"]["qdata"]["shape"], weight["inner"]["scale_and_zero"]["shape"]) == (
        [4, 8, 32, 4], [32, 32, 2]
    )  # fmt: skip
    assert INT4 in CURRENT and INT4 in FILES and INT4 not in DEQUANTIZABLE


def test_the_int4_tile_layout_is_the_one_torch_packs() -> None:
    """torch's ``_convert_weight_to_int4pack`` (CUDA, inner_k_tiles 8) on grids whose elements
    are the hex digits of their index: every nibble comes back where it was."""
    from ckpttool.io.subclass_values import tinygemm_int4

    probes = load_file(HERE / "int4_tile_probes.safetensors")
    index = torch.arange(8 * 1024, dtype=torch.int64).reshape(8, 1024)
    for digit in range(4):
        unpacked = tinygemm_int4(probes[f"digit{digit}"])
        assert torch.equal(unpacked, (index >> (4 * digit)) & 15), digit


def test_int4_dequantize_is_torchao_s_linear_bit_for_bit(tmp_path: Path) -> None:
    """The padded tiles (64 of 1024 columns used) cut to the logical shape, bfloat16 values
    equal to the tinygemm kernel's: float32 arithmetic gives them exactly, no tolerance."""
    out = tmp_path / "int4.pth"
    result = CliRunner().invoke(cli, ["convert", str(HERE / INT4), str(out), "--dequantize"])
    assert result.exit_code == 0, result.output
    written = torch.load(out, weights_only=True)
    assert written["0.weight"].dtype == torch.bfloat16 and written["0.weight"].shape == (32, 64)
    assert {k: _entry(v) for k, v in written.items()} == _dequantized(INT4)


def test_an_int4_tile_layout_ckpttool_does_not_read_is_refused() -> None:
    """Other inner_k_tiles (the last dimension) or a scale_and_zero that does not fit: one line."""
    tiles = {
        "qdata": _record("int32", (1, 8, 32, 2)),
        "scale_and_zero": _record("bfloat16", (32, 8, 2)),
    }
    other = TensorSubclassObject("torchao.X", tiles, "bfloat16", (8, 32))
    with pytest.raises(InputError, match="not the int4 tile layout ckpttool reads"):
        subclass_scheme(other)
    tiles["qdata"] = _record("int32", (1, 8, 32, 4))
    scheme = subclass_scheme(TensorSubclassObject("torchao.X", tiles, "bfloat16", (8, 32)))
    assert (scheme.data, scheme.scale, scheme.block_size) == ("qdata", "scale_and_zero", (1, 32))
    too_wide = TensorSubclassObject("torchao.X", tiles, "bfloat16", (8, 2048))
    with pytest.raises(InputError, match="not the int4 tile layout"):
        subclass_scheme(too_wide)


def test_a_packed_int4_tensor_is_refused_not_misread() -> None:
    """torchao's plain ``Int4Tensor`` (two 4-bit values per int8 of ``qdata``, written only with
    mslk's CUDA kernels): its bytes are not one value each, so no affine reading of them."""
    state = {
        "qdata": _record("int8", (8, 16)),
        "scale": _record("bfloat16", (1, 8)),
        "zero_point": _record("bfloat16", (1, 8)),
        "block_size": [1, 32],
    }
    plain = TensorSubclassObject("torchao.quantization.Int4Tensor", state, "bfloat16", (8, 32))
    with pytest.raises(InputError, match=r"packs \[8, 32\] \(several values per element\)"):
        subclass_scheme(plain)
