"""``--jobs N`` (issue 33): a directory checkpoint's members worked on at once, reported as
with ``--jobs 1``: the same JSON, the same problems in the same order, the same error line."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from ckpttool.io import parallel
from tests.support.helpers import FIXTURES

DIRECTORIES = [
    FIXTURES / "frameworks/hf_bin_sharded",
    FIXTURES / "frameworks/hf_sharded",
    FIXTURES / "dcp/checkpoint",
    FIXTURES / "deepspeed/stage2_fp32_2proc/checkpoints/global_step4",
    FIXTURES / "frameworks/rank_sets/fsdp2",
    FIXTURES / "frameworks/trainer_2proc",
]


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _ids(path: Path) -> str:
    return str(path.relative_to(FIXTURES))


@pytest.mark.parametrize("directory", DIRECTORIES, ids=_ids)
def test_verify_reports_the_same_with_any_jobs(directory: Path) -> None:
    one, four = (
        run("verify", directory, "--json", "--jobs", 1),
        run("verify", directory, "--json", "-j", 4),
    )
    assert one.exit_code == four.exit_code == 0, one.output + four.output
    assert json.loads(one.stdout) == json.loads(four.stdout)
    assert one.stdout == four.stdout


def _damage(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(data)


def test_verify_of_damaged_members_lists_the_same_problems_in_order(tmp_path: Path) -> None:
    """Two shards damaged: with four threads the second may be done first; the report keeps
    the members' order."""
    directory = shutil.copytree(FIXTURES / "frameworks/hf_bin_sharded", tmp_path / "model")
    for shard in ("pytorch_model-00001-of-00003.bin", "pytorch_model-00003-of-00003.bin"):
        _damage(directory / shard, (directory / shard).stat().st_size // 2)
    one, four = (
        run("verify", directory, "--json", "-j", 1),
        run("verify", directory, "--json", "-j", 4),
    )
    assert one.exit_code == four.exit_code == 1
    assert one.stdout == four.stdout
    problems = json.loads(one.stdout)["files"][0]["problems"]
    assert [p.split(":")[0] for p in problems][:2] == [
        "pytorch_model-00001-of-00003.bin",
        "pytorch_model-00003-of-00003.bin",
    ]


def test_verify_of_a_damaged_dcp_directory_is_the_same_with_any_jobs(tmp_path: Path) -> None:
    directory = shutil.copytree(FIXTURES / "dcp/checkpoint", tmp_path / "checkpoint")
    for rank in ("__0_0.distcp", "__1_0.distcp"):
        size = (directory / rank).stat().st_size
        for at in range(size // 8, size, size // 8):
            _damage(directory / rank, at)
    one, four = (
        run("verify", directory, "--json", "-j", 1),
        run("verify", directory, "--json", "-j", 4),
    )
    assert one.exit_code == four.exit_code == 1
    assert one.stdout == four.stdout
    problems = json.loads(one.stdout)["files"][0]["problems"]
    assert any("__0_0.distcp" in p for p in problems) and any("__1_0" in p for p in problems)


def test_members_are_verified_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --jobs 2, two members' checks run together: each waits for the other at a
    barrier, which one thread alone would never pass (the timeout only ends a hung test)."""
    from ckpttool.commands import verify as verify_module

    barrier = threading.Barrier(2, timeout=60)
    original = verify_module.verify_file
    met = []

    def meeting(path: Any, **kwargs: Any) -> Any:
        if Path(path).name.startswith(("pytorch_model-00001", "pytorch_model-00002")):
            met.append(barrier.wait())
        return original(path, **kwargs)

    monkeypatch.setattr(verify_module, "verify_file", meeting)
    with parallel.using(2):
        results = verify_module.verify([FIXTURES / "frameworks/hf_bin_sharded"])
    assert results[0].ok and sorted(met) == [0, 1]


def test_ordered_map_gives_the_first_error_in_item_order() -> None:
    """Item 2 fails first in time; item 1's error is the one raised, as a loop would raise it."""
    second_failed = threading.Event()

    def work(item: int) -> int:
        if item == 2:
            second_failed.set()
            raise ValueError("second")
        if item == 1:
            second_failed.wait(60)
            raise KeyError("first")
        return item

    with parallel.using(3), pytest.raises(KeyError, match="first"):
        parallel.ordered_map(work, [0, 1, 2])
    with parallel.using(3):
        assert parallel.ordered_map(lambda x: x * x, list(range(10))) == [x * x for x in range(10)]


def test_nested_maps_run_in_their_worker() -> None:
    names: list[str] = []

    def inner(item: int) -> int:
        names.append(threading.current_thread().name)
        return item

    def outer(item: int) -> list[int]:
        return parallel.ordered_map(inner, [item, item + 1])

    with parallel.using(2):
        assert parallel.ordered_map(outer, [0, 10]) == [[0, 1], [10, 11]]
    assert all(name.startswith("ckpttool-jobs") for name in names)


def test_jobs_below_one_is_refused() -> None:
    result = run("verify", FIXTURES / "dcp/checkpoint", "--jobs", 0)
    assert result.exit_code == 2
    assert "--jobs" in result.output


CONVERTED = [
    FIXTURES / "frameworks/hf_bin_sharded",
    FIXTURES / "frameworks/hf_sharded",
    FIXTURES / "dcp/checkpoint",
    FIXTURES / "deepspeed/stage2_fp32_2proc/checkpoints/global_step4",
]


@pytest.mark.parametrize("source", CONVERTED, ids=_ids)
def test_convert_writes_the_same_bytes_with_any_jobs(source: Path, tmp_path: Path) -> None:
    one, four = tmp_path / "one.safetensors", tmp_path / "four.safetensors"
    first = run("convert", source, one, "--json", "-j", 1)
    second = run("convert", source, four, "--json", "-j", 4)
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    assert one.read_bytes() == four.read_bytes()
    assert first.stdout.replace(str(one), "OUT") == second.stdout.replace(str(four), "OUT")


@pytest.mark.parametrize(
    "source", [FIXTURES / "frameworks/hf_bin_sharded", FIXTURES / "dcp/checkpoint"], ids=_ids
)
def test_convert_reads_a_directory_ahead_with_jobs(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --jobs 2 a directory's tensors are read on a worker thread (ahead of the writer);
    with --jobs 1 on the writer's own."""
    from ckpttool.commands.convert import run as convert_run

    threads: set[str] = set()
    original = convert_run.tensor_bytes

    def reading(ckpt: Any, planned: Any) -> Any:
        threads.add(threading.current_thread().name.split("_")[0])
        return original(ckpt, planned)

    monkeypatch.setattr(convert_run, "tensor_bytes", reading)
    assert run("convert", source, tmp_path / "one.safetensors", "-j", 1).exit_code == 0
    assert threads == {"MainThread"}
    threads.clear()
    assert run("convert", source, tmp_path / "two.safetensors", "-j", 2).exit_code == 0
    assert "ckpttool-jobs" in threads


def test_a_failing_tensor_is_the_same_one_line_error_with_any_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tensors fail, the later one first in time: the error is the earlier one's, as with
    --jobs 1, and nothing is written."""
    from ckpttool.commands.convert import run as convert_run
    from ckpttool.errors import CorruptCheckpointError

    original = convert_run.tensor_bytes
    source = FIXTURES / "frameworks/hf_bin_sharded"
    with convert_run.open_checkpoint(source) as ckpt:
        keys = [record.key for record in ckpt.tensors()]
    early, late = keys[2], keys[3]
    late_failed = threading.Event()

    def failing(ckpt: Any, planned: Any) -> Any:
        if planned.record.key == late:
            late_failed.set()
            raise CorruptCheckpointError(f"{late}: damaged (late)")
        if planned.record.key == early:
            late_failed.wait(5)  # with --jobs 1 the late one never comes
            raise CorruptCheckpointError(f"{early}: damaged (early)")
        return original(ckpt, planned)

    monkeypatch.setattr(convert_run, "tensor_bytes", failing)
    results = [run("convert", source, tmp_path / f"{n}.safetensors", "-j", n) for n in (1, 4)]
    assert [r.exit_code for r in results] == [2, 2]
    assert results[0].stderr == results[1].stderr
    assert f"{early}: damaged (early)" in results[0].stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (FIXTURES / "frameworks/hf_bin_sharded", FIXTURES / "frameworks/hf_sharded"),
        (FIXTURES / "frameworks/hf_sharded", FIXTURES / "dcp/checkpoint"),
        (
            FIXTURES / "deepspeed/stage2_fp32_2proc/checkpoints/global_step2",
            FIXTURES / "deepspeed/stage2_fp32_2proc/checkpoints/global_step4",
        ),
    ],
    ids=["bin-safetensors", "safetensors-dcp", "deepspeed-steps"],
)
def test_diff_reports_the_same_with_any_jobs(a: Path, b: Path) -> None:
    one, four = run("diff", a, b, "--json", "-j", 1), run("diff", a, b, "--json", "-j", 4)
    assert one.exit_code == four.exit_code, one.output + four.output
    assert one.exit_code in (0, 1), one.output
    assert one.stdout == four.stdout


def test_diff_reads_a_directory_on_threads_with_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """--jobs 2: runs of tensors compared (and read) on the jobs' threads (issue 43)."""
    from ckpttool.commands.diff import run as diff_run

    threads: set[str] = set()
    original = diff_run.read_many

    def reading(ckpt: Any, records: Any) -> Any:
        for item in original(ckpt, records):
            threads.add(threading.current_thread().name.split("_")[0])
            yield item

    monkeypatch.setattr(diff_run, "read_many", reading)
    a, b = FIXTURES / "frameworks/hf_bin_sharded", FIXTURES / "frameworks/hf_sharded"
    assert run("diff", a, b, "-j", 1).exit_code in (0, 1)
    assert threads == {"MainThread"}
    threads.clear()
    assert run("diff", a, b, "-j", 2).exit_code in (0, 1)
    assert threads == {"ckpttool-jobs"}


def test_threads_sharing_a_zip_handle_read_their_own_headers() -> None:
    """--jobs reads a directory's members ahead on threads that share each member's handle: a
    seek and the read after it must not interleave with another thread's (a header read at
    another thread's offset is "has no local header", exit 2, seen with convert --jobs)."""
    from ckpttool.formats.torch_zip.zip_index import ZipIndex, parse_local_header

    path = FIXTURES / "frameworks/hf_bin_sharded/pytorch_model-00001-of-00003.bin"
    with open(path, "rb") as handle:
        index = ZipIndex(handle)
        members = index.infolist()
        expected = {m.filename: parse_local_header(handle, m).data_start for m in members}
        errors: list[BaseException] = []

        def read_all() -> None:
            try:
                for _ in range(300):
                    for member in members:
                        got = parse_local_header(handle, member).data_start
                        assert got == expected[member.filename]
            except BaseException as error:  # reported below, in the test's thread
                errors.append(error)

        threads = [threading.Thread(target=read_all) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors[0]
