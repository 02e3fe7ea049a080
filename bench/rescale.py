"""Benchmark ``ckpttool rescale-step`` on MiniMind-768's resume file (~1.25 GB).

    python -m bench.rescale [--runs 3] [--warmup 1] [--keep]

Rows, each writing to its own output in the same directory (``-o``), interleaved by
:mod:`bench.harness` (warm page cache, medians):

* ``cp`` copies the file: the floor for writing 1.25 GB, without durability.
* ``cp + sync`` adds ``sync FILE`` (an fsync): the floor for a copy that survives a power loss,
  which ckpttool's atomic write guarantees (temp file, fsync, rename, fsync of the directory).
* ``python start-up`` is ``python -m ckpttool --version``: interpreter and CLI import, no work.
* ``naive torch.load/save`` is the usual script: load everything, edit two ints, save.
* ``ckpttool rescale-step`` splices the pickle and copies every record in the kernel.

Targets (issue #6): peak RSS at most a quarter of the naive script's; wall time within 2x of
``cp`` plus start-up. Outputs are deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_resume
from bench.harness import measure_all, table

NAIVE = """
import sys, torch
source, target, world_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
ckpt = torch.load(source, map_location="cpu", weights_only=False)
ckpt["step"] = ckpt["step"] * ckpt["world_size"] // world_size
ckpt["world_size"] = world_size
torch.save(ckpt, target)
"""


def rows(source: Path, out_dir: Path, world_size: int = 2) -> dict[str, list[str]]:
    ckpttool = [sys.executable, "-m", "ckpttool"]
    out = {name: str(out_dir / f"rescale_{name}.pth") for name in ("cp", "sync", "naive", "tool")}
    return {
        "cp": ["cp", str(source), out["cp"]],
        "cp + sync": ["sh", "-c", f'cp "{source}" "{out["sync"]}" && sync "{out["sync"]}"'],
        "python start-up": [*ckpttool, "--version"],
        "naive torch.load/save": [
            sys.executable,
            "-c",
            NAIVE,
            str(source),
            out["naive"],
            str(world_size),
        ],
        "ckpttool rescale-step": [
            *ckpttool,
            "rescale-step",
            str(source),
            "--world-size",
            str(world_size),
            "-o",
            out["tool"],
            "--force",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rescale", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the rescaled outputs")
    args = parser.parse_args(argv)
    source = build_resume(args.out)
    commands = rows(source, args.out)
    try:
        results = measure_all(commands, runs=args.runs, warmup=args.warmup)
    finally:
        if not args.keep:
            for path in args.out.glob("rescale_*.pth"):
                path.unlink()
    print(f"{source.name}: {source.stat().st_size / 1e9:.2f} GB, median of {args.runs} runs\n")
    print(table(results, baseline="cp"))
    tool = results["ckpttool rescale-step"]
    naive = results["naive torch.load/save"]
    floor = results["cp"].median_wall_s + results["python start-up"].median_wall_s
    durable = results["cp + sync"].median_wall_s + results["python start-up"].median_wall_s
    print(
        f"\npeak RSS vs naive: {tool.median_peak_rss_mb / naive.median_peak_rss_mb:.3f} "
        f"(target <= 0.25)\nwall vs cp + start-up: {tool.median_wall_s / floor:.2f}x "
        f"(target <= 2); vs cp + sync + start-up: {tool.median_wall_s / durable:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
