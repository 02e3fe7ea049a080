"""torchtune's checkpoints (0.6's ``epoch_N/`` and the flat 0.2-0.3 files) read by role.

The fixture follows torchtune's checkpointer source (tests/fixtures/frameworks/write_sharded.py;
torchtune is not installed); manifest.json froze what its loaders (``load_file``,
``torch.load(weights_only=True)``) read of each file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.model.records import tensors
from tests.test_framework_reading import FRAMEWORKS, MANIFEST, described

ROOT = FRAMEWORKS / "torchtune"
VIEW: dict[str, Any] = MANIFEST["cases"]["torchtune"]["framework"]


def _model(ckpt: Any) -> dict[str, Any]:
    return described(ckpt, tensors(ckpt.root["model"]))


def test_an_epoch_directory_opens_by_role() -> None:
    with open_checkpoint(ROOT / "output/epoch_0") as ckpt:
        assert ckpt.details["layout"] == "torchtune"
        assert ckpt.details["torchtune"]["epoch"] == 0
        assert _model(ckpt) == VIEW["output/epoch_0"]["model"]
        adapter = described(ckpt, tensors(ckpt.root["adapter"]))
    assert adapter == VIEW["output/epoch_0"]["adapter"]


def test_the_flat_layout_opens_its_latest_epoch_with_the_recipe_state() -> None:
    with open_checkpoint(ROOT / "flat") as ckpt:
        assert ckpt.details["layout"] == "torchtune"
        assert _model(ckpt) == VIEW["flat"]["model"]
        recipe = VIEW["flat"]["recipe_state"]
        assert sorted(ckpt.root["recipe_state"]) == recipe["keys"]
        assert ckpt.root["recipe_state"]["epochs_run"] == recipe["epochs_run"] == 1


def test_show_gives_the_epoch_and_the_recipe_state() -> None:
    result = CliRunner().invoke(cli, ["show", str(ROOT / "output/epoch_0")])
    assert result.exit_code == 0, result.output
    assert "layout:     torchtune checkpoint" in result.stdout
    assert (
        "counters:   epoch 0, epochs_run 1, total_epochs 2, seed 0 (epoch_N/ (0.4+))"
        in result.stdout
    )  # the run directory's recipe_state/recipe_state.pt, read (tests/test_run_directories.py)
    assert "resume:     ../recipe_state/recipe_state.pt" in result.stdout
    assert "adapter_model.pt                     2.0 KB  weights -> adapter" in result.stdout
    flat = CliRunner().invoke(cli, ["show", str(ROOT / "flat")])
    assert (
        "counters:   epoch 0, epochs_run 1, total_epochs 2, max_steps_per_epoch None, seed 0"
        in flat.stdout
    )


def test_verify_a_missing_shard(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(ROOT / "output/epoch_0", tmp_path / "epoch_0"))
    (copy / "model-00001-of-00001.safetensors").rename(copy / "model-00002-of-00002.safetensors")
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1
    assert "incomplete: model-00001-of-00002.* is missing" in result.stdout


def test_a_shard_the_index_lists_and_the_directory_lacks_is_missing(tmp_path: Path) -> None:
    """Issue 49: with its only shard gone, no shard name tells the count; the index does (verify
    said OK, show exit 0)."""
    copy = Path(shutil.copytree(ROOT / "output/epoch_0", tmp_path / "epoch_0"))
    (copy / "model-00001-of-00001.safetensors").unlink()
    missing = "model-00001-of-00001.safetensors (listed in model.safetensors.index.json)"
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1
    assert f"incomplete: {missing} is missing" in result.stdout
    shown = CliRunner().invoke(cli, ["show", str(copy)])
    assert shown.exit_code == 1
    assert f"missing:    {missing}" in shown.stdout


def test_verify_a_recipe_state_of_another_epoch(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(ROOT / "flat", tmp_path / "flat"))
    (copy / "hf_model_0001_0.pt").rename(copy / "hf_model_0001_1.pt")
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1
    assert "epochs_run 1, but the weights are epoch 1's" in result.stdout
    assert CliRunner().invoke(cli, ["verify", str(ROOT / "flat")]).exit_code == 0


def test_convert_writes_the_model(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(ROOT / "output/epoch_0"), str(out)])
    assert result.exit_code == 0, result.output
    with open_checkpoint(out) as ckpt:
        assert described(ckpt, tensors(ckpt.root)) == VIEW["output/epoch_0"]["model"]


def test_rescale_is_refused_saying_why() -> None:
    result = CliRunner().invoke(cli, ["rescale-step", str(ROOT / "flat"), "--world-size", "2"])
    assert result.exit_code == 2
    assert "torchtune resumes at an epoch boundary" in result.stderr


def test_diff_of_the_two_layouts_compares_the_model() -> None:
    result = CliRunner().invoke(cli, ["diff", str(ROOT / "output/epoch_0"), str(ROOT / "flat")])
    assert result.exit_code == 1  # the adapter in PEFT's names and the recipe state: one side
    assert "5 identical, 0 differ within tolerance, 0 differ" in result.stdout, result.output
