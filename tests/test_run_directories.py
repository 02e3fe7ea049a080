"""Run directories of torchtitan and torchtune (issue 28): several ``step-N/`` or ``epoch_N/``
listed as a collection, as a Trainer ``output_dir`` is, and followed by ``trend``; torchtune's
recipe state, kept outside ``epoch_N/`` since 0.4, read from the run directory or beside the
epoch it was saved with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.test_framework_reading import FRAMEWORKS

TITAN = FRAMEWORKS / "torchtitan/checkpoint"
TUNE = FRAMEWORKS / "torchtune/output"


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _json(*args: Any) -> dict[str, Any]:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    loaded: dict[str, Any] = json.loads(result.stdout)
    return loaded


# -- torchtune's recipe state ---------------------------------------------------------------


def test_an_epoch_folder_shows_the_recipe_state_of_its_run() -> None:
    result = run("show", TUNE / "epoch_0")
    assert result.exit_code == 0, result.output
    assert "counters:   epoch 0, epochs_run 1, total_epochs 2, seed 0 (epoch_N/ (0.4+))" in (
        result.stdout
    )
    assert "resume:     ../recipe_state/recipe_state.pt; optimizer state: present" in result.stdout


def test_the_run_directory_lists_its_epochs_and_reads_the_recipe_state() -> None:
    listing = _json("show", TUNE)
    assert listing["layout"] == "torchtune_run" and listing["counter"] == "epoch"
    assert [(c["name"], c["step"], c["complete"]) for c in listing["checkpoints"]] == [
        ("epoch_0", 0, True)
    ]
    assert listing["recipe_state"] == {
        "file": "recipe_state/recipe_state.pt", "epochs_run": 1, "total_epochs": 2, "seed": 0,
        "optimizer": True, "dataloader": True,
    }  # fmt: skip
    text = run("show", TUNE).stdout
    assert (
        "resume:     recipe_state/recipe_state.pt: epochs_run 1, total_epochs 2, seed 0; "
        "optimizer state: present"
    ) in text
    assert "epoch_0       0        yes" in text


def _tune_run(tmp_path: Path, epochs_run: int, *, beside: bool = False) -> Path:
    """The fixture's output_dir with a second epoch (its weights scaled) and a recipe state
    saved after ``epochs_run`` epochs (``recipe_state.pt`` beside the epochs with ``beside``,
    as before 0.6)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "output"
    shutil.copytree(TUNE / "epoch_0", out / "epoch_0")
    shutil.copytree(TUNE / "epoch_0", out / "epoch_1")
    shard = out / "epoch_1/model-00001-of-00001.safetensors"
    save_file({k: v * 2 for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    state = {"seed": 0, "epochs_run": epochs_run, "total_epochs": 3, "max_steps_per_epoch": None}
    target = out / ("recipe_state.pt" if beside else "recipe_state/recipe_state.pt")
    target.parent.mkdir(exist_ok=True)
    torch.save(state, target)
    return out


def test_the_recipe_state_belongs_to_the_latest_epoch(tmp_path: Path) -> None:
    out = _tune_run(tmp_path, 2)
    latest = run("show", out / "epoch_1")
    assert latest.exit_code == 0, latest.output
    assert "epoch 1, epochs_run 2, total_epochs 3, seed 0" in latest.stdout
    assert "optimizer state: absent" in latest.stdout
    earlier = run("show", out / "epoch_0")
    assert earlier.exit_code == 0, earlier.output  # not judged against another epoch's state
    assert "counters:   epoch 0 (epoch_N/ (0.4+))" in earlier.stdout
    assert "is the run's, saved with epoch_1: not this epoch's" in earlier.stdout


def test_a_recipe_state_beside_the_epochs_is_read_too(tmp_path: Path) -> None:
    out = _tune_run(tmp_path, 2, beside=True)
    assert "epochs_run 2" in run("show", out / "epoch_1").stdout
    assert _json("show", out)["recipe_state"]["file"] == "recipe_state.pt"


def test_a_recipe_state_that_does_not_follow_its_epoch_is_a_problem(tmp_path: Path) -> None:
    out = _tune_run(tmp_path, 1)
    result = run("verify", out / "epoch_1")
    assert result.exit_code == 1, result.output
    assert "recipe_state.pt says epochs_run 1, but the weights are epoch 1's" in result.stdout


def test_trend_follows_a_torchtune_run(tmp_path: Path) -> None:
    report = _json("trend", _tune_run(tmp_path, 2))
    assert [c["name"] for c in report["checkpoints"]] == ["epoch_0", "epoch_1"]
    updates = {t["key"]: t["relative_updates"] for t in report["tensors"]}
    assert updates["model.embed_tokens.weight"][1] == 1.0  # doubled: |2W - W| / |W|


# -- torchtitan's checkpoint folder ---------------------------------------------------------


def test_a_torchtitan_checkpoint_folder_is_listed(tmp_path: Path) -> None:
    listing = _json("show", TITAN)
    assert listing["layout"] == "torchtitan_run" and "counter" not in listing
    assert [(c["name"], c["step"], c["complete"]) for c in listing["checkpoints"]] == [
        ("step-3", 3, True)
    ]
    result = run("convert", TITAN, tmp_path / "x.safetensors")
    assert result.exit_code == 2, result.output
    assert "with 1 checkpoints (step-3 complete)" in result.stderr


def _titan_run(tmp_path: Path) -> Path:
    """The fixture's folder with a step-6 saved by torch's DCP: train_state.step 6, the model's
    weights doubled."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = tmp_path / "checkpoint"
    shutil.copytree(TITAN / "step-3", folder / "step-3")
    dcp_to_torch_save(TITAN / "step-3", tmp_path / "tree.pt")
    tree = torch.load(tmp_path / "tree.pt", weights_only=False)
    tree["train_state"] = {"step": 6, "ntokens_seen": 48}
    tree["lr_scheduler"] = {"last_epoch": 6}
    for key, value in list(tree.items()):
        if isinstance(value, torch.Tensor):
            tree[key] = value * 2
    dcp.save(tree, checkpoint_id=str(folder / "step-6"), no_dist=True)
    (folder / "step-9").mkdir()  # an interrupted save: nothing written yet
    return folder


def test_trend_follows_a_torchtitan_run_by_its_train_state(tmp_path: Path) -> None:
    folder = _titan_run(tmp_path)
    listing = _json("show", folder)
    assert [(c["name"], c["complete"]) for c in listing["checkpoints"]] == [
        ("step-3", True), ("step-6", True), ("step-9", False)
    ]  # fmt: skip
    shutil.rmtree(folder / "step-9")
    report = _json("trend", folder)
    assert report["order"] == "step"
    assert [(c["name"], c["step"]) for c in report["checkpoints"]] == [
        ("step-3", 3), ("step-6", 6)
    ]  # fmt: skip
    updates = {t["key"]: t["relative_updates"] for t in report["tensors"]}
    assert updates["output.weight"][1] == 1.0
