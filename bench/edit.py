"""Benchmark ``ckpttool edit --for-inference`` on MiniMind-768's resume file (~1.25 GB).

    python -m bench.edit [--runs 5] [--warmup 1] [--keep]

Rows, interleaved by :mod:`bench.harness` (warm page cache, medians), each writing its own
output in the same directory:

* ``naive torch.load/save`` is the script users write: load everything, delete the optimizer
  and the scaler, save what is left.
* ``ckpttool edit --for-inference`` drops the same parts without loading a tensor: the kept
  storages are copied by the kernel, the output fsynced and read back.

Targets (issue #30): wall time at most 0.5x the naive script's, peak RSS at most 0.1x.
Outputs are deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_resume
from bench.harness import measure_all, table

NAIVE = """
import sys, torch
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
for key in ("optimizer", "scaler"):
    ckpt.pop(key, None)
torch.save(ckpt, sys.argv[2])
"""


def rows(source: Path, out_dir: Path) -> dict[str, list[str]]:
    naive, tool = (str(out_dir / f"edit_{name}.pth") for name in ("naive", "tool"))
    return {
        "naive torch.load/save": [sys.executable, "-c", NAIVE, str(source), naive],
        "ckpttool edit --for-inference": [
            sys.executable, "-m", "ckpttool", "edit", str(source), "--for-inference",
            "-o", tool, "--force",
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.edit", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    args = parser.parse_args(argv)
    source = build_resume(args.out)
    try:
        results = measure_all(rows(source, args.out), runs=args.runs, warmup=args.warmup)
    finally:
        if not args.keep:
            for path in args.out.glob("edit_*.pth"):
                path.unlink()
    print(f"{source.name}: {source.stat().st_size / 1e9:.2f} GB, median of {args.runs} runs\n")
    print(table(results, baseline="naive torch.load/save"))
    tool, naive = results["ckpttool edit --for-inference"], results["naive torch.load/save"]
    print(
        f"\nwall vs naive: {tool.median_wall_s / naive.median_wall_s:.2f}x (target <= 0.5); "
        f"peak RSS vs naive: {tool.median_peak_rss_mb / naive.median_peak_rss_mb:.3f}x "
        "(target <= 0.1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
