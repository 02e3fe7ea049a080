"""ckpttool's training API under real torch.distributed: gloo on CPU, one process per rank.

Each rank is a process of tests/workers/dist_worker.py launched as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), all ranks in one process group so that
a "crash" is one SIGKILL of the whole group.

Sample accounting. The dataset has N_SAMPLES = 64 samples, a multiple of BATCH_SIZE x world size
for 1, 2 and 4 ranks, so DistributedSampler pads nothing and no batch is partial: the
uninterrupted run's per-epoch sample multiset is every sample exactly once (checked on a real
uninterrupted run). A killed run counts up to its checkpoint's (epoch, step): the batches it
trained after its last save are lost with it and trained again by the resumed run; the final
accounting is the killed run's batches up to the checkpoint, then the resumed run's.

* Same world size: that accounting equals the uninterrupted run's, per epoch as a multiset and
  per rank batch for batch, and the final weights and optimizer state are bit-identical.
* Another world size (4 -> 2, 2 -> 1, each through load_checkpoint's automatic rescale and
  through `ckpttool rescale-step`; and 1 -> 2, where the floor bites): the resumed run skips
  ``step * saved // current`` batches per rank. The samples the saved run had consumed in the
  checkpoint's epoch (``step * saved * B``) and those the resumed run skips differ by
  ``r * B``, ``r = (step * saved) % current`` global batches, ``0 <= r < current``: those
  samples are trained twice, none is missed. What is *not* kept is the order: DistributedSampler
  deals one seeded permutation of the epoch round-robin to the ranks, so a different number of
  ranks gives each rank different samples and the global batches a different size. The
  consumed samples are still a prefix of that permutation, which is why "none missed, r * B
  repeated" holds for DistributedSampler; the tests assert that, and that each resumed rank
  trains exactly what an uninterrupted run on the new world size would from the rescaled step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DistributedSampler

from ckpttool.cli import cli
from ckpttool.train import checkpoint_paths
from tests.support import timeouts
from tests.workers.dist_worker import (
    BATCH_SIZE,
    EPOCHS,
    HIDDEN,
    N_SAMPLES,
    SEED,
    WEIGHT,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "dist_worker.py"
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TIMEOUT_S = 900  # a hang's bound (tests/support/timeouts.py scales it), not a speed limit
#: Every killed run stops after epoch 1's step 5; it saved at step 3 (SAVE_INTERVAL).
PAUSE_AFTER = (1, 5)
CHECKPOINT_AT = (1, 3)
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

Record = dict[str, Any]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def clean_env() -> dict[str, str]:
    """The test's environment without any launcher variables it may itself run under."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _join_group(pgid: int) -> dict[str, Any]:
    """Popen arguments putting the child in process group ``pgid`` (0: a new one, its own)."""
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # Python 3.10


@contextlib.contextmanager
def launched(world_size: int, args: list[str]) -> Iterator[list[subprocess.Popen[str]]]:
    """Start ``world_size`` ranks of the worker in one process group; SIGKILL the group if it
    outlives ``TIMEOUT_S`` or the block."""
    port, ranks, pgid = free_port(), [], 0
    try:
        for rank in range(world_size):
            env = clean_env()
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            process = subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                **_join_group(pgid),
            )
            pgid = pgid or process.pid
            ranks.append(process)
        bound, expired = timeouts.scaled(TIMEOUT_S), threading.Event()

        def kill_hung_group() -> None:
            expired.set()
            kill_group(pgid)

        watchdog = threading.Timer(bound, kill_hung_group)
        watchdog.start()
        try:
            yield ranks
        finally:
            watchdog.cancel()
            if expired.is_set():
                pytest.fail(timeouts.expired(f"{world_size} ranks of {WORKER.name}", bound))
    finally:
        if any(process.poll() is None for process in ranks):
            kill_group(pgid)
        for process in ranks:
            process.wait()


def kill_group(pgid: int) -> None:
    assert pgid > 0, "never signal group 0: that is pytest's own"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def run_ranks(world_size: int, args: list[str]) -> list[str]:
    """Run every rank to the end; return each rank's stdout."""
    with launched(world_size, args) as ranks:
        outputs = [process.communicate()[0] for process in ranks]
    assert [process.returncode for process in ranks] == [0] * world_size, outputs
    return outputs


def run_and_kill(world_size: int, args: list[str]) -> None:
    """Run until every rank reports PAUSED, then SIGKILL the whole group at once."""
    with launched(world_size, args) as ranks:
        for rank, process in enumerate(ranks):
            assert process.stdout is not None
            before_pause = []
            for line in process.stdout:  # each rank blocks after PAUSED: stop reading there
                if line == "PAUSED\n":
                    break
                before_pause.append(line)
            else:
                pytest.fail(f"rank {rank} ended without pausing: {before_pause}")
            assert before_pause == [], f"rank {rank}"
        kill_group(ranks[0].pid)
    assert [process.returncode for process in ranks] == [-signal.SIGKILL] * world_size


def train_args(save_dir: Path, log_dir: Path, name: str, *extra: str) -> list[str]:
    return ["train", "--save-dir", str(save_dir), "--log-dir", str(log_dir), "--name", name, *extra]


def read_logs(log_dir: Path, name: str, world_size: int) -> list[list[Record]]:
    """Each rank's trained batches, in order."""
    paths = [log_dir / f"{name}_rank{rank}.jsonl" for rank in range(world_size)]
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]


def epoch_samples(logs: list[list[Record]], epoch: int) -> list[int]:
    return [
        i for log in logs for record in log if record["epoch"] == epoch for i in record["indices"]
    ]


def up_to(log: list[Record], at: tuple[int, int]) -> list[Record]:
    return [record for record in log if (record["epoch"], record["step"]) <= at]


def finals(log_dir: Path, name: str, world_size: int) -> list[dict[str, Any]]:
    return [
        torch.load(log_dir / f"{name}_final_rank{rank}.pt", weights_only=True)
        for rank in range(world_size)
    ]


def assert_equal_states(expected: Any, actual: Any, where: str = "") -> None:
    """Recursive equality; tensors must be ``torch.equal`` (bit-identical values)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(expected) == list(actual), where
        for key in expected:
            assert_equal_states(expected[key], actual[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(expected) == len(actual), where
        for position, (left, right) in enumerate(zip(expected, actual)):
            assert_equal_states(left, right, f"{where}[{position}]")
    else:
        assert expected == actual, where


def sampler_batches(world_size: int, rank: int, epoch: int) -> list[list[int]]:
    """The batches DistributedSampler deals ``rank`` in ``epoch``, computed here directly."""
    dataset: Any = range(N_SAMPLES)  # a Sized of indices is all DistributedSampler reads
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, seed=SEED
    )
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i : i + BATCH_SIZE] for i in range(0, len(order), BATCH_SIZE)]


# --- rank 0 writes, every rank waits -----------------------------------------------------------


def test_only_rank_zero_writes_and_no_rank_returns_before_the_files_are_complete(
    tmp_path: Path,
) -> None:
    """tests/workers/dist_worker.py probe_save: rank 0's torch.save is slowed for saves 1 and 2,
    the other ranks' for all saves (it only matters if they write); each rank loads both files
    right after save_checkpoint returns."""
    world_size = 4
    outputs = run_ranks(world_size, ["probe-save", "--save-dir", str(tmp_path)])
    reports = [json.loads(output) for output in outputs]
    assert [report["rank"] for report in reports] == list(range(world_size))
    # Two files per save, three saves, all by rank 0.
    assert [report["torch_save_calls"] for report in reports] == [6, 0, 0, 0]
    weights_path, resume_path = checkpoint_paths(tmp_path, WEIGHT, HIDDEN)
    for report in reports:
        # Complete and current on every rank as soon as save_checkpoint returned (no stale
        # step 1 at save 2), written by rank 0 (saved_by), with no rank's temp file left.
        assert report["observed"] == [
            {
                "files": sorted([weights_path.name, resume_path.name]),
                "step": step,
                "world_size": world_size,
                "saved_by": 0,
                "weights_keys": ["bias", "weight"],
                "model_keys": ["bias", "weight"],
            }
            for step in (1, 2, 3)
        ], f"rank {report['rank']}"


# --- SIGKILL and resume ------------------------------------------------------------------------


@dataclass(frozen=True)
class KilledRun:
    world_size: int
    save_dir: Path
    logs: list[list[Record]]


class KilledRuns:
    """One killed run per world size, made on first use and shared by the tests (read-only:
    each resume works on a copy of the checkpoint directory)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.runs: dict[int, KilledRun] = {}

    def get(self, world_size: int) -> KilledRun:
        if world_size not in self.runs:
            directory = self.factory.mktemp(f"killed_{world_size}")
            pause = "{}:{}".format(*PAUSE_AFTER)
            extra = ["--compile"] if world_size == 2 else []  # DDP(torch.compile(model))
            args = train_args(directory / "ckpt", directory, "killed", "--pause-after", pause)
            run_and_kill(world_size, [*args, *extra])
            logs = read_logs(directory, "killed", world_size)
            self.runs[world_size] = KilledRun(world_size, directory / "ckpt", logs)
        return self.runs[world_size]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> KilledRuns:
    return KilledRuns(tmp_path_factory)


def resumable_copy(killed: KilledRun, tmp_path: Path) -> Path:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(killed.save_dir, save_dir)
    return save_dir


def test_killed_group_resumes_exactly_on_the_same_world_size(
    tmp_path: Path, killed_runs: KilledRuns
) -> None:
    world_size = 2
    full_dir = tmp_path / "full"
    run_ranks(world_size, train_args(full_dir, tmp_path, "full", "--compile"))
    full = read_logs(tmp_path, "full", world_size)
    # The premise of the accounting: an uninterrupted epoch trains every sample exactly once.
    for epoch in range(EPOCHS):
        assert sorted(epoch_samples(full, epoch)) == list(range(N_SAMPLES))

    killed = killed_runs.get(world_size)
    save_dir = resumable_copy(killed, tmp_path)
    resume = torch.load(checkpoint_paths(save_dir, WEIGHT, HIDDEN)[1], weights_only=True)
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (*CHECKPOINT_AT, 2)
    # Saved through DDP(torch.compile(model)): no "module." or "_orig_mod." prefix.
    assert list(resume["model"]) == ["weight", "bias"]
    # It was killed two steps after that save: those are lost, and trained again below.
    assert [(r["epoch"], r["step"]) for r in killed.logs[0][-3:]] == [(1, 3), (1, 4), (1, 5)]

    outputs = run_ranks(
        world_size, train_args(save_dir, tmp_path, "resumed", "--resume", "--compile")
    )
    assert outputs == ["RESUMED {} {}\n".format(*CHECKPOINT_AT)] * world_size
    resumed = read_logs(tmp_path, "resumed", world_size)
    trained = [
        up_to(killed.logs[rank], CHECKPOINT_AT) + resumed[rank] for rank in range(world_size)
    ]
    for rank in range(world_size):
        assert trained[rank] == full[rank], f"rank {rank} trained other batches"
    for epoch in range(EPOCHS):
        assert Counter(epoch_samples(trained, epoch)) == Counter(epoch_samples(full, epoch))
    # Every rank loaded model and optimizer: all ranks end bit-identical to the full run.
    expected = finals(tmp_path, "full", world_size)
    for rank, final in enumerate(finals(tmp_path, "resumed", world_size)):
        assert_equal_states(expected[rank], final, f"rank {rank}")
        assert_equal_states(expected[0]["model"], final["model"], f"rank {rank} vs rank 0")


@pytest.mark.parametrize(
    ("saved_ws", "new_ws", "how"),
    [
        (4, 2, "load_checkpoint"),
        (4, 2, "rescale-step"),
        (2, 1, "load_checkpoint"),
        (2, 1, "rescale-step"),
        (1, 2, "load_checkpoint"),  # 3 x 1 = 3 global batches on 2 ranks: r = 1
    ],
)
def test_resume_on_another_world_size_keeps_the_number_of_samples(
    tmp_path: Path, killed_runs: KilledRuns, saved_ws: int, new_ws: int, how: str
) -> None:
    killed = killed_runs.get(saved_ws)
    save_dir = resumable_copy(killed, tmp_path)
    epoch, step = CHECKPOINT_AT
    new_step = step * saved_ws // new_ws
    if how == "rescale-step":
        resume_path = checkpoint_paths(save_dir, WEIGHT, HIDDEN)[1]
        result = CliRunner().invoke(
            cli, ["rescale-step", str(resume_path), "--world-size", str(new_ws)]
        )
        assert result.exit_code == 0, result.output
        plan = f"step {step} @ world_size {saved_ws} -> step {new_step} @ world_size {new_ws}"
        assert result.output.splitlines()[0] == plan

    outputs = run_ranks(new_ws, train_args(save_dir, tmp_path, "resumed", "--resume"))
    assert outputs == [f"RESUMED {epoch} {new_step}\n"] * new_ws
    resumed = read_logs(tmp_path, "resumed", new_ws)

    # The bound: the floor leaves r global batches (r * B samples) trained twice, r < new_ws.
    repeated_batches = (step * saved_ws) % new_ws
    assert 0 <= repeated_batches < new_ws
    consumed_before = epoch_samples([up_to(log, CHECKPOINT_AT) for log in killed.logs], epoch)
    trained_after = epoch_samples(resumed, epoch)
    assert len(consumed_before) == step * saved_ws * BATCH_SIZE
    skipped_by_resume = N_SAMPLES - len(trained_after)
    difference = len(consumed_before) - skipped_by_resume
    assert 0 <= difference == repeated_batches * BATCH_SIZE < new_ws * BATCH_SIZE
    # With DistributedSampler the consumed samples are a prefix of the epoch's permutation:
    # none is missed, exactly r * B are trained twice, at most ceil(r * B / new_ws) per rank.
    counts = Counter(consumed_before + trained_after)
    assert sorted(counts) == list(range(N_SAMPLES))
    assert sum(counts.values()) - N_SAMPLES == repeated_batches * BATCH_SIZE
    per_rank_bound = math.ceil(repeated_batches * BATCH_SIZE / new_ws)
    for log in resumed:
        again = set(epoch_samples([log], epoch)) & set(consumed_before)
        assert len(again) <= per_rank_bound
    # Not kept: the order. Each rank trains what an uninterrupted run on new_ws ranks would
    # from new_step on: other samples, in another order, than any rank did on saved_ws ranks.
    for rank, log in enumerate(resumed):
        expected = [
            (e, s, batch)
            for e in range(epoch, EPOCHS)
            for s, batch in enumerate(sampler_batches(new_ws, rank, e), start=1)
            if e > epoch or s > new_step
        ]
        assert [(r["epoch"], r["step"], r["indices"]) for r in log] == expected
    # Epochs before the checkpoint's (killed run) and after it (resumed run) are whole.
    for other in range(EPOCHS):
        if other != epoch:
            logs = killed.logs if other < epoch else resumed
            assert sorted(epoch_samples(logs, other)) == list(range(N_SAMPLES))
    models = [final["model"] for final in finals(tmp_path, "resumed", new_ws)]
    for model in models[1:]:
        assert_equal_states(models[0], model)


# --- the example -------------------------------------------------------------------------------


def run_example(launcher: list[str], save_dir: Path, *args: str) -> list[str]:
    """Run examples/train_ddp.py; its stdout lines with the loss values masked."""
    result = timeouts.run(
        [*launcher, str(EXAMPLE), "--save-dir", str(save_dir), *args],
        TIMEOUT_S,
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return [re.sub(r"loss \d+\.\d+", "loss X", line) for line in result.stdout.splitlines()]


def test_ddp_example_under_torchrun_then_alone(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    out = tmp_path / "checkpoints"  # MiniMind's layout: the resume files in checkpoints/
    resume_path = out / "pretrain_64_resume.pth"

    # Stopped 2 steps after its save at step 3: steps 4 and 5 are lost.
    assert run_example(torchrun, out, "--stop-after", "5") == [
        "world size 2 (gloo)",
        "epoch 0 step 3/8: loss X, saved",
        "stopped after 5 steps; run again to resume from the last save",
    ]
    resume = torch.load(resume_path, weights_only=True)
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (0, 3, 2)

    saves = [
        f"epoch {e} step {s}/8: loss X, saved" for e, s in [(0, 6), (0, 8), (1, 3), (1, 6), (1, 8)]
    ]
    assert run_example(torchrun, out) == [
        "world size 2 (gloo)",
        "resumed at epoch 0, step 3",
        *saves,
        "done: epoch 1 finished, 13 steps in this run",
    ]
    # One process, one more epoch: 8 batches per rank on 2 ranks = 16 on 1 (the whole epoch 1).
    alone = run_example([sys.executable], out, "--epochs", "3")
    assert alone == [
        "world size 1 (no process group)",
        "world_size changed 2 -> 1: step 8 -> 16",
        "resumed at epoch 1, step 16",
        *[f"epoch 2 step {s}/16: loss X, saved" for s in (3, 6, 9, 12, 15, 16)],
        "done: epoch 2 finished, 16 steps in this run",
    ]
    resume = torch.load(resume_path, weights_only=True)
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (2, 16, 1)
    assert "lm_head.weight" in resume["model"]
    assert not [key for key in resume["model"] if key.startswith("module.")]  # saved via DDP
