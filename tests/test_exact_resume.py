"""Proof that save_checkpoint / load_checkpoint / resume_training / SkipBatchSampler resume exactly.

tests/workers/resume_worker.py trains a small model (dropout, fp16 autocast + GradScaler whose
scale backs off and grows, AdamW, warmup+cosine LambdaLR, shuffled data, 3 epochs of 8 batches)
once without interruption. Then the same run is SIGKILLed after a step that follows a save, and
a new process resumes from the resume file. The result must equal the uninterrupted run bit for bit:
every model and optimizer tensor, the scaler and scheduler state, and the sequence of batches
trained (the killed run's log up to its checkpoint, then the resumed run's log), each sample
exactly once per epoch.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool import load_checkpoint
from tests.support.timeouts import scaled
from tests.workers import resume_worker as worker

pytestmark = pytest.mark.slow

WORKER = Path(worker.__file__)  # run as a script; imported here only for its constants
N_SAMPLES, EPOCHS, ITERS, WEIGHT, HIDDEN = (
    worker.N_SAMPLES,
    worker.EPOCHS,
    worker.ITERS,
    worker.WEIGHT,
    worker.HIDDEN,
)
TIMEOUT_S = scaled(600)  # a hang's bound (tests/support/timeouts.py), not a speed limit


@dataclass(frozen=True)
class Run:
    log: list[dict[str, Any]]
    final: dict[str, Any]


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def worker_args(directory: Path, name: str) -> list[str]:
    return [
        sys.executable,
        str(WORKER),
        "--save-dir",
        str(directory / "checkpoints"),
        "--log",
        str(directory / f"{name}.jsonl"),
        "--final",
        str(directory / f"{name}_final.pt"),
    ]


def finished_run(directory: Path, name: str) -> Run:
    final = torch.load(directory / f"{name}_final.pt", weights_only=True)
    return Run(read_log(directory / f"{name}.jsonl"), final)


def run_to_end(directory: Path, name: str, *extra: str) -> Run:
    subprocess.run(worker_args(directory, name) + list(extra), check=True, timeout=TIMEOUT_S)
    return finished_run(directory, name)


class Background:
    """The uninterrupted run, started at once and collected when first needed (2 CPUs: the
    killed run trains meanwhile)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.process = subprocess.Popen(worker_args(directory, "full"))
        self.run: Run | None = None

    def result(self) -> Run:
        if self.run is None:
            assert self.process.wait(timeout=TIMEOUT_S) == 0
            self.run = finished_run(self.directory, "full")
            check_premises(self.run)
        return self.run


def run_and_kill(directory: Path, name: str, pause_after: str) -> list[dict[str, Any]]:
    """Start a run, wait until it reports the pause step after a save, SIGKILL it."""
    args = [*worker_args(directory, name), "--pause-after", pause_after]
    child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT_S, child.kill)
    watchdog.start()
    try:
        assert child.stdout is not None
        saves = 0
        for line in child.stdout:  # the child blocks after PAUSED, so stop reading there
            saves += line.startswith("saved")
            if line == "PAUSED\n":
                break
        else:
            pytest.fail("worker ended without pausing")
        assert saves >= 1, "worker paused before its first save"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    return read_log(directory / f"{name}.jsonl")


def assert_same(expected: Any, actual: Any, where: str = "") -> None:
    """Recursive equality; tensors must have the same dtype and be ``torch.equal``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert expected.dtype == actual.dtype, f"{where}: dtype {expected.dtype} != {actual.dtype}"
        assert torch.equal(expected, actual), f"{where}: tensors differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert list(expected) == list(actual), f"{where}: keys {list(expected)} != {list(actual)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert type(expected) is type(actual) and len(expected) == len(actual), where
        for position, (left, right) in enumerate(zip(expected, actual, strict=True)):
            assert_same(left, right, f"{where}[{position}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def check_premises(run: Run) -> None:
    """What makes the comparison meaningful: a full run, and a scaler that backed off (skipped
    steps), so a scaler not restored changes the weights, not just the scale."""
    assert [(r["epoch"], r["step"]) for r in run.log] == [
        (e, s) for e in range(EPOCHS) for s in range(1, ITERS + 1)
    ]
    scales = [record["scale"] for record in run.log]
    assert any(later < earlier for earlier, later in itertools.pairwise(scales))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    background = Background(tmp_path_factory.mktemp("uninterrupted"))
    yield background
    if background.process.poll() is None:
        background.process.kill()
        background.process.wait()


@pytest.mark.parametrize(
    ("pause_after", "expected_checkpoint"),
    [
        # Saves come at steps 3, 6 and 8 of each epoch: killed after step 5, it resumes from 3.
        pytest.param("1:5", (1, 3), id="mid-epoch"),
        # MiniMind saves at step == iters; the loop resumes with an empty epoch 0, then epoch 1.
        pytest.param(f"0:{ITERS}", (0, ITERS), id="epoch-boundary"),
    ],
)
def test_killed_run_resumes_exactly(
    tmp_path: Path,
    uninterrupted: Background,
    pause_after: str,
    expected_checkpoint: tuple[int, int],
) -> None:
    killed_log = run_and_kill(tmp_path, "killed", pause_after)
    ckpt = load_checkpoint(tmp_path / "checkpoints", WEIGHT, HIDDEN)
    assert ckpt is not None
    checkpoint_at = (ckpt["epoch"], ckpt["step"])
    assert checkpoint_at == expected_checkpoint
    # It was killed right after the pause step; work after its last save (if any) is lost.
    last_trained = (killed_log[-1]["epoch"], killed_log[-1]["step"])
    assert last_trained == tuple(map(int, pause_after.split(":")))

    resumed = run_to_end(tmp_path, "resumed", "--resume")

    expected = uninterrupted.result()
    kept = [r for r in killed_log if (r["epoch"], r["step"]) <= checkpoint_at]
    trained = kept + resumed.log
    assert [r["indices"] for r in trained] == [r["indices"] for r in expected.log]
    for epoch in range(EPOCHS):
        samples = [i for r in trained if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(samples) == list(range(N_SAMPLES)), f"epoch {epoch}: repeated or skipped"
    for part in ("model", "optimizer", "scaler", "scheduler"):
        assert_same(expected.final[part], resumed.final[part], part)
    # Same loss and scale at every step: dropout masks, LR and skipped steps all matched.
    for want, got in zip(expected.log, trained, strict=True):
        assert got == want, f"first difference at epoch {want['epoch']} step {want['step']}"
