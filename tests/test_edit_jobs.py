"""``edit --jobs N`` and ``edit`` under torchrun on ONE file and on a DCP directory (issue 43):
a file's derived storages (``--dtype``'s casts) computed by several workers, a DCP directory's
data files written by several workers; the output bytes and the report the same with any N and
any number of ranks, the read-back still checking every cast storage (by the CRC-32 of the
bytes the writer was given), and nothing left behind by a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from ckpttool.commands import edit as edit_module
from ckpttool.commands.edit import edit_file
from ckpttool.errors import ReadBackError
from ckpttool.io.parallel import using
from tests.support.helpers import FIXTURES
from tests.support.timeouts import scaled
from tests.test_distributed_convert import ROOT, _env, _ranks, _run, _torchrun


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _state_dict(seed: int = 0, rows: int = 64) -> dict[str, torch.Tensor]:
    """Float tensors of several sizes, a tied pair, a strided view, an integer tensor."""
    generator = torch.Generator().manual_seed(seed)
    weights = {f"layers.{i}.w": torch.randn(rows, 32 * (i + 1), generator=generator)
               for i in range(6)}  # fmt: skip
    weights["embed"] = torch.randn(rows, 48, generator=generator)
    weights["head"] = weights["embed"]  # tied: one storage, cast once
    weights["half_view"] = weights["layers.0.w"][:, ::2]  # a strided view of another's storage
    weights["steps"] = torch.arange(10)
    weights["norm"] = torch.ones(rows, dtype=torch.float64)
    return weights


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("sources")
    torch.save(_state_dict(), directory / "model.pth")
    plain = {k: v.contiguous() for k, v in _state_dict(1).items() if k not in ("head",)}
    save_file(plain, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return {"pth": directory / "model.pth", "safetensors": directory / "model.safetensors"}


EDITS = {
    "bf16": ["--dtype", "bf16"],
    "fp16_drop_rename": ["--dtype", "fp16", "--drop", "layers.5.*", "--rename", r"^layers\.=L."],
}


def _edited(source: Path, edits: list[str], directory: Path, jobs: int) -> tuple[Result, bytes]:
    """``edit SOURCE EDITS -o out.EXT -j JOBS`` run in ``directory`` (a relative output: the
    reports of every N name the same path)."""
    directory.mkdir()
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        result = run("edit", source, *edits, "-o", f"out{source.suffix}", "-j", jobs)
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert os.listdir(directory) == [f"out{source.suffix}"]  # no part or temp file left
    return result, (directory / f"out{source.suffix}").read_bytes()


@pytest.mark.parametrize("edits", sorted(EDITS))
@pytest.mark.parametrize("kind", ["pth", "safetensors"])
def test_same_bytes_and_report_with_any_jobs(
    sources: dict[str, Path], kind: str, edits: str, tmp_path: Path
) -> None:
    source = sources[kind]
    one, data = _edited(source, EDITS[edits], tmp_path / "1", 1)
    for jobs in (2, 4):
        result, written = _edited(source, EDITS[edits], tmp_path / str(jobs), jobs)
        assert result.stdout == one.stdout
        assert written == data
    # and the casts are torch's own, tensor by tensor (an oracle independent of ckpttool)
    target = torch.bfloat16 if edits == "bf16" else torch.float16
    edited = torch.load(tmp_path / "1" / f"out{source.suffix}") if kind == "pth" else None
    if edited is not None:
        original = torch.load(source)
        for key, tensor in edited.items():
            was = original[key.replace("L.", "layers.", 1)]
            want = was.to(target) if was.is_floating_point() else was
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), key
        assert edited["head"].untyped_storage().data_ptr() == (
            edited["embed"].untyped_storage().data_ptr()
        )  # still tied


def test_storages_are_cast_at_once_with_two_jobs(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two jobs two casts run together: each waits for the other at a barrier, which one
    thread alone would never pass (the timeout only ends a hung test)."""
    barrier = threading.Barrier(2, timeout=60)
    original = edit_module.cast_array
    met: list[int] = []
    entered: list[str] = []  # the first two casts wait for each other, the others pass
    lock = threading.Lock()

    def meeting(values: Any, source: str, target: str) -> Any:
        with lock:
            entered.append(threading.current_thread().name)
            first_two = len(entered) <= 2
        if first_two:
            met.append(barrier.wait())
        return original(values, source, target)

    monkeypatch.setattr(edit_module, "cast_array", meeting)
    with using(2):
        report = edit_file(sources["pth"], tmp_path / "out.pth", dtype="bf16")
    assert report.written and sorted(met) == [0, 1]


def _overflowing(path: Path) -> Path:
    """Two tensors too large for float16 (the first in the file's order is named)."""
    weights = _state_dict(2)
    weights["layers.2.w"][3, 4] = 1e6
    weights["layers.4.w"][0, 0] = -3e5
    torch.save(weights, path)
    return path


def test_an_overflow_in_a_worker_is_the_same_one_line_error(tmp_path: Path) -> None:
    source = _overflowing(tmp_path / "big_values.pth")
    results = [run("edit", source, "--dtype", "fp16", "-o", tmp_path / "out.pth", "-j", jobs)
               for jobs in (1, 2, 4)]  # fmt: skip
    assert {r.exit_code for r in results} == {results[0].exit_code} and results[0].exit_code
    assert all(r.stderr == results[0].stderr for r in results)
    assert "'layers.2.w'" in results[0].stderr and "--allow-overflow" in results[0].stderr
    assert results[0].stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["big_values.pth"]  # no output, part or temp file


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_read_back_catches_a_cast_storage_written_wrong(
    sources: dict[str, Path], jobs: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer given a cast storage with one byte flipped after it was computed: its
    CRC-32 differs from the cast's, the file is refused, the existing output left as it was."""
    real = edit_module.write_checked
    flipped: list[str] = []

    def flipping(found: Any, root: Any, output: Path, read_range: Any, read: Any, *rest: Any):
        def read_flipped(key: str) -> bytes:
            data = read(key)
            if key.startswith("\0cast\0") and not flipped:
                flipped.append(key)
                return bytes([data[0] ^ 1]) + data[1:]
            return data

        return real(found, root, output, read_range, read_flipped, *rest)

    monkeypatch.setattr(edit_module, "write_checked", flipping)
    output = tmp_path / "out.pth"
    output.write_bytes(b"the previous output")
    with using(jobs), pytest.raises(ReadBackError):
        edit_file(sources["pth"], output, dtype="bf16", overwrite=True)
    assert flipped and output.read_bytes() == b"the previous output"
    assert sorted(os.listdir(tmp_path)) == ["out.pth"]


def _big(path: Path) -> Path:
    """A 64 MiB float32 file: long enough a write for the test to catch it."""
    generator = torch.Generator().manual_seed(3)
    torch.save({f"w{i}": torch.randn(1024, 1024, generator=generator) for i in range(16)}, path)
    return path


def _stopped_while_writing(command: list[str], directory: Path, how: signal.Signals) -> int:
    """Run ``command``, send ``how`` to its process group once a temp file of ``out.pth``
    appears in ``directory`` (a terminal's Ctrl-C, or a kill); its exit code."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=_env(), cwd=ROOT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + scaled(60)
    caught = False
    while time.monotonic() < deadline and process.poll() is None and not caught:
        caught = any(p.name.startswith(".out.pth.") for p in directory.iterdir())
        if not caught:
            time.sleep(0.001)
    os.killpg(process.pid, how)
    process.communicate(timeout=scaled(60))
    assert caught, "the write was not caught"
    return process.returncode


@pytest.mark.slow
def test_ctrl_c_mid_write_stops_and_leaves_nothing(tmp_path: Path) -> None:
    source = _big(tmp_path / "src.pth")
    command = [sys.executable, "-m", "ckpttool", "edit", str(source), "--dtype", "bf16",
               "-j", "2", "-o", str(tmp_path / "out.pth")]  # fmt: skip
    assert _stopped_while_writing(command, tmp_path, signal.SIGINT) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pth"]


@pytest.mark.slow
def test_killed_mid_write_leaves_no_output_and_a_rerun_is_clean(tmp_path: Path) -> None:
    source = _big(tmp_path / "src.pth")
    out = tmp_path / "out.pth"
    command = [sys.executable, "-m", "ckpttool", "edit", str(source), "--dtype", "bf16",
               "-j", "2", "-o", str(out)]  # fmt: skip
    _stopped_while_writing(command, tmp_path, signal.SIGKILL)
    assert not out.exists()
    # what a killed run leaves (a temp file; a rank's part file), made here where the kill
    # came after the process removed its own, so that the rerun's sweep is always tested
    (tmp_path / ".out.pth.k1ll3d.ckpttool-tmp").write_bytes(b"cut")
    (tmp_path / ".out.pth.0badf00d-3.ckpttool-tmp").write_bytes(b"cut")
    rerun = _run(command)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pth", "src.pth"]
    one = _run([*command[:-4], "-o", str(tmp_path / "one.pth")])
    assert one.returncode == 0, one.stderr
    assert (tmp_path / "one.pth").read_bytes() == out.read_bytes()


# -- torchrun -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_ranks_cast_one_file_the_same_bytes(sources: dict[str, Path], tmp_path: Path):
    source = sources["pth"]
    edits = EDITS["fp16_drop_rename"]
    one, data = _edited(source, edits, tmp_path / "one", 1)
    (tmp_path / "two").mkdir()
    ranks = _run(
        [*_torchrun(2), "edit", str(source), *edits, "-o", str(tmp_path / "two" / "out.pth")]
    )
    assert ranks.returncode == 0, ranks.stderr
    assert (tmp_path / "two" / "out.pth").read_bytes() == data
    assert ranks.stdout == one.stdout.replace("out.pth", str(tmp_path / "two" / "out.pth"))
    assert os.listdir(tmp_path / "two") == ["out.pth"]  # the ranks' part files removed


@pytest.mark.slow
def test_torchrun_overflow_on_a_rank_every_rank_exits_with_it(tmp_path: Path) -> None:
    source = _overflowing(tmp_path / "big_values.pth")
    arguments = ["edit", str(source), "--dtype", "fp16", "-o", str(tmp_path / "out.pth")]
    one = _run([sys.executable, "-m", "ckpttool", *arguments])
    ranks = _ranks(2, arguments)
    assert one.returncode == 1 or one.returncode == 2, one.stderr
    assert [code for code, _, _ in ranks] == [one.returncode] * 2
    errors = ranks[0][2]
    assert errors.count("Error:") == 1 and "'layers.2.w'" in errors, errors
    assert ranks[1][1:] == ("", "")
    assert sorted(os.listdir(tmp_path)) == ["big_values.pth"]


# -- a DCP directory ----------------------------------------------------------------------------


def _dcp(directory: Path, *, overflow: bool = False) -> Path:
    """A single-process ``dcp.save`` whose writer spreads the items over four data files (the
    largest first: ``layers.5.w`` in ``__0_0.distcp``, ``layers.1.w`` in another)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    generator = torch.Generator().manual_seed(4)
    model = {f"layers.{i}.w": torch.randn(64, 16 * (i + 1), generator=generator)
             for i in range(6)}  # fmt: skip
    if overflow:
        model["layers.1.w"][0, 0] = 1e6
        model["layers.5.w"][0, 0] = 2e6
    state = {"model": model, "step": 7, "ids": torch.arange(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns it is not distributed
        dcp.save(state, storage_writer=FileSystemWriter(str(directory), thread_count=4))
    return directory


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dcp(tmp_path_factory.mktemp("dcp") / "checkpoint")


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


DCP_EDITS = {
    "bf16": ["--dtype", "bf16"],
    "drop_rename": ["--drop", "model.layers.2.w", "--rename", r"^model\.layers=model.blocks"],
}


@pytest.mark.parametrize("edits", sorted(DCP_EDITS))
def test_dcp_same_bytes_and_report_with_any_jobs(
    dcp_source: Path, edits: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = []
    for jobs in (1, 2, 4):
        (tmp_path / str(jobs)).mkdir()
        monkeypatch.chdir(tmp_path / str(jobs))
        results.append(run("edit", dcp_source, *DCP_EDITS[edits], "-o", "out", "-j", jobs))
        assert results[-1].exit_code == 0, results[-1].output
        assert os.listdir(tmp_path / str(jobs)) == ["out"]  # no staged leftovers
    assert results[0].stdout == results[1].stdout == results[2].stdout
    trees = [_tree(tmp_path / str(jobs) / "out") for jobs in (1, 2, 4)]
    assert trees[0] == trees[1] == trees[2]
    assert sum(name.endswith(".distcp") for name in trees[0]) == 4


def test_dcp_data_files_are_written_at_once_with_two_jobs(
    dcp_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.formats.dcp import write

    barrier = threading.Barrier(2, timeout=60)
    original = write._write_file
    met: list[int] = []

    def meeting(*args: Any) -> Any:
        if args[-1] in ("__0_0.distcp", "__0_1.distcp"):
            met.append(barrier.wait())
        return original(*args)

    monkeypatch.setattr(write, "_write_file", meeting)
    with using(2):
        report = edit_module_directory().edit(dcp_source, tmp_path / "out", dtype="bf16")
    assert report.written and sorted(met) == [0, 1]


def edit_module_directory() -> Any:
    from ckpttool.commands import edit_directory

    return edit_directory


def test_dcp_overflow_in_a_worker_is_the_same_one_line_error(tmp_path: Path) -> None:
    source = _dcp(tmp_path / "big_values", overflow=True)
    results = [run("edit", source, "--dtype", "fp16", "-o", tmp_path / "out", "-j", jobs)
               for jobs in (1, 4)]  # fmt: skip
    assert results[0].exit_code == results[1].exit_code == 2, results[0].output
    assert results[0].stderr == results[1].stderr
    # the first data file's (DCP's writer put the largest tensor in __0_0), with any N
    assert "'model.layers.5.w'" in results[0].stderr and results[0].stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["big_values"]  # no output, no staged directory


@pytest.mark.slow
@pytest.mark.parametrize("source", ["generated", "fixture"])
def test_torchrun_ranks_write_a_dcp_directory_the_same_bytes(
    dcp_source: Path, source: str, tmp_path: Path
) -> None:
    src = dcp_source if source == "generated" else FIXTURES / "dcp" / "checkpoint"
    edits = ["--dtype", "bf16", "--drop", "model.layers.2.w"] if source == "generated" else [
        "--dtype", "bf16"]  # fmt: skip
    one = _run([sys.executable, "-m", "ckpttool", "edit", str(src), *edits, "-o",
                str(tmp_path / "one")])  # fmt: skip
    ranks = _run([*_torchrun(2), "edit", str(src), *edits, "-o", str(tmp_path / "two")])
    assert (one.returncode, ranks.returncode) == (0, 0), (one.stderr, ranks.stderr)
    assert ranks.stdout.replace("two", "one") == one.stdout
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]
