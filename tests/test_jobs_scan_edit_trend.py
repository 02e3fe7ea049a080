"""``--jobs N`` of scan, edit and trend (issue 43): the same report, and for edit the same
output bytes, with ``--jobs 1`` and ``--jobs 4``; and the work really runs at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from ckpttool.io import parallel
from tests.support.adversarial import corpus
from tests.support.helpers import FIXTURES

# the hostile corpus writes a zip with a repeated record name on purpose
pytestmark = pytest.mark.filterwarnings("ignore:Duplicate name")


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _both(*args: Any) -> tuple[Result, Result]:
    return run(*args, "--jobs", 1), run(*args, "-j", 4)


# -- scan ---------------------------------------------------------------------------------------


@pytest.fixture
def scanned(tmp_path: Path) -> Path:
    """A directory of several checkpoints, a hostile pickle among them, a DCP directory, a file
    that is no checkpoint (skipped) and an empty directory (listed)."""
    root = tmp_path / "downloads"
    root.mkdir()
    for name in ("pretrain_32.pth", "pretrain_32_resume.pth", "pretrain_32_moe.pth"):
        shutil.copyfile(FIXTURES / "minimind" / name, root / name)
    hostile = corpus(tmp_path / "marker")
    for name in ("global_reduce_p2_posix_system.zip.pth", "builtins_eval_p2.pkl"):
        (root / name).write_bytes(hostile[name])
    shutil.copytree(FIXTURES / "dcp/checkpoint", root / "dcp")
    (root / "README.md").write_text("not a checkpoint\n")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("text\n")
    return tmp_path


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_scan_reports_the_same_with_any_jobs(scanned: Path, as_json: bool) -> None:
    paths = [scanned / "downloads", scanned / "nothing", scanned / "missing.pth"]
    paths += [FIXTURES / "minimind/pretrain_32.pth"]
    one, four = _both("scan", *paths, *(["--json"] if as_json else []))
    assert one.exit_code == four.exit_code == 1, one.output  # the hostile files were found
    assert one.stdout == four.stdout
    assert "posix.system" in one.stdout and "builtins.eval" in one.stdout
    assert "nothing" in one.stdout  # the directory without a checkpoint
    assert ("README.md" if as_json else "2 non-checkpoint files skipped") in one.stdout


def test_files_are_scanned_at_once(scanned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With two jobs, two files' scans run together: each waits for the other at a barrier,
    which one thread alone would never pass (the timeout only ends a hung test)."""
    from ckpttool.commands import scan as scan_module

    barrier = threading.Barrier(2, timeout=60)
    original = scan_module.scan_file
    met = []

    def meeting(path: Any, allow: Any = ()) -> Any:
        if Path(path).name in ("pretrain_32.pth", "pretrain_32_moe.pth"):
            met.append(barrier.wait())
        return original(path, allow)

    monkeypatch.setattr(scan_module, "scan_file", meeting)
    with parallel.using(2):
        report = scan_module.scan([scanned / "downloads"])
    assert report.found and sorted(met) == [0, 1]


# -- edit ---------------------------------------------------------------------------------------


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


EDITED = [
    (FIXTURES / "frameworks/hf_sharded", ["--dtype", "bf16"]),
    (FIXTURES / "frameworks/hf_bin_sharded", ["--drop", "model.norm.weight", "--dtype", "fp16"]),
    (FIXTURES / "dcp/checkpoint", ["--dtype", "bf16"]),
]


@pytest.mark.parametrize(("source", "edits"), EDITED, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_edit_writes_the_same_bytes_with_any_jobs(
    source: Path, edits: list[str], as_json: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = []
    for jobs in (1, 4):  # the same relative output name, so the reports name the same path
        (tmp_path / str(jobs)).mkdir()
        monkeypatch.chdir(tmp_path / str(jobs))
        results.append(
            run("edit", source, *edits, "-o", "out", "-j", jobs, *(["--json"] if as_json else []))
        )
    one, four = results
    assert one.exit_code == four.exit_code == 0, one.output + four.output
    assert one.stdout == four.stdout
    first, second = _tree(tmp_path / "1" / "out"), _tree(tmp_path / "4" / "out")
    assert first == second and len(first) > 1
    assert not [p for p in os.listdir(tmp_path / "4") if p != "out"]  # no staged leftovers


def test_a_dry_run_reports_the_same_with_any_jobs() -> None:
    one, four = _both("edit", FIXTURES / "frameworks/hf_sharded", "--dtype", "bf16", "--dry-run")
    assert one.exit_code == four.exit_code == 0, one.output
    assert one.stdout == four.stdout


def test_weights_files_are_rewritten_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.commands import edit_directory

    barrier = threading.Barrier(2, timeout=60)
    original = edit_directory.edit_file
    met = []

    def meeting(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name.startswith(("model-00001", "model-00002")):
            met.append(barrier.wait())
        return original(path, *args, **kwargs)

    monkeypatch.setattr(edit_directory, "edit_file", meeting)
    with parallel.using(2):
        report = edit_directory.edit(
            FIXTURES / "frameworks/hf_sharded", tmp_path / "out", dtype="bf16"
        )
    assert report.written and sorted(met) == [0, 1]


def test_a_failing_member_is_the_same_one_line_error_with_any_jobs(tmp_path: Path) -> None:
    """The first and the last shard damaged: the error names the first with any N, and no
    output (nor a staged directory) is left."""
    source = shutil.copytree(FIXTURES / "frameworks/hf_bin_sharded", tmp_path / "model")
    for shard in ("pytorch_model-00001-of-00003.bin", "pytorch_model-00003-of-00003.bin"):
        (source / shard).write_bytes((source / shard).read_bytes()[:200])
    one, four = (
        run("edit", source, "--dtype", "bf16", "-o", tmp_path / "out", "-j", jobs)
        for jobs in (1, 4)
    )
    assert one.exit_code == four.exit_code == 2
    assert one.stderr == four.stderr and "pytorch_model-00001-of-00003.bin" in one.stderr
    assert sorted(os.listdir(tmp_path)) == ["model"]


# -- trend --------------------------------------------------------------------------------------


@pytest.fixture
def run_directory(tmp_path: Path) -> Path:
    """Five resume-style files with step counters, one layer frozen, a NaN from step 40."""
    generator = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.w": torch.rand(8, 4, generator=generator) for i in range(3)}
    for step in range(5):
        model = {k: v * (1 + step * (i + 1) / 10) for i, (k, v) in enumerate(weights.items())}
        model["frozen.w"] = torch.ones(4)
        if step >= 4:
            model["layers.2.w"][0, 0] = float("nan")
        torch.save({"model": model, "step": step * 10, "epoch": 0}, tmp_path / f"s{step}.pth")
    return tmp_path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("kind", ["files", "dcp", "trainer"])
def test_trend_reports_the_same_with_any_jobs(
    run_directory: Path, tmp_path: Path, kind: str, as_json: bool
) -> None:
    target = run_directory
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        target = tmp_path / "dcp_run"
        for step in (300, 100, 200, 400):
            state = {"model": {"a.w": torch.ones(4, 4) * step, "b.w": torch.ones(3)}, "step": step}
            dcp.save(state, checkpoint_id=str(target / f"step_{step}"))
    elif kind == "trainer":
        target = FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"
    args = ["trend", target, "--tensors", *(["--json"] if as_json else [])]
    one, four = _both(*args)
    assert one.exit_code == four.exit_code == (1 if kind == "files" else 0), one.output
    assert one.stdout == four.stdout and one.stderr == four.stderr


def test_pairs_are_compared_at_once(run_directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpttool.commands import trend as trend_module

    barrier = threading.Barrier(2, timeout=60)
    original = trend_module.run_diff
    met = []

    def meeting(*args: Any, **kwargs: Any) -> Any:
        met.append(barrier.wait())
        return original(*args, **kwargs)

    monkeypatch.setattr(trend_module, "run_diff", meeting)
    with parallel.using(2):
        report = trend_module.trend([run_directory])
    assert not report.healthy and len(report.checkpoints) == 5 and sorted(met) == [0, 0, 1, 1]


# -- forked workers (scan) ------------------------------------------------------------------------
# The test process has imported torch, where ordered_map keeps to threads: the forked path runs
# in a fresh interpreter, as the CLI's scan does (it never imports torch).

FORKED = r"""
import multiprocessing, os, sys
from pathlib import Path
from ckpttool.commands import scan as scan_module
from ckpttool.io.parallel import using

meet = multiprocessing.get_context("fork").Barrier(2, timeout=60)
original = scan_module.scan_file

def traced(path, allow=()):
    if Path(path).name in ("pretrain_32.pth", "pretrain_32_moe.pth"):
        meet.wait()  # passed only by two workers at once
    result = original(path, allow)
    result.notes.append(f"pid {os.getpid()}")
    return result

scan_module.scan_file = traced
with using(2):
    report = scan_module.scan([sys.argv[1]])
pids = {note for f in report.files for note in f.notes if note.startswith("pid ")}
print(len(pids), f"pid {os.getpid()}" in pids, "torch" in sys.modules, report.found)
"""


def test_scan_walks_on_forked_workers(scanned: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORKED, str(scanned / "downloads")],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "False", "False", "True"]


ERRORS = r"""
import sys, threading
from ckpttool.io import parallel

class Odd(Exception):
    def __init__(self, what, why):  # two arguments: does not unpickle from a worker
        super().__init__(f"{what}: {why}")

second_failed = __import__("multiprocessing").get_context("fork").Event()

def work(item):
    if item == 2:
        second_failed.set()
        raise ValueError("second")
    if item == 1:
        second_failed.wait(60)
        raise Odd("first", "item 1")
    return item * item

assert parallel._can_fork()
with parallel.using(3):
    assert parallel.ordered_map(work, [0, 3, 4], processes=True) == [0, 9, 16]
    try:
        parallel.ordered_map(work, [0, 1, 2], processes=True)
    except Odd as error:
        print(error)
assert threading.active_count() == 1  # the pool's threads ended with it
"""


def test_forked_map_raises_the_first_error_in_item_order() -> None:
    """Item 2 fails first in time; item 1's error (one that cannot travel back from a worker)
    is raised, as a loop would raise it."""
    done = subprocess.run(
        [sys.executable, "-c", ERRORS], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert (done.returncode, done.stdout) == (0, "first: item 1\n"), done.stderr


def test_a_process_with_torch_maps_on_threads() -> None:
    """Forking after torch is loaded (its thread pools, its locks) is never done."""
    assert "torch" in sys.modules and not parallel._can_fork()
    names: list[str] = []

    def record(item: int) -> int:
        names.append(threading.current_thread().name)
        return item

    with parallel.using(2):
        assert parallel.ordered_map(record, [1, 2, 3], processes=True) == [1, 2, 3]
    assert all(name.startswith("ckpttool-jobs") for name in names)


def test_scan_cli_reports_the_same_with_any_jobs_on_processes(scanned: Path) -> None:
    outputs = []
    for jobs in ("1", "4"):
        done = subprocess.run(
            [sys.executable, "-m", "ckpttool", "scan", str(scanned / "downloads"), "--json",
             "-j", jobs],
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] and "posix.system" in outputs[0]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
