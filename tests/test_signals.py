"""Issue 49: SIGTERM and SIGHUP (a ``timeout``, a ``kill``, a Slurm or Kubernetes preemption, a
closed terminal) stop a command as Ctrl-C does: real signals sent to a real ``ckpttool`` in the
middle of a write; nothing is left but the inputs, untouched, and the exit code is 128 + signal.
"""

from __future__ import annotations

import hashlib
import signal
import sys
from pathlib import Path

import pytest

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
