"""``convert`` over ``--jobs N`` processes and torchrun's ranks (issue 43): the same bytes.

Every run is a real launch: ``python -m ckpttool`` for one process and ``--jobs 4`` (a process
pool), ``python -m torch.distributed.run`` for 1, 2 and 4 ranks and for two launchers as two
nodes on this machine (static rendezvous on localhost). Each output directory is compared file
by file (names, hidden files included, and SHA-256) with the one-process output. Failures: a
damaged shard makes every rank exit 2 with the shard named once; a rank killed mid-write leaves
no output, and a rerun sweeps what it left and writes the same bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from ckpttool.io import units
from ckpttool.io.units import assign
from tests.support.timeouts import scaled

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent
SOURCES = {
    "hf_sharded": FIXTURES / "frameworks" / "hf_sharded",
    "dcp": FIXTURES / "dcp" / "checkpoint",
    "zero3": FIXTURES / "deepspeed" / "stage3_bf16_2proc" / "checkpoints",
    "megatron_torch_dist": FIXTURES / "frameworks" / "megatron" / "tp2",
}
CONVERT = ["convert", "--max-shard-size", "500", "--dtype", "bf16"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), CKPTTOOL_DIST_TIMEOUT="30", OMP_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(nproc: int, *, nnodes: int = 1, node_rank: int = 0, port: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
        f"--node-rank={node_rank}", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
        f"--master-port={port or _free_port()}", "--max-restarts=0", "--monitor-interval=0.1",
        "-m", "ckpttool",
    ]  # fmt: skip


def _run(command: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=scaled(timeout)
    )


def _ranks(world: int, arguments: list[str]) -> list[tuple[int, str, str]]:
    """``python -m ckpttool ARGUMENTS`` as ``world`` ranks, launched as torchrun launches them
    (its variables, and CKPTTOOL_DIST=1: no torchrun parent) but by the test, so that each rank's exit code and output are seen (torchrun
    stops the other ranks with SIGTERM once one has failed): (code, stdout, stderr) by rank."""
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "ckpttool", *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                CKPTTOOL_DIST="1",
            ),
        )
        for rank in range(world)
    ]
    outputs = [process.communicate(timeout=scaled(120)) for process in processes]
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


def _files(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (hidden ones too) by relative name -> SHA-256."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _one_process(src: Path, dst: Path, *extra: str) -> dict[str, str]:
    done = _run([sys.executable, "-m", "ckpttool", *CONVERT, *extra, str(src), f"{dst}/"])
    assert done.returncode == 0, done.stderr
    files = _files(dst)
    assert sum(name.endswith(".safetensors") for name in files) >= 2, files  # several units
    return files


def test_assignment_is_balanced_by_bytes_and_deterministic() -> None:
    assert assign([5, 1, 1, 1, 4, 3], 2) == [[0, 1, 2, 3], [4, 5]]  # loads 8 and 7
    assert assign([1, 1, 1], 4) == [[0], [1], [2], []]
    assert assign([], 3) == [[], [], []]


def test_runs_are_neighbours_of_about_equal_weight() -> None:
    """The one cut of items into runs (convert's byte ranges, edit's casts, diff's pairs)."""
    assert units.runs([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert units.runs([100, 1, 1, 1, 1], 4) == [(0, 1), (1, 5)]  # the heavy one alone
    assert units.runs([1, 1, 1, 100], 4) == [(0, 3), (3, 4)]  # and when it comes last
    assert len(units.runs([10, 30] * 3, 4)) == 4  # never more runs than asked
    assert units.runs([0, 0, 0], 2) == [(0, 3)]  # nothing to balance: one run
    assert units.runs([], 3) == [(0, 0)]
    assert units.runs([5, 5], 8) == [(0, 1), (1, 2)]  # never more runs than items


class _TwoRanks(units.Ranks):
    """Rank 0 of 2, with rank 1's outcome computed here: what :meth:`exchange` would gather."""

    def __init__(self, rank1: Callable[[], object]) -> None:
        super().__init__(0, 2)
        self.rank1 = rank1

    def exchange(self, outcome: object) -> list[object]:
        return [outcome, self.rank1()]


def test_shared_map_computes_only_its_share_and_merges_in_item_order() -> None:
    items = [10, 1, 1, 1, 40, 30]
    called: list[int] = []

    def square(item: int) -> int:
        called.append(item)
        return item * item

    mine, theirs = assign(items, 2)
    units.set_current(_TwoRanks(lambda: [(i, items[i] ** 2) for i in theirs]))
    try:
        assert units.shared_map(square, items, items) == [i * i for i in items]
        assert sorted(called) == sorted(items[i] for i in mine) and len(called) < len(items)
        units.set_current(_TwoRanks(lambda: [(theirs[0], units.Failure("bad shard", 1))]))
        with pytest.raises(units.UnitError, match=r"^rank 1: bad shard$") as raised:
            units.shared_map(square, items, items)
        assert raised.value.exit_code == 1
    finally:
        units.set_current(None)


def test_one_file_is_cut_into_runs_of_about_equal_bytes() -> None:
    from ckpttool.commands.convert.output import OutFile
    from ckpttool.commands.convert.plan import Planned
    from ckpttool.commands.convert.spread import ranges
    from ckpttool.model.records import TensorRecord

    sizes = [100, 1, 1, 1, 50, 50, 1, 100, 3, 3]
    tensors = [
        Planned(f"t{i}", TensorRecord(f"t{i}", "uint8", (n,), (1,), 0, None), "uint8")
        for i, n in enumerate(sizes)
    ]
    cut = ranges(OutFile(Path("x.safetensors"), "safetensors", tensors), 2)
    assert [b for _, b in cut][-1] == len(sizes) and cut[0][0] == 0
    assert all(a < b == c for (a, b), (c, _) in itertools.pairwise(cut))  # contiguous, in order
    assert 3 <= len(cut) <= 8  # a few per worker
    assert ranges(OutFile(Path("x.safetensors"), "safetensors", tensors[:1]), 4) == [(0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(SOURCES))
def test_convert_same_bytes_for_jobs_and_ranks(layout: str, tmp_path: Path) -> None:
    src = SOURCES[layout]
    want = _one_process(src, tmp_path / "one")
    runs = {
        "jobs4": [sys.executable, "-m", "ckpttool", *CONVERT, "--jobs", "4"],
        **{f"ranks{n}": [*_torchrun(n), *CONVERT] for n in (1, 2, 4)},
    }
    for name, command in runs.items():
        started = time.monotonic()
        done = _run([*command, str(src), f"{tmp_path / name}/"])
        assert done.returncode == 0, (name, done.stderr)
        assert _files(tmp_path / name) == want, name
        assert done.stdout.count("verified") == 1, (name, done.stdout)  # one report: rank 0's
        print(f"{layout} {name}: {time.monotonic() - started:.1f} s wall")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(SOURCES))
def test_convert_two_launchers_as_two_nodes(layout: str, tmp_path: Path) -> None:
    src = SOURCES[layout]
    want = _one_process(src, tmp_path / "one")
    port = _free_port()
    launchers = [
        subprocess.Popen(
            [
                *_torchrun(2, nnodes=2, node_rank=rank, port=port),
                *CONVERT,
                str(src),
                f"{tmp_path / 'nodes'}/",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        for rank in (0, 1)
    ]
    outputs = [launcher.communicate(timeout=scaled(120)) for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert _files(tmp_path / "nodes") == want
    assert outputs[0][0].count("verified") == 1 and outputs[1][0] == ""  # rank 0 is on node 0


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


@pytest.mark.slow
def test_damaged_shard_every_rank_exits_2_and_names_it_once(tmp_path: Path) -> None:
    src = _copy(SOURCES["hf_sharded"], tmp_path / "src")
    shard = src / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])  # two bytes short: every rank's plan fails
    ranks = _ranks(2, [*CONVERT, str(src), f"{tmp_path / 'out'}/"])
    assert [code for code, _, _ in ranks] == [2, 2], ranks
    errors = [line for _, _, err in ranks for line in _errors(err)]
    assert len(errors) == 1 and "model-00003-of-00003.safetensors" in errors[0], ranks
    assert ranks[1][1:] == ("", "")  # rank 1 prints nothing: rank 0 said it
    assert not (tmp_path / "out").exists()


def _written_by_rank_1(one: Path, names: list[str]) -> str:
    """One of ``names`` whose output shard rank 1 of 2 writes (by the byte-balanced
    assignment of the one-process output's shards)."""
    import json

    _one_process(SOURCES["hf_sharded"], one)
    weight_map = json.loads((one / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    weights = []
    for shard in shards:
        data = (one / shard).read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        weights.append(sum(v["data_offsets"][1] - v["data_offsets"][0]
                           for k, v in header.items() if k != "__metadata__"))  # fmt: skip
    share = assign(weights, 2)[1]
    return next(name for name in names if shards.index(weight_map[name]) in share)


@pytest.mark.slow
def test_value_one_rank_cannot_write_every_rank_exits_2_naming_rank_and_shard(
    tmp_path: Path,
) -> None:
    """A value fp16 cannot hold, in the last shard: only the rank writing it fails."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = _copy(SOURCES["hf_sharded"], tmp_path / "src")
    shard = src / "model-00003-of-00003.safetensors"
    tensors = load_file(str(shard))
    name = _written_by_rank_1(tmp_path / "one", sorted(tensors))
    tensors[name] = np.full_like(tensors[name], 1e30)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    ranks = _ranks(2, [*CONVERT[:-1], "fp16", str(src), f"{tmp_path / 'out'}/"])
    assert [code for code, _, _ in ranks] == [2, 2], ranks
    errors = [line for _, _, err in ranks for line in _errors(err)]
    assert len(errors) == 1, ranks
    pattern = rf"^Error: rank 1: writing model-\d{{5}}-of-\d{{5}}\.safetensors: {re.escape(name)}: "
    assert re.match(pattern, errors[0]), errors
    # under torchrun: the same line once, and rank 0 the first failure torchrun names
    done = _run([*_torchrun(2), *CONVERT[:-1], "fp16", str(src), f"{tmp_path / 'out'}/"])
    assert _errors(done.stderr) == errors, done.stderr
    out = tmp_path / "out"
    assert not out.exists() or not [p.name for p in out.parent.iterdir() if "ckpttool" in p.name]


def _big_source(directory: Path) -> None:
    """A Hugging Face sharded directory, 8 shards of 8 MiB float32: enough for a rank to be
    caught writing."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir()
    generator = np.random.default_rng(0)
    weight_map = {}
    for number in range(8):
        name = f"model-{number + 1:05d}-of-00008.safetensors"
        tensors = {f"model.layers.{number}.w{i}": generator.standard_normal((512, 1024), np.float32)
                   for i in range(4)}  # fmt: skip
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 8 * 4 * 512 * 1024 * 4}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config = SOURCES["hf_sharded"] / "config.json"
    (directory / "config.json").write_bytes(config.read_bytes())


def _writing(directory: Path) -> bool:
    """Whether a part file is being written in a staging directory of ``directory/out``."""
    for staging in directory.glob(".out.*.ckpttool-tmp"):
        try:
            if any(p.name.endswith(".ckpttool-tmp") for p in staging.iterdir()):
                return True
        except FileNotFoundError:
            pass
    return False


@pytest.mark.slow
def test_rank_killed_mid_write_leaves_no_output_and_rerun_is_clean(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    _big_source(src)
    command = [*_torchrun(2), "convert", "--max-shard-size", "4MB", "--dtype", "bf16", str(src),
               f"{out}/"]  # fmt: skip
    started = time.monotonic()
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env(), cwd=ROOT)  # fmt: skip
    deadline = time.monotonic() + scaled(60)
    killed = False
    while time.monotonic() < deadline and launcher.poll() is None and not killed:
        if _writing(tmp_path):
            for child in psutil.Process(launcher.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == "1":
                        child.send_signal(signal.SIGKILL)
                        killed = True
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.002)
    _, stderr = launcher.communicate(timeout=scaled(90))
    assert killed, "no rank was caught writing"
    assert launcher.returncode != 0, stderr
    assert not out.exists()  # no output, not even part of it
    print(f"killed run: {time.monotonic() - started:.1f} s to fail")
    # what the killed ranks left: torchrun stops rank 0 with SIGTERM, so usually no cleanup
    # runs; where rank 0 got to clean up first, what a killed run leaves is made here, so that
    # the rerun's sweep is always what is tested
    if not list(tmp_path.glob(".out.*.ckpttool-tmp")):
        stale = tmp_path / ".out.k1ll3d.ckpttool-tmp"
        stale.mkdir()
        (stale / ".model-00001-of-00008.safetensors.k1ll3d.ckpttool-tmp").write_bytes(b"cut")
    rerun = _run(command)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # the leftovers swept
    want = _one_process(src, tmp_path / "one", "--max-shard-size", "4MB")
    assert _files(out) == want


CHECKS = {  # one launch each: every layout's report in one
    "verify": ["verify", *(str(src) for src in SOURCES.values())],
    "verify_json": ["verify", "--json", str(SOURCES["dcp"]), str(SOURCES["zero3"])],
    "scan": ["scan", str(FIXTURES / "frameworks"), str(SOURCES["dcp"]), str(SOURCES["zero3"])],
}


@pytest.mark.slow
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_verify_and_scan_report_the_same_under_torchrun(check: str) -> None:
    arguments = CHECKS[check]
    one = _run([sys.executable, "-m", "ckpttool", *arguments])
    ranks = _run([*_torchrun(3), *arguments])
    assert (ranks.returncode, ranks.stdout) == (one.returncode, one.stdout), ranks.stderr


@pytest.mark.slow
def test_verify_damaged_shard_under_torchrun_is_found_once(tmp_path: Path) -> None:
    src = _copy(SOURCES["hf_sharded"], tmp_path / "src")
    shard = src / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    one = _run([sys.executable, "-m", "ckpttool", "verify", str(src)])
    ranks = _ranks(2, ["verify", str(src)])
    assert [code for code, _, _ in ranks] == [1, 1] and one.returncode == 1
    assert ranks[0][1] == one.stdout and "model-00002-of-00003.safetensors" in one.stdout
    assert ranks[1][1:] == ("", "")


EDITS = {
    # a Hugging Face directory: its weights files shared by the ranks
    "hf_sharded": (SOURCES["hf_sharded"], ["--dtype", "bf16", "--drop", "model.layers.0.*"]),
    # one file (and a DCP directory): rank 0 alone, the others wait
    "file": (FIXTURES / "dcp" / "model.safetensors", ["--dtype", "bf16"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EDITS))
def test_edit_under_torchrun_writes_the_same_bytes_and_report(case: str, tmp_path: Path) -> None:
    src, options = EDITS[case]
    suffix = src.suffix
    one = _run([sys.executable, "-m", "ckpttool", "edit", str(src), "-o",
                str(tmp_path / f"one{suffix}"), *options])  # fmt: skip
    ranks = _run([*_torchrun(2), "edit", str(src), "-o", str(tmp_path / f"two{suffix}"), *options])
    assert (one.returncode, ranks.returncode) == (0, 0), (one.stderr, ranks.stderr)
    assert ranks.stdout.replace(f"two{suffix}", f"one{suffix}") == one.stdout
    a, b = tmp_path / f"one{suffix}", tmp_path / f"two{suffix}"
    if a.is_dir():
        assert _files(a) == _files(b)
    else:
        assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"one{suffix}", f"two{suffix}"]


@pytest.mark.slow
def test_convert_from_a_url_under_torchrun_same_bytes(tmp_path: Path) -> None:
    """Every rank reads SRC through HTTP ranges (a loopback server): the same bytes as one
    process reading it."""
    from tests.support.range_server import RangeServer

    source = FIXTURES / "dcp" / "model.safetensors"
    server = RangeServer().start()
    try:
        url = server.add("model.safetensors", source.read_bytes())
        one = _run([sys.executable, "-m", "ckpttool", *CONVERT, url, f"{tmp_path / 'one'}/"])
        assert one.returncode == 0, one.stderr
        fetched_by_one = len(server.requests)
        ranks = _run([*_torchrun(2), *CONVERT, url, f"{tmp_path / 'two'}/"])
        assert ranks.returncode == 0, ranks.stderr
    finally:
        server.stop()
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    assert sum(name.endswith(".safetensors") for name in _files(tmp_path / "one")) >= 2
    assert ranks.stdout.replace("two", "one") == one.stdout
    assert len(server.requests) > fetched_by_one  # the ranks' requests came on top


@pytest.mark.slow
def test_convert_to_one_small_file_under_torchrun_same_bytes(tmp_path: Path) -> None:
    """One output file: its tensor ranges shared by the ranks, in place; the same bytes."""
    src = str(SOURCES["dcp"])
    one = _run(
        [sys.executable, "-m", "ckpttool", "convert", src, str(tmp_path / "one.safetensors")]
    )
    ranks = _run([*_torchrun(2), "convert", src, str(tmp_path / "two.safetensors")])
    assert (one.returncode, ranks.returncode) == (0, 0), ranks.stderr
    assert (tmp_path / "one.safetensors").read_bytes() == (
        tmp_path / "two.safetensors"
    ).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors", "two.safetensors"]


@pytest.mark.slow
def test_ctrl_c_stops_every_jobs_process_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGINT to the command's process group (a terminal's Ctrl-C) while the workers write:
    exit 130, every worker gone, no output and no temporary file."""
    src, out = tmp_path / "src", tmp_path / "out"
    _big_source(src)
    command = [sys.executable, "-m", "ckpttool", "convert", "--max-shard-size", "4MB",
               "--dtype", "bf16", "--jobs", "2", str(src), f"{out}/"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_env(), cwd=ROOT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + scaled(60)
    while time.monotonic() < deadline and process.poll() is None and not _writing(tmp_path):
        time.sleep(0.002)
    assert _writing(tmp_path), "the workers were not caught writing"
    workers = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=scaled(60))
    assert process.returncode == 130, stderr
    # the workers, and the forkserver once it sees its parent gone
    _, alive = psutil.wait_procs(workers, timeout=scaled(10))
    assert not alive
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow
def test_a_jobs_worker_killed_is_one_error_and_leaves_nothing(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    _big_source(src)
    command = [sys.executable, "-m", "ckpttool", "convert", "--max-shard-size", "4MB",
               "--dtype", "bf16", "--jobs", "2", str(src), f"{out}/"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_env(), cwd=ROOT)  # fmt: skip
    deadline = time.monotonic() + scaled(60)
    while time.monotonic() < deadline and process.poll() is None and not _writing(tmp_path):
        time.sleep(0.002)
    writers = [p for p in tmp_path.glob(".out.*.ckpttool-tmp")]
    assert writers, "the workers were not caught writing"
    # a worker: a child of the forkserver, the parent's one child that has children
    server = next(c for c in psutil.Process(process.pid).children() if c.children())
    server.children()[0].send_signal(signal.SIGKILL)
    _, stderr = process.communicate(timeout=scaled(60))
    assert process.returncode == 2, stderr
    assert stderr.startswith("Error: a worker process died"), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow
def test_inherited_rank_variables_alone_do_not_join(tmp_path: Path) -> None:
    """A ckpttool run from inside a training job inherits RANK and WORLD_SIZE: without a
    torchrun parent (or CKPTTOOL_DIST=1) it runs alone, at once, as always."""
    env = _env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    done = subprocess.run(
        [sys.executable, "-m", "ckpttool", "verify", str(SOURCES["dcp"])],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=scaled(60),
    )  # fmt: skip
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


@pytest.mark.slow
def test_one_large_file_split_by_byte_range_same_bytes(tmp_path: Path) -> None:
    """One output file of 32 MiB: its tensor ranges written in place by --jobs 3 processes
    and by 2 ranks; the same bytes as one process, nothing else left."""
    _big_source(tmp_path / "src")
    big = tmp_path / "big.safetensors"
    made = _run([sys.executable, "-m", "ckpttool", "convert", str(tmp_path / "src"), str(big)])
    assert made.returncode == 0, made.stderr
    convert = ["convert", str(big), "--dtype", "bf16"]
    runs = {
        "one": [sys.executable, "-m", "ckpttool", *convert],
        "jobs3": [sys.executable, "-m", "ckpttool", *convert, "--jobs", "3"],
        "ranks2": [*_torchrun(2), *convert],
    }
    for name, command in runs.items():
        done = _run([*command, str(tmp_path / f"{name}.safetensors")])
        assert done.returncode == 0, (name, done.stderr)
    want = (tmp_path / "one.safetensors").read_bytes()
    assert (tmp_path / "jobs3.safetensors").read_bytes() == want
    assert (tmp_path / "ranks2.safetensors").read_bytes() == want
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_byte_range_that_reads_back_otherwise_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's share of one output file is checked after its fsync: each tensor's CRC-32
    read back against that of the bytes written. One byte changed on the way: refused."""
    from ckpttool.commands.convert import run, spread
    from ckpttool.commands.convert.options import ConversionOptions
    from ckpttool.commands.selection import Selection
    from ckpttool.errors import VerificationError

    dst = tmp_path / "out.safetensors"
    job = spread.Job(run.write_share, str(FIXTURES / "minimind/pretrain_32.pth"), str(dst),
                     Selection(), ConversionOptions(dtype="bf16"), run.write_range_share)  # fmt: skip
    with run._planned(job) as (ckpt, _, files, _):
        out = next(f for f in files if f.kind != "index")
        out.expected_size = spread.planned_size(out)
        path = tmp_path / "part"
        with open(path, "wb") as handle:
            handle.write(spread.header(out))
            handle.truncate(out.expected_size)
        bounds = (0, len(out.tensors))
        assert run.write_range(ckpt, out, bounds, path, job.options)  # the casts' counts
        stored = run._stored_bytes

        def changed(written: object, record: object) -> memoryview | None:
            data = stored(written, record)  # type: ignore[arg-type]
            if data is None or getattr(record, "key", "") != out.tensors[-1].name:
                return data
            flipped = bytearray(data)
            flipped[0] ^= 1
            return memoryview(flipped)

        monkeypatch.setattr(run, "_stored_bytes", changed)
        with pytest.raises(VerificationError, match=re.escape(out.tensors[-1].name)):
            run.write_range(ckpt, out, bounds, path, job.options)
