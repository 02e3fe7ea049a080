"""``diff --jobs N`` on single files (issue 43): runs of tensors compared on N threads, the same
report (text, ``--json``, ``--by-module``), exit code and error line with any N; the work
really runs at once; a Ctrl-C stops every thread."""

from __future__ import annotations

import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import save_file

from ckpttool.cli import cli
from ckpttool.commands.diff import run as diff_run
from ckpttool.commands.diff.match import TensorPair
from ckpttool.commands.diff.run import open_side, plan_diff, run_diff
from ckpttool.io.parallel import using
from ckpttool.model.records import TensorRecord

BIG = ("big.first", "big.second")  # differ, each heavier than a run: compared at once


def _tensors(seed: int, side: str) -> dict[str, torch.Tensor]:
    """Many tensors of A (``side`` "a") or B: most identical, some differing in a few values,
    one only in each, a dtype change, -0.0 against 0.0, NaNs at the same and other places, large
    ones identical (compared range against range) and differing (by their values)."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for index in range(40):
        out[f"layers.{index}.weight"] = torch.randn(64, 32 + index, generator=generator)
        out[f"layers.{index}.bias"] = torch.randn(64, generator=generator)
    for name in BIG:
        out[name] = torch.randn(1024, 600, generator=generator)  # 2.4 MB: past a read block
    out["big.same"] = torch.randn(1024, 700, generator=generator)
    out["halves"] = torch.randn(300, 7, generator=generator).half()
    out["counts"] = torch.arange(5000, dtype=torch.int64)
    out["zeros"] = torch.zeros(100)
    out["nan_same"] = torch.tensor([1.0, float("nan"), 3.0])
    out["nan_moved"] = torch.tensor([float("nan"), 2.0, 3.0])
    out["cast"] = torch.linspace(-1, 1, 257)
    if side == "a":
        out["only_a"] = torch.ones(3)
        return out
    out["only_b"] = torch.ones(4)
    for name in ("layers.3.weight", "layers.17.bias", "layers.31.weight", *BIG):
        out[name] = out[name].clone()
        out[name].view(-1)[5] += 0.5
    out["layers.9.bias"] = out["layers.9.bias"] + 1e-9  # within tolerance
    out["zeros"] = out["zeros"].clone()
    out["zeros"][7] = -0.0
    out["nan_moved"] = torch.tensor([1.0, float("nan"), 3.0])
    out["cast"] = out["cast"].half()
    return out


@pytest.fixture(params=["torch-zip", "safetensors"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    paths = []
    for side in ("a", "b"):
        tensors = _tensors(0, side)
        if request.param == "torch-zip":
            path = tmp_path / f"{side}.pth"
            torch.save(tensors, path)
        else:
            path = tmp_path / f"{side}.safetensors"
            save_file(tensors, str(path))
        paths.append(path)
    return paths[0], paths[1]


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize(
    "options", [[], ["--json"], ["--by-module"], ["--json", "--by-module"]],
    ids=["text", "json", "by-module", "json-by-module"],
)  # fmt: skip
def test_reports_are_the_same_with_any_jobs(pair: tuple[Path, Path], options: list[str]) -> None:
    a, b = pair
    results = [run("diff", a, b, *options, "--jobs", jobs) for jobs in (1, 2, 4)]
    assert [r.exit_code for r in results] == [1, 1, 1], results[0].output
    assert results[0].stdout == results[1].stdout == results[2].stdout
    assert results[0].stderr == results[1].stderr == results[2].stderr  # the notes
    if "--by-module" not in options:
        for key in ("only_a", "only_b", "nan_moved", *BIG, "layers.31.weight", "layers.9.bias"):
            assert key in results[0].stdout
    if not options:
        assert "the dtypes differ: 1 tensor is float32 in A and float16 in B" in results[0].stderr


def test_every_verdict_is_the_one_of_one_thread(pair: tuple[Path, Path]) -> None:
    """The library's report, entry by entry, and every status met (the CLI's output could
    hide a field)."""
    a, b = pair
    with open_side(a) as ckpt_a, open_side(b) as ckpt_b:
        plan = plan_diff(ckpt_a, ckpt_b)
        reports = []
        for jobs in (1, 3):
            with using(jobs):
                reports.append(run_diff(ckpt_a, ckpt_b, plan, norms=True))
    assert reports[0] == reports[1]
    statuses = {entry.key: entry.status for entry in reports[0].tensors}
    assert statuses["only_a"] == "only_a" and statuses["only_b"] == "only_b"
    assert statuses["nan_moved"] == statuses["big.first"] == statuses["big.second"] == "differ"
    assert statuses["layers.9.bias"] == statuses["zeros"] == "within_tolerance"  # -0.0 == 0.0
    assert statuses["big.same"] == statuses["nan_same"] == "identical"


def test_the_pairs_of_one_file_are_compared_at_once(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two jobs, two large tensors of one file are compared together: each waits for the
    other at a barrier, which one thread alone would never pass (the timeout only ends a hung
    test)."""
    barrier = threading.Barrier(2, timeout=30)
    original = diff_run._compare_pair
    met = []

    def meeting(ckpt_a: Any, ckpt_b: Any, pair: TensorPair, *args: Any, **kwargs: Any) -> Any:
        if pair.key in BIG:
            met.append(barrier.wait())
        return original(ckpt_a, ckpt_b, pair, *args, **kwargs)

    monkeypatch.setattr(diff_run, "_compare_pair", meeting)
    a, b = pair
    result = run("diff", a, b, "--jobs", 2)
    assert result.exit_code == 1, result.output
    assert sorted(met) == [0, 1]


def test_an_interrupt_stops_every_thread(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C (here raised in one thread's comparison, as the main thread would get it)
    stops the other thread at its next chunk instead of letting it run on."""
    barrier = threading.Barrier(2, timeout=30)
    original = diff_run._compare_pair
    ran_on = []

    def comparing(ckpt_a: Any, ckpt_b: Any, pair: TensorPair, *args: Any, **kwargs: Any) -> Any:
        if pair.key == BIG[0]:
            barrier.wait()
            raise KeyboardInterrupt
        if pair.key == BIG[1]:
            barrier.wait()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a long comparison, chunk after chunk
                kwargs["progress"](0)
                time.sleep(0.01)
            ran_on.append(pair.key)
        return original(ckpt_a, ckpt_b, pair, *args, **kwargs)

    monkeypatch.setattr(diff_run, "_compare_pair", comparing)
    a, b = pair
    started = time.monotonic()
    with open_side(a) as ckpt_a, open_side(b) as ckpt_b, using(2):
        plan = plan_diff(ckpt_a, ckpt_b)
        with pytest.raises(KeyboardInterrupt):
            run_diff(ckpt_a, ckpt_b, plan)
    assert not ran_on
    assert time.monotonic() - started < 20


def test_progress_counts_every_byte_once(pair: tuple[Path, Path]) -> None:
    a, b = pair
    with open_side(a) as ckpt_a, open_side(b) as ckpt_b:
        plan = plan_diff(ckpt_a, ckpt_b)
        for jobs in (1, 4):
            seen: list[int] = []
            with using(jobs):
                run_diff(ckpt_a, ckpt_b, plan, progress=seen.append)
            assert sum(seen) == plan.value_bytes


def test_a_damaged_second_file_gives_the_same_error_with_any_jobs(tmp_path: Path) -> None:
    """Two records of B lost their local headers: the one error line names the first in the
    order of the comparison, whichever thread meets its own first."""
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save(_tensors(0, "a"), a)
    torch.save(_tensors(0, "a"), b)
    data = bytearray(b.read_bytes())
    with zipfile.ZipFile(b) as archive:
        records = [i for i in archive.infolist() if "/data/" in i.filename]
    for info in (records[10], records[-3]):
        data[info.header_offset : info.header_offset + 4] = b"XXXX"
    b.write_bytes(bytes(data))
    results = [run("diff", a, b, "--jobs", jobs) for jobs in (1, 2, 4)]
    assert [r.exit_code for r in results] == [2, 2, 2], results[0].output
    lines = [r.stderr for r in results]
    assert lines[0] == lines[1] == lines[2]
    assert lines[0].startswith("Error: ") and lines[0].count("\n") == 1, lines[0]
    assert "local header" in lines[0]


def _pairs(sizes: list[int]) -> list[TensorPair]:
    out = []
    for index, size in enumerate(sizes):
        record = TensorRecord(f"t{index}", "uint8", (size,), (1,), 0, None)
        out.append(TensorPair(f"t{index}", record, record))
    return out


@pytest.mark.parametrize(
    "sizes", [[1] * 50, [10_000_000] + [1] * 30, [1] * 30 + [10_000_000], [5, 80_000, 3] * 20]
)
def test_runs_are_neighbours_in_order_of_about_equal_bytes(sizes: list[int]) -> None:
    pairs = _pairs(sizes)
    runs = diff_run._runs(pairs, 8)
    assert [p for r in runs for p in r] == pairs
    assert all(runs) and len(runs) <= 8
    if sizes == [1] * 50:
        assert len(runs) == 8 and max(map(len, runs)) - min(map(len, runs)) <= 1
    if sizes[0] == 10_000_000:
        assert runs[0] == pairs[:1]  # the heavy one alone, the rest shared out
        assert len(runs) > 1


def test_what_is_read_in_order_stays_on_one_thread(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL (its ranges fetched in order) and an assembled view (DeepSpeed's fp32 weights) are
    compared on the calling thread whatever N, with the same report; two local files on N."""
    from ckpttool.frameworks.base import view_facts
    from tests.support.helpers import FIXTURES
    from tests.support.range_server import RangeServer

    threads: list[str] = []
    original = diff_run._compare_run

    def recording(*args: Any, **kwargs: Any) -> Any:
        # a DeepSpeed tag's files as stored, compared beyond its view, are local files
        if args[0].format != "directory" or view_facts(args[0]) is not None:
            threads.append(threading.current_thread().name.split("_")[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(diff_run, "_compare_run", recording)
    a, b = pair
    assert run("diff", a, b, "-j", 2).exit_code == 1
    assert set(threads) == {"ckpttool-jobs"}
    steps = FIXTURES / "deepspeed/stage2_fp32_2proc/checkpoints"
    server = RangeServer().start()
    try:
        url_b = server.add_path(b.name, b)
        for first, second in ((a, url_b), (steps / "global_step2", steps / "global_step4")):
            threads.clear()
            one, four = run("diff", first, second, "-j", 1), run("diff", first, second, "-j", 4)
            assert one.exit_code == four.exit_code and one.exit_code in (0, 1), one.output
            assert one.stdout == four.stdout
            assert set(threads) == {"MainThread"}
    finally:
        server.stop()


ALLOCATIONS = """
import resource, sys
import numpy as np
from safetensors.numpy import save_file
from ckpttool.commands.diff.run import diff
from ckpttool.io.memory import reuse_freed_memory

a, b = sys.argv[1], sys.argv[2]
kept = reuse_freed_memory() if sys.argv[3] == "reuse" else None  # as `ckpttool diff` does
values = np.random.default_rng(0).standard_normal(8 << 20, dtype=np.float32)  # 16 chunks
save_file({"w": values}, a)
save_file({"w": values * np.float32(1.001)}, b)
del values
diff(a, b)  # the first: imports, and the heaps grown once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
assert diff(a, b).counts()["differ"] == 1
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _chunk_faults(tmp_path: Path, mode: str) -> tuple[str, int]:
    import subprocess
    import sys

    paths = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    found = subprocess.run(
        [sys.executable, "-c", ALLOCATIONS, *paths, mode],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    kept, faults = found.stdout.split()
    return kept, int(faults)


def test_chunk_temporaries_reuse_memory_instead_of_new_pages(tmp_path: Path) -> None:
    """Comparing two differing 32 MB tensors (16 chunks, a dozen temporaries of 4 MB each)
    faults in no new pages once the heaps have grown, with glibc told to keep freed blocks
    (:func:`~ckpttool.io.memory.reuse_freed_memory`, which ``ckpttool diff`` calls); without
    it, tens of thousands of faults: half of diff's time on large files. In a process of its
    own: the allocator's settings are the process's."""
    kept, faults = _chunk_faults(tmp_path, "reuse")
    assert kept == "True"
    assert faults < 5000, faults
    _, without = _chunk_faults(tmp_path, "default")
    assert without > 5 * max(faults, 1000), (faults, without)


def test_the_diff_command_keeps_freed_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.io import memory

    calls: list[bool] = []
    monkeypatch.setattr(memory, "reuse_freed_memory", lambda: calls.append(True) or True)
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.zeros(3)}, str(path))
    result = CliRunner().invoke(cli, ["diff", str(path), str(path)])
    assert result.exit_code == 0, result.output
    assert calls == [True]
