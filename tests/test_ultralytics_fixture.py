"""ultralytics checkpoints (``tests/fixtures/ultralytics/``, written by ultralytics 8.4.190's own
``BaseTrainer.save_model`` and ``strip_optimizer``: ``tools/ultralytics_fixture.py``): each
pickled ``DetectionModel`` reads as the ``state_dict()`` ultralytics' own loader gives, frozen in
``manifest.json`` (names in order, dtypes, shapes, sha256 of the bytes), in every command."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckpttool
from ckpttool.cli import cli
from ckpttool.commands.edit import edit_file
from tests.support.helpers import FIXTURES

HERE = FIXTURES / "ultralytics"
MANIFEST = json.loads((HERE / "manifest.json").read_text())
#: (file, the part holding the module): last.pt keeps the model as its EMA (``model`` is None),
#: best.pt as ``model`` (strip_optimizer put the EMA there and emptied ``ema``).
PARTS = [("last.pt", "ema"), ("best.pt", "model")]


def _expected(name: str, part: str) -> list[dict[str, Any]]:
    reference = MANIFEST["files"][name]["modules"][part]["state_dict"]
    return MANIFEST["state_dicts"][reference]


def _entry(key: str, tensor: torch.Tensor) -> dict[str, Any]:
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return {
        "key": key,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_the_manifest_is_what_ultralytics_saves() -> None:
    last = MANIFEST["files"]["last.pt"]
    assert {"epoch", "best_fitness", "model", "ema", "optimizer", "train_args"} <= set(last["keys"])
    module = last["modules"]["ema"]
    assert module["class"] == "ultralytics.nn.tasks.DetectionModel"
    assert len(_expected("last.pt", "ema")) == 355  # what state_dict() holds
    assert "stride" in module["attribute_tensors"]  # and what it leaves out
    assert "model.22.anchors" in module["attribute_tensors"]


@pytest.mark.parametrize(("name", "part"), PARTS)
def test_open_reads_each_module_as_ultralytics_state_dict(name: str, part: str) -> None:
    prefix = f"{part}."
    with ckpttool.open(HERE / name) as handle:
        mine = [
            _entry(key[len(prefix) :], handle.get_tensor(key))
            for key in handle
            if key.startswith(prefix)
        ]
        attributes = MANIFEST["files"][name]["modules"][part]["attribute_tensors"]
        assert not {prefix + key for key in attributes} & set(handle)
    assert mine == _expected(name, part)


@pytest.mark.parametrize(("name", "part"), PARTS)
def test_show_names_the_module_and_its_part(name: str, part: str) -> None:
    result = CliRunner().invoke(cli, ["show", "--json", str(HERE / name)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["layout"] == "training_checkpoint" and report["model_part"] == part
    assert report["details"]["module_classes"] == {part: "ultralytics.nn.tasks.DetectionModel"}
    keys = [t["key"] for t in report["tensors"] if t["key"].startswith(f"{part}.")]
    assert keys == [f"{part}.{e['key']}" for e in _expected(name, part)]
    assert not any(
        "._modules." in t["key"] or "._parameters." in t["key"] for t in report["tensors"]
    )


@pytest.mark.parametrize(("name", "part"), PARTS)
def test_load_state_dict_and_convert_give_the_state_dict(
    name: str, part: str, tmp_path: Path
) -> None:
    expected = _expected(name, part)
    loaded = ckpttool.load_state_dict(HERE / name, section=part)
    assert [_entry(key, t) for key, t in loaded.items()] == expected
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(HERE / name), str(out)])
    assert result.exit_code == 0, result.output
    written = load_file(out)
    assert sorted(_entry(key, t)["sha256"] for key, t in written.items()) == sorted(
        e["sha256"] for e in expected
    )
    assert sorted(written) == sorted(e["key"] for e in expected)


def test_diff_of_the_stripped_model_and_the_training_ema_is_identical() -> None:
    result = CliRunner().invoke(cli, ["diff", str(HERE / "best.pt"), str(HERE / "last.pt")])
    # the weights are the same, but the stripped file's optimizer is None where last.pt holds
    # SGD's momentum: exit 0 would say every field was compared equal (issue 49)
    assert result.exit_code == 1, result.output
    assert (
        "355 identical, 0 differ within tolerance, 0 differ, 0 only in A, 183 only in B"
        in result.output
    )
    weights = CliRunner().invoke(
        cli,
        ["diff", str(HERE / "best.pt"), str(HERE / "last.pt"), "--section-a", "model",
         "--section-b", "ema"],
    )  # fmt: skip
    assert weights.exit_code == 0, weights.output
    assert "355 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B" in (
        weights.output
    )


@pytest.mark.parametrize("name", ["last.pt", "best.pt"])
def test_verify_finds_them_whole(name: str) -> None:
    result = CliRunner().invoke(cli, ["verify", str(HERE / name)])
    assert result.exit_code == 0, result.output
    assert "no tensor uses" not in result.output


def test_for_inference_drops_the_optimizer_and_keeps_the_module(tmp_path: Path) -> None:
    out = tmp_path / "last_inference.pt"
    report = edit_file(HERE / "last.pt", out, for_inference=True)
    assert report.dropped == ("optimizer", "scaler")
    assert report.tensors_after == 355
    with ckpttool.open(out) as handle:
        assert [_entry(key[4:], handle.get_tensor(key)) for key in handle] == _expected(
            "last.pt", "ema"
        )
    objects = CliRunner().invoke(
        cli, ["show", "--objects", "--section", "ema", "--depth", "1", str(out)]
    )
    assert objects.output.startswith("<ultralytics.nn.tasks.DetectionModel>")
    assert "stride: tensor float32[3]" in objects.output  # the attributes as they were
