"""nanoGPT's ``ckpt.pt`` (tests/fixtures/generate.py: ``_nanogpt``) and the small cases of
issue 40 item 7: a 0-d training scalar beside the model, ``iter_num`` as the step, and
``diff`` of meta tensors, which have no values to compare."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

import ckpttool
from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.show import build_report
from ckpttool.commands.trend import trend
from tests.support.helpers import FIXTURES

EARLY = FIXTURES / "nanogpt/out_early/ckpt.pt"
LATE = FIXTURES / "nanogpt/out_late/ckpt.pt"


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def test_best_val_loss_is_training_state_not_a_tensor_row() -> None:
    with open_checkpoint(LATE) as ckpt:
        report = build_report(ckpt)
    keys = [info.record.key for info in report.tensors]
    assert "best_val_loss" not in keys
    assert report.fields["best_val_loss"] == 2.5
    assert report.fields["iter_num"] == 4
    assert list(report.fields)[:2] == ["iter_num", "best_val_loss"]  # the file's order
    model = torch.load(LATE, map_location="cpu", weights_only=True)["model"]
    assert [k for k in keys if k.startswith("model.")] == [f"model.{k}" for k in model]


def test_show_json_and_filter_still_reach_the_scalar() -> None:
    result = CliRunner().invoke(cli, ["show", str(EARLY), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fields"]["best_val_loss"] == 2.75
    assert "best_val_loss" not in [row["key"] for row in data["tensors"]]
    result = CliRunner().invoke(cli, ["show", str(EARLY), "--filter", "best_*", "--json"])
    assert [row["key"] for row in json.loads(result.stdout)["tensors"]] == ["best_val_loss"]


def test_a_state_dict_keeps_its_0d_tensors_as_tensors(tmp_path: Path) -> None:
    path = tmp_path / "sd.pt"
    torch.save({"weight": torch.ones(2), "temperature": torch.tensor(0.5)}, path)
    with open_checkpoint(path) as ckpt:
        keys = [info.record.key for info in build_report(ckpt).tensors]
    assert keys == ["weight", "temperature"]


def test_trend_orders_nanogpt_checkpoints_by_iter_num() -> None:
    report = trend([LATE, EARLY])  # given late first; their names carry no number
    assert report.order == "step"
    assert [point.step for point in report.checkpoints] == [2, 4]
    assert [Path(point.path) for point in report.checkpoints] == [EARLY, LATE]


def test_load_state_dict_is_the_model_part_byte_for_byte() -> None:
    ours = ckpttool.load_state_dict(LATE)
    theirs = torch.load(LATE, map_location="cpu", weights_only=True)["model"]
    assert list(ours) == list(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and ours[key].shape == tensor.shape
        assert _bytes(ours[key]) == _bytes(tensor), key


def _meta_file(path: Path, **extra: torch.Tensor) -> Path:
    torch.save({"w": torch.empty(3, device="meta"), "b": torch.zeros(2, 2), **extra}, path)
    return path


def test_diff_of_meta_tensors_compares_their_metadata(tmp_path: Path) -> None:
    path = _meta_file(tmp_path / "meta.pt", m=torch.empty(4, 4, device="meta"))
    result = CliRunner().invoke(cli, ["diff", str(path), str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {row["key"]: row["status"] for row in data["tensors"]} == {
        "w": "identical", "m": "identical", "b": "identical"
    }  # fmt: skip
    assert any("values not compared for 2 meta tensors" in note for note in data["notes"])


def test_diff_of_meta_against_data_or_another_shape_differs(tmp_path: Path) -> None:
    meta = _meta_file(tmp_path / "meta.pt")
    data = tmp_path / "data.pt"
    torch.save({"w": torch.zeros(3), "b": torch.zeros(2, 2)}, data)
    result = CliRunner().invoke(cli, ["diff", str(meta), str(data)])
    assert result.exit_code == 1, result.output
    assert "A is a meta tensor" in result.output
    other = tmp_path / "other.pt"
    torch.save({"w": torch.empty(3, device="meta", dtype=torch.float16), "b": torch.zeros(2, 2)},
               other)  # fmt: skip
    result = CliRunner().invoke(cli, ["diff", str(meta), str(other)])
    assert result.exit_code == 1, result.output
    assert "dtype float32 -> float16" in result.output
