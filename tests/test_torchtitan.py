"""torchtitan's ``step-N/`` directory read as one checkpoint, each part by its role.

The fixture follows torchtitan 0.3.0's layout rules (tests/fixtures/frameworks/write_sharded.py;
torchtitan is not installed) and was written by ``torch.distributed.checkpoint.save``;
manifest.json froze what DCP's own loader reads of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.model.records import tensors
from tests.test_framework_reading import FRAMEWORKS, MANIFEST, described

DIRECTORY = FRAMEWORKS / "torchtitan/checkpoint/step-3"
VIEW: dict[str, Any] = MANIFEST["cases"]["torchtitan"]["framework"]
PARTS = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def test_it_opens_with_the_model_gathered_and_each_part_by_role() -> None:
    with open_checkpoint(DIRECTORY) as ckpt:
        assert ckpt.details["layout"] == "torchtitan"
        assert sorted(ckpt.root) == sorted(["model", *PARTS])
        assert set(VIEW["top_level_keys"]) == set(PARTS) | set(VIEW["model"])
        model = {
            k.removeprefix("model."): v
            for k, v in described(ckpt, tensors(ckpt.root["model"])).items()
        }
        assert ckpt.root["train_state"] == VIEW["train_state"]
        assert ckpt.root["lr_scheduler"] == VIEW["lr_scheduler"]
        assert ckpt.root["dataloader"]["world_size"] == VIEW["dataloader"]["world_size"]
    assert model == VIEW["model"]


def test_show_names_the_counters_and_parts() -> None:
    result = CliRunner().invoke(cli, ["show", str(DIRECTORY)])
    assert result.exit_code == 0, result.output
    assert (
        "counters:   step 3, ntokens_seen 24, lr_scheduler.last_epoch 3, dataloader world_size 1"
        in result.stdout
    )
    assert (
        "parts:      model (weights), optimizer (optimizer), lr_scheduler (scheduler)"
        in result.stdout
    )


def test_verify_a_complete_one() -> None:
    result = CliRunner().invoke(cli, ["verify", str(DIRECTORY)])
    assert result.exit_code == 0, result.output
    assert "torchtitan: a complete DCP directory" in result.stdout


def test_verify_a_step_directory_that_does_not_match_its_train_state(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(DIRECTORY, tmp_path / "step-4"))
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1
    assert "train_state.step is 3 but the directory is step-4" in result.stdout


def test_verify_a_missing_data_file(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(DIRECTORY, tmp_path / "step-3"))
    (copy / "__0_0.distcp").unlink()
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1
    assert "data file __0_0.distcp is missing" in result.stdout
    assert "torchtitan: a complete DCP directory" in result.stdout


def test_a_dcp_directory_under_another_name_stays_plain_dcp(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(DIRECTORY, tmp_path / "latest"))
    with open_checkpoint(copy) as ckpt:
        assert ckpt.format == "dcp"


def test_convert_writes_the_model_under_torchtitans_names(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(DIRECTORY), str(out)])
    assert result.exit_code == 0, result.output
    with open_checkpoint(out) as ckpt:
        assert described(ckpt, tensors(ckpt.root)) == VIEW["model"]


def test_rescale_is_refused_saying_why() -> None:
    result = CliRunner().invoke(cli, ["rescale-step", str(DIRECTORY), "--world-size", "2"])
    assert result.exit_code == 2
    assert "count optimizer steps of the global batch" in result.stderr
    assert "exclude_from_loading=['dataloader']" in result.stderr


def test_diff_compares_two_of_them(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(DIRECTORY, tmp_path / "step-3"))
    result = CliRunner().invoke(cli, ["diff", str(DIRECTORY), str(copy), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["summary"]["identical"] == 12
    assert report["a"]["layout"] == report["b"]["layout"] == "torchtitan"
