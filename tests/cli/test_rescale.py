"""`ckpttool rescale-step` through the CLI: the report is a contract, refusals are one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.support.helpers import copy_fixture, digest

RESUME = "minimind/pretrain_32_resume.pth"  # step 1200, world_size 8
FRAMEWORKS = Path(__file__).parents[1] / "fixtures" / "frameworks"


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_divisible_rescale_in_place(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    result = run("rescale-step", path, "--world-size", 2)
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "step 1200 @ world_size 8 -> step 4800 @ world_size 2\n"
        "exact: 1200 x 8 = 9600 global batches = 2 x 4800\n"
        "rescaled_from: 1200 @ world_size 8\n"
        f"wrote {path} (in place)\n"
    )
    assert result.stderr == ""
    loaded = torch.load(path, weights_only=True)
    assert (loaded["step"], loaded["world_size"]) == (4800, 2)


def test_non_divisible_rescale_reports_the_repeat(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    result = run("rescale-step", path, "--world-size", 7, "--batch-size", 16)  # 9600 = 7 x 1371 + 3
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "step 1200 @ world_size 8 -> step 1371 @ world_size 7",
        "not exact: 1200 x 8 = 9600 global batches were trained; the resumed run skips "
        "7 x 1371 = 9597 of them, so 3 global batches (3/7 of a batch per rank) will be "
        "trained twice: 48 samples at batch size 16, at most 7 on any rank",
        "rescaled_from: 1200 @ world_size 8",
        f"wrote {path} (in place)",
    ]


def test_strict_refuses_an_inexact_rescale(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    before = digest(path)
    result = run("rescale-step", path, "--world-size", 7, "--strict")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path}: 1200 x 8 = 9600 global batches is not a multiple of 7: 3 global batches "
        "(3/7 of a batch per rank) will be trained twice; refused (--strict)\n"
    )
    assert digest(path) == before
    assert run("rescale-step", path, "--world-size", 3, "--strict").exit_code == 0


def test_missing_world_size_needs_from_world_size(tmp_path: Path) -> None:
    path = copy_fixture("legacy/resume_bigkeys.pth", tmp_path)
    result = run("rescale-step", path, "--world-size", 2)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path}: the checkpoint has no world_size, so the number of GPUs its step was counted on "
        "is unknown: pass --from-world-size M (older MiniMind files do not record it)\n"
    )
    result = run("rescale-step", path, "--world-size", 2, "--from-world-size", 4)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:2] == [
        "step 1500 @ world_size 4 -> step 3000 @ world_size 2",
        "the file has no world_size; the step was taken as counted on 4",
    ]
    loaded = torch.load(path, weights_only=True)
    assert (loaded["step"], loaded["world_size"]) == (3000, 2)


def test_dry_run_leaves_the_file_byte_identical(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    before = digest(path)
    result = run("rescale-step", path, "--world-size", 2, "--dry-run")
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "dry run: nothing was written"
    assert digest(path) == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_backup_and_refusal_to_overwrite_it(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    before = digest(path)
    result = run("rescale-step", path, "--world-size", 2, "--backup")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == f"backup: {path}.bak"
    assert digest(Path(f"{path}.bak")) == before
    after = digest(path)
    result = run("rescale-step", path, "--world-size", 4, "--backup")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path}.bak already exists: move it away first (it is never overwritten)\n"
    )
    assert digest(path) == after and digest(Path(f"{path}.bak")) == before


def test_output_option(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    before = digest(path)
    out = tmp_path / "resume_2gpu.pth"
    result = run("rescale-step", path, "--world-size", 2, "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == f"wrote {out} (from {path})"
    assert digest(path) == before
    assert torch.load(out, weights_only=True)["step"] == 4800
    result = run("rescale-step", path, "--world-size", 4, "-o", out)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {out} already exists (pass --force to replace it)\n"
    assert run("rescale-step", path, "--world-size", 4, "-o", out, "--force").exit_code == 0
    assert torch.load(out, weights_only=True)["step"] == 2400


def test_json_report(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    result = run("rescale-step", path, "--world-size", 7, "--batch-size", 4, "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "path": str(path),
        "output": str(path),
        "format": "torch-zip",
        "layout": "minimind_resume",
        "step_key": "step",
        "from": {"step": 1200, "world_size": 8},
        "to": {"step": 1371, "world_size": 7},
        "file_world_size": 8,
        "changed": True,
        "exact": False,
        "global_batches": 9600,
        "repeated_batches": 3,
        "repeated_batches_per_rank": "3/7",
        "batch_size": 4,
        "repeated_samples": 12,
        "max_repeated_samples_per_rank": 2,
        "rescaled_from": [{"step": 1200, "world_size": 8}],
        "scheduler": None,
        "dry_run": False,
        "written": True,
        "backup": None,
    }


def test_history_is_visible_in_show(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    assert run("rescale-step", path, "--world-size", 2).exit_code == 0
    result = run("rescale-step", path, "--world-size", 3)
    assert result.stdout.splitlines()[2] == (
        "rescaled_from: 1200 @ world_size 8, 4800 @ world_size 2"
    )
    shown = run("show", path).stdout.splitlines()
    assert "step:       3200" in shown and "world_size: 3" in shown
    assert "rescaled_from: step 1200, world_size 8; step 4800, world_size 2" in shown
    fields = json.loads(run("show", path, "--json").stdout)["fields"]
    assert fields["rescaled_from.1.step"] == 4800


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "minimind/pretrain_32.pth",
            "a plain state dict, not a resume checkpoint (those have model, optimizer, epoch and "
            "step); nothing to rescale. To rescale another top-level field that counts batches "
            "per rank, name it with --step-key KEY",
        ),
        (
            "safetensors/model.safetensors",
            "a safetensors file holds weights only; there is no training step to rescale",
        ),
        (
            "lightning/epoch=1-step=40.ckpt",
            "a Lightning checkpoint; its global_step counts optimizer steps, not dataloader "
            "batches per rank, so rescaling it is not the right repair by default. If you know "
            "it should scale with the number of GPUs, name it: --step-key global_step",
        ),
    ],
)
def test_non_resume_files_are_refused(name: str, message: str, tmp_path: Path) -> None:
    path = copy_fixture(name, tmp_path)
    before = digest(path)
    result = run("rescale-step", path, "--world-size", 2)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {path}: {message}\n"
    assert result.stdout == ""
    assert digest(path) == before


def test_lightning_with_step_key(tmp_path: Path) -> None:
    path = copy_fixture("lightning/epoch=1-step=40.ckpt", tmp_path)
    result = run(
        "rescale-step", path, "--world-size", 2, "--from-world-size", 4,
        "--step-key", "global_step",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == (
        "global_step 40 @ world_size 4 -> global_step 80 @ world_size 2"
    )
    assert torch.load(path, weights_only=False)["global_step"] == 80


def test_nothing_to_do(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    before = digest(path)
    result = run("rescale-step", path, "--world-size", 8)
    assert result.exit_code == 0
    assert result.stdout == (
        "step 1200 @ world_size 8 -> step 1200 @ world_size 8\n"
        "nothing to do: the file already matches; nothing was written\n"
    )
    assert digest(path) == before


def test_usage_errors(tmp_path: Path) -> None:
    path = copy_fixture(RESUME, tmp_path)
    result = run("rescale-step", path)
    assert result.exit_code == 2 and "Missing option '--world-size'" in result.stderr
    result = run("rescale-step", path, "--world-size", 0)
    assert result.exit_code == 2 and "0 is not in the range x>=1" in result.stderr
    result = run("rescale-step", path, "--world-size", 2, "-o", tmp_path, "--force")
    assert result.exit_code == 2
    assert result.stderr == f"Error: {tmp_path} is a directory; -o takes the output file's path\n"
    result = run("rescale-step", tmp_path / "missing.pth", "--world-size", 2)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {tmp_path / 'missing.pth'}: no such file\n"


def test_every_refusal_names_the_checkpoint(tmp_path: Path) -> None:
    """README's rule, for the refusals that come from the counters, not from reading a file."""
    trainer = tmp_path / "checkpoint-4"
    shutil.copytree(FRAMEWORKS / "trainer_1proc" / "output" / "checkpoint-4", trainer)
    result = run("rescale-step", trainer, "--world-size", 3, "--strict")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {trainer}: 4 x 1 = 4 is not a multiple of 3: 1 global batch (1/3 of a batch "
        "per rank) will be trained twice; refused (--strict)\n"
    )


def test_directory_report_says_one_process_in_the_singular() -> None:
    from tests.support.helpers import FIXTURES

    checkpoint = FIXTURES / "frameworks/trainer_2proc/output/checkpoint-4"
    result = run("rescale-step", checkpoint, "--world-size", 1, "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == (
        "hf_trainer: global_step 4 @ 2 processes -> global_step 8 @ 1 process"
    )
