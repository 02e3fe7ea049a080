"""A saved LR scheduler moves with ``step`` when a run changes its number of processes: in the
file (``rescale-step``) and in memory (``load_checkpoint``), with real torch schedulers written
by a real ``save_checkpoint``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LRScheduler,
    MultiStepLR,
    OneCycleLR,
    StepLR,
)

import ckpttool.train
from ckpttool import load_checkpoint, resume_training, save_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.rescale.run import rescale_fields, rescale_step
from ckpttool.model.lr_schedule import rescale_scheduler
from tests.test_json_schemas import assert_valid

#: Steps the saved run had taken (per rank), in a schedule of LENGTH steps on that many ranks.
DONE, LENGTH = 24, 48

Build = Callable[[torch.optim.Optimizer, int], LRScheduler]
SCHEDULERS: dict[str, Build] = {
    # the lambda is code, not in the file: written in the run's own steps (MiniMind's way)
    "LambdaLR": lambda opt, length: LambdaLR(opt, lambda k: 1 - k / length),
    "CosineAnnealingLR": lambda opt, length: CosineAnnealingLR(opt, T_max=length),
    "OneCycleLR": lambda opt, length: OneCycleLR(opt, max_lr=1.0, total_steps=length),
    "StepLR": lambda opt, length: StepLR(opt, step_size=length // 4, gamma=0.5),
}


def training(kind: str, length: int, steps: int) -> tuple[torch.nn.Module, Any, LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = SCHEDULERS[kind](optimizer, length)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def save_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, saved: int) -> Path:
    """The saved run: ``saved`` ranks, DONE steps of a LENGTH-step schedule, step == DONE."""
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: saved)
    model, optimizer, scheduler = training(kind, LENGTH, DONE)
    _, resume = save_checkpoint(model, optimizer, save_dir=tmp_path, weight="p", hidden_size=2,
                                epoch=0, step=DONE, scheduler=scheduler)  # fmt: skip
    return resume


def resumed(tmp_path: Path, kind: str, new: int) -> tuple[Any, LRScheduler]:
    """The resumed run on ``new`` ranks: its schedule is as long in samples, so its own number
    of steps is LENGTH x saved // new; returns the checkpoint and its scheduler, loaded."""
    ckpt = load_checkpoint(tmp_path, "p", 2)
    assert ckpt is not None
    saved = ckpt.get("rescaled_from", [{"world_size": new}])[-1]["world_size"]
    model, optimizer, scheduler = training(kind, LENGTH * saved // new, 0)
    resume_training(ckpt, model, optimizer, scheduler=scheduler, restore_rng=False)
    return ckpt, scheduler


def assert_continues_like_a_native_run(scheduler: LRScheduler, kind: str, steps: int, length: int):
    """``scheduler`` stands where a run that took ``steps`` of a ``length`` schedule stands, and
    its next step gives the same rate."""
    _, native_optimizer, native = training(kind, length, steps)
    assert scheduler.last_epoch == native.last_epoch == steps
    assert scheduler._step_count == native._step_count  # type: ignore[attr-defined]
    if kind != "OneCycleLR":
        # a function of last_epoch / length: the saved rate is the new position's rate too.
        # OneCycleLR's phases end at pct x length - 1, not quite proportional: its first resumed
        # step keeps the saved rate (optimizer and _last_lr), the next ones follow the schedule
        assert scheduler.get_last_lr() == pytest.approx(native.get_last_lr(), rel=1e-9)
    scheduler.optimizer.step()
    scheduler.step()
    native_optimizer.step()
    native.step()
    assert scheduler.get_last_lr() == pytest.approx(native.get_last_lr(), rel=1e-9)


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize(("saved", "new"), [(1, 2), (8, 2)])
def test_rescale_step_moves_a_saved_scheduler_with_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, saved: int, new: int
) -> None:
    path = save_run(tmp_path, monkeypatch, kind, saved)
    report = rescale_step(path, new)
    assert report.plan.new_step == DONE * saved // new
    moved = {key: (old, new_value) for key, old, new_value in report.plan.scheduler_changes}
    assert moved["last_epoch"] == (DONE, DONE * saved // new)
    assert moved["_step_count"] == (DONE + 1, DONE * saved // new + 1)
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: new)
    ckpt, scheduler = resumed(tmp_path, kind, new)
    assert ckpt["step"] == DONE * saved // new
    assert_continues_like_a_native_run(scheduler, kind, DONE * saved // new, LENGTH * saved // new)


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize(("saved", "new"), [(1, 2), (8, 2)])
def test_load_checkpoint_moves_the_scheduler_in_memory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    saved: int,
    new: int,
) -> None:
    save_run(tmp_path, monkeypatch, kind, saved)
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: new)
    with caplog.at_level(logging.INFO, logger="ckpttool"):
        ckpt = load_checkpoint(tmp_path, "p", 2)
    assert ckpt is not None and ckpt["scheduler"]["last_epoch"] == DONE * saved // new
    messages = [r.getMessage() for r in caplog.records]
    assert (
        f"world_size changed {saved} -> {new}: scheduler last_epoch {DONE} -> {DONE * saved // new}"
        f", _step_count {DONE + 1} -> {DONE * saved // new + 1}" in messages[1]
    )
    model, optimizer, scheduler = training(kind, LENGTH * saved // new, 0)
    resume_training(ckpt, model, optimizer, scheduler=scheduler, restore_rng=False)
    assert_continues_like_a_native_run(scheduler, kind, DONE * saved // new, LENGTH * saved // new)


def test_report_text_and_json_name_every_scheduler_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_run(tmp_path, monkeypatch, "CosineAnnealingLR", 1)
    result = CliRunner().invoke(cli, ["rescale-step", str(path), "--world-size", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert (
        "scheduler: last_epoch 24 -> 12, _step_count 25 -> 13, T_max 48 -> 24 (it counts "
        "optimizer steps: scaled like step)"
    ) in result.stdout.splitlines()
    result = CliRunner().invoke(
        cli, ["rescale-step", str(path), "--world-size", "2", "--dry-run", "--json"]
    )
    assert_valid("rescale-step", json.loads(result.stdout))
    assert json.loads(result.stdout)["scheduler"] == {
        "changes": [
            {"key": "last_epoch", "old": 24, "new": 12},
            {"key": "_step_count", "old": 25, "new": 13},
            {"key": "T_max", "old": 48, "new": 24},
        ],
        "note": None,
    }


def test_a_scheduler_that_cannot_be_moved_is_left_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 1)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = MultiStepLR(optimizer, milestones=[10, 20])
    for _ in range(DONE):
        optimizer.step()
        scheduler.step()
    save_checkpoint(model, optimizer, save_dir=tmp_path, weight="p", hidden_size=2,
                    epoch=0, step=DONE, scheduler=scheduler)  # fmt: skip
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        ckpt = load_checkpoint(tmp_path, "p", 2)
    assert ckpt is not None and ckpt["step"] == 12 and ckpt["scheduler"]["last_epoch"] == DONE
    assert [r.getMessage() for r in caplog.records] == [
        "world_size changed 1 -> 2: scheduler not moved: the scheduler is a MultiStepLR (its "
        f"milestones), which cannot be moved by a factor: left at last_epoch {DONE}; rebuild it "
        "for the new number of processes"
    ]
    path = tmp_path / "p_2_resume.pth"
    result = CliRunner().invoke(cli, ["rescale-step", str(path), "--world-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert_valid("rescale-step", report)
    assert report["to"]["step"] == 12 and report["scheduler"]["changes"] == []
    assert "MultiStepLR" in report["scheduler"]["note"]
    assert torch.load(path, weights_only=True)["scheduler"]["last_epoch"] == DONE


def test_rescale_fields_moves_the_scheduler_by_the_plan() -> None:
    state = {"T_max": 100, "base_lrs": [0.1], "last_epoch": 60, "_step_count": 61}
    new, plan = rescale_fields({"step": 30, "world_size": 2, "scheduler": state}, 3)
    assert new["scheduler"] == {"T_max": 66, "base_lrs": [0.1], "last_epoch": 40, "_step_count": 41}
    assert plan.scheduler_changes == (("last_epoch", 60, 40), ("_step_count", 61, 41),
                                      ("T_max", 100, 66))  # fmt: skip
    assert state["last_epoch"] == 60  # the input is not changed


def test_one_cycle_phase_ends_follow_total_steps() -> None:
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1, momentum=0.9)
    for three_phase in (False, True):
        saved = OneCycleLR(optimizer, 1.0, total_steps=80, three_phase=three_phase).state_dict()
        native = OneCycleLR(optimizer, 1.0, total_steps=20, three_phase=three_phase).state_dict()
        moved = rescale_scheduler(saved, 1, 4).state
        assert moved is not None and moved["total_steps"] == 20
        for ours, theirs in zip(moved["_schedule_phases"], native["_schedule_phases"]):
            assert type(ours["end_step"]) is type(theirs["end_step"])
            assert math.isclose(ours["end_step"], theirs["end_step"], rel_tol=1e-12)
