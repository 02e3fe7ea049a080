"""Issue 49: SIGTERM and SIGHUP (a ``timeout``, a ``kill``, a Slurm or Kubernetes preemption, a
closed terminal) stop a command as Ctrl-C does: real signals sent to a real ``ckpttool`` in the
middle of a write; nothing is left but the inputs, untouched, and the exit code is 128 + signal.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.timeouts import scaled
from tests.test_distributed_convert import ROOT, _env
from tests.test_edit_jobs import _big, _stopped_while_writing

STOPS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _big(tmp_path_factory.mktemp("big") / "src.pth")


@pytest.mark.slow
@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.parametrize("how", STOPS, ids=lambda s: s.name)
def test_a_stopped_edit_leaves_nothing_and_exits_128_plus_the_signal(
    tmp_path: Path, big_source: Path, how: signal.Signals, jobs: str
) -> None:
    source = tmp_path / "src.pth"
    source.symlink_to(big_source)
    before = _digest(big_source)
    command = [sys.executable, "-m", "ckpttool", "edit", str(source), "--dtype", "bf16",
               "-j", jobs, "-o", str(tmp_path / "out.pth")]  # fmt: skip
    assert _stopped_while_writing(command, tmp_path, how) == 128 + how
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pth"]
    assert _digest(big_source) == before


def _stopped_once_written(
    command: list[str], watched: Path, how: signal.Signals
) -> tuple[int, str]:
    """Run ``command``; once anything appears in ``watched`` (a directory, made by the command,
    or the output's directory), send ``how`` to it; its exit code and stderr."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=_env(), cwd=ROOT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + scaled(60)
    caught = False
    while time.monotonic() < deadline and process.poll() is None and not caught:
        caught = watched.is_dir() and any(p.name.startswith(".") for p in watched.iterdir())
        if not caught:
            time.sleep(0.001)
    os.killpg(process.pid, how)
    _, stderr = process.communicate(timeout=scaled(60))
    assert caught, "the write was not caught"
    return process.returncode, stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_convert_into_a_new_directory_removes_it(
    tmp_path: Path, big_source: Path, how: signal.Signals
) -> None:
    """Issue 49: Ctrl-C during ``convert SRC shards/`` left an empty ``shards/``."""
    shards = tmp_path / "shards"
    command = [sys.executable, "-m", "ckpttool", "convert", str(big_source), f"{shards}/",
               "--max-shard-size", "8MB", "--no-verify"]  # fmt: skip
    exit_code, stderr = _stopped_once_written(command, shards, how)
    assert exit_code == 128 + how, stderr
    assert stderr.strip().splitlines()[-1].startswith("Error: interrupted")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_stopped_in_place_backup_edit_leaves_the_file_and_no_backup(
    tmp_path: Path, big_source: Path
) -> None:
    """SIGTERM in the middle of ``edit --in-place --backup``: the original as it was, no
    ``.bak`` (which would refuse the next ``--backup``), no temp file."""
    source = tmp_path / "src.pth"
    shutil.copyfile(big_source, source)
    before = _digest(source)
    command = [sys.executable, "-m", "ckpttool", "edit", str(source), "--dtype", "bf16",
               "--in-place", "--backup"]  # fmt: skip
    exit_code, stderr = _stopped_once_written(command, tmp_path, signal.SIGTERM)
    assert exit_code == 143, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pth"]
    assert _digest(source) == before


@pytest.mark.slow
def test_sigterm_to_every_torchrun_rank_mid_convert_leaves_nothing(
    tmp_path: Path, big_source: Path
) -> None:
    """A preemption (Slurm signals every task) of ``convert`` shared by two ranks: each rank
    stops with its cleanup, no shard, part, temp file or made directory is left."""
    from tests.test_distributed_convert import _free_port

    shards = tmp_path / "shards"
    port = str(_free_port())
    command = [sys.executable, "-m", "ckpttool", "convert", str(big_source), f"{shards}/",
               "--max-shard-size", "8MB", "--no-verify"]  # fmt: skip
    ranks = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env=_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port, CKPTTOOL_DIST="1"))
        for rank in range(2)
    ]  # fmt: skip
    deadline = time.monotonic() + scaled(120)
    caught = False
    while time.monotonic() < deadline and not caught and all(r.poll() is None for r in ranks):
        caught = shards.is_dir() and any(p.name.startswith(".") for p in shards.iterdir())
        if not caught:
            time.sleep(0.001)
    for rank in ranks:
        rank.send_signal(signal.SIGTERM)
    outputs = [rank.communicate(timeout=scaled(120)) for rank in ranks]
    assert caught, "the write was not caught"
    codes = [rank.returncode for rank in ranks]
    assert 143 in codes and all(c in (143, 2) for c in codes), (codes, outputs)
    for _, stderr in outputs:
        assert b"Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []
