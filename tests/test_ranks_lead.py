"""Under torchrun, the commands that do not share their work over ranks (``show``, ``diff``,
``average``...) run on rank 0 alone: one report, one output, the other ranks exit 0 at once.
Whether a process is a torchrun rank is read from its parent's command line (``/proc``, else
``ps``), and ``CKPTTOOL_DIST`` overrides it both ways."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.cli.app import cli
from ckpttool.cli.ranks import runs_alone_off_lead, shares_ranks
from ckpttool.io import units
from tests.support.timeouts import scaled
from tests.test_distributed_convert import ROOT, _env, _torchrun

WEIGHTS = ROOT / "tests" / "fixtures" / "minimind" / "pretrain_32.pth"


def _commands() -> dict[str, object]:
    """Every command's callback by its full name (``lora merge``)."""
    found: dict[str, object] = {}
    for name, command in cli.commands.items():
        subcommands = getattr(command, "commands", None)
        if subcommands:
            found.update({f"{name} {sub}": c.callback for sub, c in subcommands.items()})
        else:
            found[name] = command.callback
    return found


def test_only_convert_verify_scan_and_edit_share_their_work_over_ranks() -> None:
    sharing = {name for name, callback in _commands().items() if shares_ranks(callback)}
    assert sharing == {"convert", "verify", "scan", "edit"}


def test_off_rank_0_every_other_command_has_nothing_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(units, "_parent_is_torchrun", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("CKPTTOOL_DIST", raising=False)
    commands = _commands()
    for rank, alone in (("1", True), ("0", False)):
        monkeypatch.setenv("RANK", rank)
        for name, callback in commands.items():
            assert runs_alone_off_lead(callback) is (alone and not shares_ranks(callback)), name
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("CKPTTOOL_DIST", "0")  # never join: every rank runs every command
    assert not any(runs_alone_off_lead(callback) for callback in commands.values())


def test_the_parent_command_line_from_ps_is_the_one_in_proc() -> None:
    """Where there is no /proc (macOS), ``ps`` gives the parent's command line."""
    from_proc = units.parent_command()
    assert from_proc, "this test needs /proc"
    assert units.parent_command(proc="/no/proc/here") == " ".join(from_proc).split()


def test_a_parent_that_cannot_be_read_is_not_torchrun() -> None:
    """Neither /proc nor ps knows the process: not torchrun, so the command runs alone (a
    ckpttool run inside a training job never waits for ranks that are not there)."""
    with subprocess.Popen([sys.executable, "-c", "pass"]) as gone:
        gone.wait()
    assert units.parent_command(gone.pid, proc="/no/proc/here") == []


def _launched(nproc: int, arguments: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_torchrun(nproc), *arguments],
        capture_output=True, text=True, env=_env(**extra), cwd=ROOT, timeout=scaled(180),
    )  # fmt: skip


def _alone(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", *arguments],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=scaled(60),
    )  # fmt: skip


@pytest.mark.slow
def test_show_and_diff_under_torchrun_print_one_report(tmp_path: Path) -> None:
    """2 ranks: the report of one process, once; with CKPTTOOL_DIST=0 each rank runs alone,
    which prints it twice (so the first half really is rank 0 alone)."""
    copy = tmp_path / "copy.pth"
    copy.write_bytes(WEIGHTS.read_bytes())
    for arguments in (["show", str(WEIGHTS)], ["diff", str(WEIGHTS), str(copy)]):
        want = _alone(arguments)
        assert want.returncode == 0 and want.stdout, want.stderr
        launched = _launched(2, arguments)
        assert launched.returncode == 0, launched.stderr
        assert launched.stdout == want.stdout
        twice = _launched(2, arguments, CKPTTOOL_DIST="0")
        assert twice.returncode == 0, twice.stderr
        assert twice.stdout == want.stdout * 2 or sorted(twice.stdout.splitlines()) == sorted(
            want.stdout.splitlines() * 2
        )


@pytest.mark.slow
def test_an_output_is_written_once_under_torchrun(tmp_path: Path) -> None:
    """``average`` under 2 ranks: rank 1 writes nothing (an output written by every rank
    would race: with --force, the last rename wins; without, a rank finds the other's file)."""
    out = tmp_path / "avg.safetensors"
    launched = _launched(2, ["average", str(WEIGHTS), str(WEIGHTS), "-o", str(out)])
    assert launched.returncode == 0, launched.stderr
    assert out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg.safetensors"]
