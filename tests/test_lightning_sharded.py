"""Lightning's sharded checkpoint (a DCP directory plus ``meta.pt``) read as one checkpoint.

The fixture was written by Lightning's own ``FSDPStrategy.save_checkpoint`` (see
tests/fixtures/frameworks/write_sharded.py); manifest.json froze what Lightning's consolidation
(``_load_distributed_checkpoint`` + ``_format_checkpoint``) and ``load_state_dict`` see in it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.model.records import tensors
from tests.test_framework_reading import FRAMEWORKS, MANIFEST, described

NAME = "lightning_sharded/checkpoints/epoch=2-step=4"
DIRECTORY = FRAMEWORKS / NAME
VIEW: dict[str, Any] = MANIFEST["cases"]["lightning_sharded"]["framework"][NAME]


def _copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DIRECTORY, tmp_path / DIRECTORY.name))


def test_it_opens_as_the_dict_lightnings_consolidation_makes() -> None:
    with open_checkpoint(DIRECTORY) as ckpt:
        assert ckpt.details["layout"] == "lightning_sharded"
        assert sorted(ckpt.root) == sorted(VIEW["top_level_keys"])
        assert ckpt.root["global_step"] == VIEW["global_step"] == 4
        assert ckpt.root["epoch"] == VIEW["epoch"]
        model = described(ckpt, tensors(ckpt.root["model"]))
    assert model == VIEW["model"]["tensors"]


def test_show_gives_its_counters_and_parts() -> None:
    result = CliRunner().invoke(cli, ["show", str(DIRECTORY)])
    assert result.exit_code == 0, result.output
    assert "Lightning sharded checkpoint (DCP + meta.pt)" in result.stdout
    assert "counters:   global_step 4, epoch 2 (meta.pt)" in result.stdout
    assert "DCP tree:   model, optimizer_0" in result.stdout
    shown = json.loads(CliRunner().invoke(cli, ["show", str(DIRECTORY), "--json"]).stdout)
    assert shown["layout"] == "lightning_sharded"


def test_verify_checks_the_dcp_files_and_meta_pt() -> None:
    result = CliRunner().invoke(cli, ["verify", str(DIRECTORY)])
    assert result.exit_code == 0, result.output
    assert "1 member file verified one by one" in result.stdout  # meta.pt; DCP by its index


@pytest.mark.parametrize(
    ("remove", "problem"),
    [
        ("__0_0.distcp", "data file __0_0.distcp is missing"),
        (".metadata", "incomplete: .metadata (torch.distributed.checkpoint writes it after"),
    ],
)
def test_verify_knows_its_completeness(tmp_path: Path, remove: str, problem: str) -> None:
    copy = _copy(tmp_path)
    (copy / remove).unlink()
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1, result.output
    assert problem in result.stdout
    assert "Lightning sharded: meta.pt beside a complete DCP directory" in result.stdout


def test_scan_walks_meta_pt_too() -> None:
    result = CliRunner().invoke(cli, ["scan", str(DIRECTORY), "--json"])
    assert result.exit_code == 0, result.output
    scanned = {Path(entry["path"]).name for entry in json.loads(result.stdout)["files"]}
    assert scanned == {DIRECTORY.name, "meta.pt"}


def test_convert_writes_the_model_lightning_loads(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(DIRECTORY), str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "lightning_sharded"
    with open_checkpoint(out) as ckpt:
        assert described(ckpt, tensors(ckpt.root)) == VIEW["model"]["tensors"]


def test_rescale_is_refused_unless_global_step_is_named(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["rescale-step", str(DIRECTORY), "--world-size", "2"])
    assert result.exit_code == 2
    assert "its global_step counts optimizer steps" in result.stderr
    assert "--step-key global_step" in result.stderr
    wrong = ["rescale-step", str(DIRECTORY), "--world-size", "2", "--step-key", "epoch"]
    result = CliRunner().invoke(cli, wrong)
    assert result.exit_code == 2
    assert "--step-key takes global_step here" in result.stderr


def test_rescale_of_global_step_rewrites_meta_pt_only(tmp_path: Path) -> None:
    import torch

    out = tmp_path / "rescaled"
    command = ["rescale-step", str(DIRECTORY), "--world-size", "2", "--step-key", "global_step"]
    result = CliRunner().invoke(cli, [*command, "--from-world-size", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    meta = torch.load(out / "meta.pt", weights_only=False)
    assert meta["global_step"] == 8  # 4 optimizer steps x 4 ranks / 2
    assert meta["world_size"] == 2
    assert meta["rescaled_from"] == [{"global_step": 4, "world_size": 4}]
    before = torch.load(DIRECTORY / "meta.pt", weights_only=False)
    added = {"world_size", "rescaled_from"}
    assert meta.keys() - added == before.keys()
    assert all(meta[key] == before[key] for key in ("epoch", "hyper_parameters", "loops"))
    for name in (".metadata", "__0_0.distcp"):
        assert (out / name).read_bytes() == (DIRECTORY / name).read_bytes()
    with open_checkpoint(out) as ckpt:
        assert ckpt.root["global_step"] == 8


def test_rescale_counts_the_ranks_that_wrote_dcp_files(tmp_path: Path) -> None:
    out = tmp_path / "rescaled"
    command = ["rescale-step", str(DIRECTORY), "--world-size", "2", "--step-key", "global_step"]
    result = CliRunner().invoke(cli, [*command, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["from"] == {"step": 4, "world_size": 1}
    assert report["to"] == {"step": 2, "world_size": 2}


def test_step_key_is_refused_on_a_layout_without_one(tmp_path: Path) -> None:
    state = FRAMEWORKS / "accelerate_2proc/state"
    command = ["rescale-step", str(state), "--world-size", "1", "--step-key", "step", "--dry-run"]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 2
    assert "--step-key applies to one checkpoint file" in result.stderr


def test_diff_compares_two_of_them(tmp_path: Path) -> None:
    out = tmp_path / "rescaled"
    command = ["rescale-step", str(DIRECTORY), "--world-size", "2", "--step-key", "global_step"]
    assert CliRunner().invoke(cli, [*command, "-o", str(out)]).exit_code == 0
    result = CliRunner().invoke(cli, ["diff", str(DIRECTORY), str(out)])
    assert result.exit_code == 1, result.output  # the counters differ
    assert "global_step: 4 -> 2" in result.stdout
    assert "30 identical, 0 differ within tolerance, 0 differ" in result.stdout
