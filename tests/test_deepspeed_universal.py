"""rescale-step on DeepSpeed ZeRO checkpoints: the universal checkpoint, without DeepSpeed.

On every ZeRO-1/2/3 fixture case ckpttool's universal output must equal what DeepSpeed's own
``ds_to_universal`` writes (run here, in-process), file for file and tensor for tensor; the
counters must move by MiniMind's rule (global_steps x saved // new, the scheduler by the same
amount, global_samples kept) and the written tree must appear all at once or not at all.
tests/test_deepspeed_resume.py shows DeepSpeed resuming from it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.rescale.directory import rescale_directory
from ckpttool.errors import OutputExistsError
from ckpttool.frameworks.deepspeed.schedule import scheduled_lr
from tests.test_json_schemas import assert_valid

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
ZERO_CASES = [name for name, case in MANIFEST["cases"].items() if case["stage"] in (1, 2, 3)]
TAG = "global_step4"


def tag_dir(case: str, tag: str = TAG) -> Path:
    return FIXTURES / case / "checkpoints" / tag


def ds_to_universal(source: Path, output: Path) -> Path:
    from deepspeed.checkpoint.ds_to_universal import main

    args = argparse.Namespace(
        input_folder=str(source), output_folder=str(output), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        main(args)
    return output


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def assert_same(a: Any, b: Any, where: str) -> None:
    """Equal values, tensors bit for bit; DeepSpeed's objects by class and attributes."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif type(a).__module__.startswith("deepspeed") and hasattr(a, "__dict__"):
        assert type(a) is type(b) and vars(a) == vars(b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("case", ZERO_CASES)
def test_universal_equals_ds_to_universal(case: str, tmp_path: Path) -> None:
    reference = ds_to_universal(tag_dir(case), tmp_path / "ref" / f"{TAG}_universal")
    world = 1 if MANIFEST["cases"][case]["processes"] == 2 else 2
    report = rescale_directory(
        tag_dir(case), world, output=tmp_path / "ours", keep_global_batch=True
    )
    assert report.written and not report.changes
    ours = tmp_path / "ours" / f"{TAG}_universal"
    assert (tmp_path / "ours" / "latest_universal").read_text() == ours.name
    assert files_under(ours) == files_under(reference)
    for name in files_under(reference):
        want, got = load(reference / name), load(ours / name)
        if name == "zero/optimizer_state.pt" and MANIFEST["cases"][case]["stage"] == 3:
            # ds_to_universal keeps rank 0's own partitions there; no loader reads them
            del want["fp32_flat_groups"]
            for state in want["optimizer_state_dict"]["state"].values():
                del state["exp_avg"], state["exp_avg_sq"]
        assert_same(want, got, name)
    for model_file in tag_dir(case).glob("*_model_states.pt"):  # copied byte for byte
        assert (ours / model_file.name).read_bytes() == model_file.read_bytes()


def test_rescale_probes_the_directory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rescale is opened from what detection found, not probed again."""
    from ckpttool.frameworks.deepspeed import files

    scans: list[str] = []
    original = files._scan

    def counted(path: str) -> Any:
        scans.append(path)
        return original(path)

    monkeypatch.setattr(files, "_scan", counted)
    rescale_directory(tag_dir("stage2_bf16_2proc"), 1, output=tmp_path / "out", dry_run=True)
    assert scans == [str(tag_dir("stage2_bf16_2proc"))]


@pytest.mark.parametrize(("case", "world"), [("stage2_bf16_2proc", 1), ("stage3_fp32_1proc", 2)])
def test_counters_rescaled_by_minimind_rule(case: str, world: int, tmp_path: Path) -> None:
    saved = MANIFEST["cases"][case]["processes"]
    report = rescale_directory(tag_dir(case), world, output=tmp_path / "out")
    new_steps = 4 * saved // world
    assert (report.plan.old_step, report.plan.new_step, report.plan.exact) == (4, new_steps, True)
    tag = tmp_path / "out" / f"{TAG}_universal"
    for model_file in tag_dir(case).glob("*_model_states.pt"):
        before, after = load(model_file), load(tag / model_file.name)
        assert after["global_steps"] == new_steps
        assert after["global_samples"] == before["global_samples"] == 4 * 2 * saved
        assert after["lr_scheduler"] == {"last_batch_iteration": new_steps - 1}
        rest = {k: v for k, v in after.items() if k not in ("global_steps", "lr_scheduler")}
        assert_same({k: v for k, v in before.items() if k in rest}, rest, model_file.name)
    optimizer_state = load(tag / "zero" / "optimizer_state.pt")
    lr = scheduled_lr(load(next(tag_dir(case).glob("*_model_states.pt")))["ds_config"],
                      new_steps - 1)  # fmt: skip
    assert lr == 2.0**-6 * min(1.0, (new_steps - 1) / 4)  # linear warmup over 4 steps
    assert [group["lr"] for group in optimizer_state["param_groups"]] == [lr]


def test_scheduled_lr_is_deepspeeds_warmup() -> None:
    from deepspeed.runtime.lr_schedules import WarmupDecayLR, WarmupLR

    for kind, extra in ((WarmupLR, {}), (WarmupDecayLR, {"total_num_steps": 20})):
        for warmup_type in ("log", "linear"):
            params = {"warmup_min_lr": 2.0**-10, "warmup_max_lr": 0.01, "warmup_num_steps": 7,
                      "warmup_type": warmup_type, **extra}  # fmt: skip
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            schedule = kind(optimizer, **params)
            config = {"scheduler": {"type": kind.__name__, "params": params}}
            for iteration in range(15):
                schedule.step()
                assert scheduled_lr(config, iteration) == optimizer.param_groups[0]["lr"]
    assert scheduled_lr({"scheduler": {"type": "OneCycle", "params": {}}}, 3) is None


def test_output_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "out"
    report = rescale_directory(tag_dir("stage1_fp32_2proc"), 1, output=target, dry_run=True)
    assert not report.written and not target.exists()
    target.mkdir()
    with pytest.raises(OutputExistsError):
        rescale_directory(tag_dir("stage1_fp32_2proc"), 1, output=target)
    assert list(target.iterdir()) == []
    damaged = FIXTURES / "damaged" / "optim_truncated" / "checkpoints"
    result = CliRunner().invoke(cli, ["rescale-step", str(damaged), "--world-size", "1",
                                      "-o", str(tmp_path / "new")])  # fmt: skip
    assert result.exit_code == 2 and "optim_states.pt: corrupt or truncated" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temp directory left behind
    report = rescale_directory(tag_dir("stage1_fp32_2proc"), 1, output=target, overwrite=True)
    assert report.written and (target / "latest_universal").is_file()


def test_stage0_and_in_place_are_refused(tmp_path: Path) -> None:
    runner = CliRunner()
    stage0 = FIXTURES / "stage0_fp32_2proc" / "checkpoints"
    result = runner.invoke(cli, ["rescale-step", str(stage0), "--world-size", "1"])
    assert result.exit_code == 2 and "ZeRO stage 0" in result.stderr
    result = runner.invoke(cli, ["rescale-step", str(tag_dir("stage2_fp32_2proc")),
                                 "--world-size", "1", "--in-place"])  # fmt: skip
    assert result.exit_code == 2 and "--in-place does not apply" in result.stderr


def test_cli_json_reports_the_changes(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["rescale-step", str(tag_dir("stage2_fp32_2proc")),
                                      "--world-size", "1", "-o", str(tmp_path / "out"),
                                      "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert_valid("rescale-step", data)
    assert data["layout"] == "deepspeed" and data["written"]
    assert (data["from"], data["to"]) == (
        {"step": 4, "world_size": 2},
        {"step": 8, "world_size": 1},
    )
    assert {(c["key"], c["old"], c["new"]) for c in data["changes"]} == {
        ("global_steps", 4, 8),
        ("lr_scheduler.last_batch_iteration", 3, 7),
        ("param_groups[*].lr", 3 / 4 * 2.0**-6, 2.0**-6),  # lr(3) -> lr(7)
    }
