"""Scale up and out (issue 43): ``convert --jobs N`` of a 16-shard 2 GB directory with a bf16
cast, and ``verify`` / ``convert`` of the MiniMind-768 files against ``cat`` and ``cp`` + ``sync``.

Run from the repository root (warm page cache: every file is read once before the runs)::

    python -m bench.scale [--runs 5] [--torchrun] [--only scale|floors] [--clean]

(a) ``bench/data/scale_hf16/``: a Hugging Face safetensors directory of 16 fp32 shards
(``model-000NN-of-00016.safetensors`` + ``model.safetensors.index.json``, 2.1 GB, 64 tensors of
random normal values) converted to bf16 safetensors with ``--jobs 1, 2, 4``: wall time and peak
RSS (``bench.harness``: the largest single process of the tree, so per process for a pool),
the outputs compared byte for byte, and the throughput per process. ``--torchrun`` adds
``torchrun --nproc-per-node R -m ckpttool convert ...`` for R = 1, 2, 4 (issue 43 item 2: run
it only where that support is in; on code without it every rank would convert the whole
directory to the same output). The projection for 64 ranks is printed with its assumptions.

(b) ``verify`` of ``pretrain_768_resume.pth`` (1.25 GB) against ``cat FILE > /dev/null`` and
``convert`` of ``pretrain_768.pth`` (218 MB fp16) to safetensors against ``cp`` + ``sync``,
each with ckpttool's start-up (``ckpttool --version``) as a row.

``--clean`` deletes the 2.1 GB directory and the outputs when done.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.build import build_resume, build_weights
from bench.harness import compare, measure_all, table

DATA = Path("bench/data")
SHARDS = 16
TENSORS_PER_SHARD = 4
ELEMENTS = 8_388_608  # fp32 values per tensor: 32 MiB; 64 of them, 2.15 GB
#: The projection's assumptions (printed with it): a checkpoint of 1 TB (10^12 bytes) of fp32
#: cast to bf16 by 64 ranks on 8 nodes, reading from and writing to a shared file system whose
#: aggregate bandwidth is this (bytes/s, read and write together), e.g. a Lustre or GPFS
#: scratch file system of a mid-sized cluster.
SHARED_FS_BYTES_PER_S = 20e9
PROJECTED_BYTES, PROJECTED_RANKS, PROJECTED_NODES = 1e12, 64, 8


def _ckpttool(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *(str(arg) for arg in args)]


def _sh(script: str, *args: object) -> list[str]:
    return ["sh", "-c", script, "sh", *(str(arg) for arg in args)]


def build_shards(out_dir: Path) -> Path:
    """``out_dir/scale_hf16``: 16 fp32 safetensors shards and their index (built once)."""
    import numpy as np
    from safetensors.numpy import save_file

    target = out_dir / "scale_hf16"
    index_path = target / "model.safetensors.index.json"
    if index_path.is_file():
        return target
    print(f"building {target} ...", file=sys.stderr, flush=True)
    target.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(43)
    weight_map = {}
    for shard in range(SHARDS):
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {}
        for number in range(TENSORS_PER_SHARD):
            key = f"model.layers.{shard}.block.{number}.weight"
            tensors[key] = rng.standard_normal(ELEMENTS, dtype=np.float32).reshape(4096, -1)
            weight_map[key] = name
        save_file(tensors, str(target / name))
    total = sum(p.stat().st_size for p in target.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path.write_text(json.dumps(index, indent=2))
    return target


def _warm(*paths: Path) -> None:
    """Read every file once so that each run finds it in the page cache."""
    for path in paths:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in files:
            if file.is_file():
                subprocess.run(["cat", str(file)], stdout=subprocess.DEVNULL, check=True)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / name, b / name, shallow=False) for name in names
    )


def scale(
    runs: int,
    warmup: int,
    torchrun: bool,
    counts: tuple[int, ...] = (1, 2, 4),
    shard_size: str | None = None,
) -> None:
    """``shard_size``: convert's ``--max-shard-size`` (the output in several files, each a
    unit of its own), else convert's default (one 1.07 GB file, split by byte range)."""
    source = build_shards(DATA)
    sharding = ["--max-shard-size", shard_size] if shard_size else []
    _warm(source)
    read = _size(source)
    rows: dict[str, list[str]] = {}
    outputs = {}
    for jobs in counts:
        outputs[f"--jobs {jobs}"] = DATA / f"scale_bf16_j{jobs}"
        rows[f"convert --dtype bf16 --jobs {jobs}"] = _ckpttool(
            "convert", source, outputs[f"--jobs {jobs}"], "--dtype", "bf16", "--jobs", jobs,
            "--force", *sharding,
        )  # fmt: skip
    if torchrun:
        for ranks in counts:
            outputs[f"torchrun {ranks}"] = DATA / f"scale_bf16_r{ranks}"
            rows[f"torchrun --nproc-per-node {ranks} convert --dtype bf16"] = [
                "torchrun", "--standalone", f"--nproc-per-node={ranks}", "-m", "ckpttool",
                "convert", str(source), str(outputs[f"torchrun {ranks}"]), "--dtype", "bf16",
                "--force", *sharding,
            ]  # fmt: skip
    rows["start-up floor (ckpttool --version)"] = _ckpttool("--version")
    # the disk's part: the bytes convert writes (its first output), copied and synced
    first = DATA / ("scale_bf16_first_sharded" if shard_size else "scale_bf16_first")
    if not first.is_dir():
        command = _ckpttool("convert", source, first, "--dtype", "bf16", *sharding)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    rows["write floor (cp -r of the bf16 output + sync)"] = _sh(
        'rm -rf "$2" && cp -r "$1" "$2" && sync -f "$2"', first, DATA / "scale_bf16_cp"
    )
    baseline = "convert --dtype bf16 --jobs 1"
    results = measure_all(rows, runs=runs, warmup=warmup)
    into = f", into files of at most {shard_size}" if shard_size else ", into one file"
    print(
        f"\n#### `convert` of scale_hf16/ ({read / 1e9:.2f} GB, {SHARDS} fp32 shards) to bf16{into}\n"
    )
    print(table(results, baseline))
    reference = outputs["--jobs 1"]
    print()
    for name, output in outputs.items():
        same = "identical to" if _same_tree(output, reference) else "DIFFERS from"
        print(f"- output of {name}: {same} `--jobs 1`'s ({_size(output) / 1e9:.2f} GB)")
    print()
    for name, result in results.items():
        if not name.startswith(("convert", "torchrun")):
            continue
        processes = int(name.split()[-1]) if "--jobs" in name else int(name.split()[2])
        rate = read / result.median_wall_s
        print(
            f"- {name}: {rate / 1e9:.2f} GB/s read, {rate / processes / 1e9:.2f} GB/s per process"
        )
    per_process = read / results[baseline].median_wall_s
    _projection(per_process)


def _projection(per_process: float) -> None:
    """64 ranks on 8 nodes converting 1 TB, from one process's measured rate."""
    compute = PROJECTED_BYTES / (PROJECTED_RANKS * per_process)
    moved = PROJECTED_BYTES * 1.5  # read fp32, write bf16 (half); the read-back is cached
    storage = moved / SHARED_FS_BYTES_PER_S
    print(
        f"\nProjection: {PROJECTED_BYTES / 1e12:.0f} TB of fp32 to bf16 on {PROJECTED_RANKS} "
        f"ranks ({PROJECTED_NODES} nodes), each at the {per_process / 1e9:.2f} GB/s of one "
        f"process here: {compute:.0f} s of CPU work per rank; the shared file system moves "
        f"{moved / 1e12:.1f} TB at {SHARED_FS_BYTES_PER_S / 1e9:.0f} GB/s in {storage:.0f} s: "
        f"about {max(compute, storage):.0f} s, bound by "
        f"{'the file system' if storage > compute else 'the CPUs'}."
    )


def floors(runs: int, warmup: int) -> None:
    weights, resume = build_weights(DATA), build_resume(DATA)
    work = DATA / "scale_floors"
    work.mkdir(exist_ok=True)
    _warm(weights, resume)
    print(f"\n#### `verify` of {resume.name} ({resume.stat().st_size / 1e9:.2f} GB)\n")
    print(compare({
        "cat FILE > /dev/null": _sh('cat "$1" > /dev/null', resume),
        "ckpttool verify": _ckpttool("verify", resume),
        "ckpttool verify --jobs 1": _ckpttool("verify", resume, "--jobs", 1),
        "start-up floor (ckpttool --version)": _ckpttool("--version"),
    }, "cat FILE > /dev/null", runs=runs, warmup=warmup))  # fmt: skip
    print(
        f"\n#### `convert` of {weights.name} ({weights.stat().st_size / 1e6:.0f} MB) to safetensors\n"
    )
    print(compare({
        "cp + sync": _sh('cp "$1" "$2" && sync "$2"', weights, work / "weights_cp.bin"),
        "ckpttool convert": _ckpttool("convert", weights, work / "weights.safetensors", "--force"),
        "start-up floor (ckpttool --version)": _ckpttool("--version"),
    }, "cp + sync", runs=runs, warmup=warmup))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--torchrun", action="store_true", help="also torchrun with --counts ranks")
    parser.add_argument("--only", choices=["scale", "floors"])
    parser.add_argument(
        "--counts", default="1,2,4", help="the --jobs and rank counts of (a), e.g. 1,2,4,8"
    )
    parser.add_argument(
        "--max-shard-size", help="(a): convert into files of at most this size (e.g. 70MB)"
    )
    parser.add_argument("--clean", action="store_true", help="delete the 2 GB data when done")
    args = parser.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        if args.only in (None, "floors"):
            floors(args.runs, args.warmup)
        if args.only in (None, "scale"):
            counts = tuple(int(count) for count in args.counts.split(","))
            scale(args.runs, args.warmup, args.torchrun, counts, args.max_shard_size)
    finally:
        print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.clean:
            for path in [DATA / "scale_hf16", DATA / "scale_floors", *DATA.glob("scale_bf16_*")]:
                shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
