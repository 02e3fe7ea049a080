"""Benchmark ``ckpttool average`` of 5 MiniMind-768 resume files (1.25 GB each) against
fairseq's ``average_checkpoints.py`` algorithm on the same files.

    python -m bench.average [--runs 3] [--warmup 1] [--other DIR] [--keep]

The inputs (``bench/data/average_768_resume_{0..4}.pth``, built once from
``pretrain_768_resume.pth``) are the resume file with every model tensor moved by its own
noise (``N(0, 1e-3)``, seeded per file) and ``step`` 1000, 2000, ... 5000. Rows, interleaved by
:mod:`bench.harness` (warm page cache, medians):

* ``python start-up``: ``python -m ckpttool --version``, the floor of the ckpttool rows.
* ``fairseq average_checkpoints``: :mod:`bench.fairseq_average` (each file loaded whole, the
  model's tensors summed and divided, the first file's state written with the averaged model).
* ``ckpttool average``: the same 5 files to a ``.pth`` of the averaged model, float64
  accumulation, one tensor of each input at a time, the output read back.
* with ``--other DIR``: ``ckpttool average`` run from the ckpttool checkout in DIR (e.g.
  ``git archive BRANCH | tar -x -C DIR``), to measure another revision on the same inputs.

Targets (issue 44): at most 0.5x fairseq's wall time and 0.1x its peak RSS. Outputs are
deleted afterwards; the inputs too unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT, build_resume
from bench.harness import measure_all, table

COUNT = 5


def build_inputs(out_dir: Path, count: int = COUNT) -> list[Path]:
    """``average_768_resume_{i}.pth``: the resume file, its model moved by seeded noise."""
    source = build_resume(out_dir)
    paths = []
    for index in range(count):
        path = out_dir / f"average_768_resume_{index}.pth"
        paths.append(path)
        if path.exists():
            continue
        state = torch.load(source, map_location="cpu", mmap=True, weights_only=True)
        generator = torch.Generator().manual_seed(index)
        moved: dict[tuple[int, int], torch.Tensor] = {}  # tied tensors (lm_head) stay tied
        for name, value in state["model"].items():
            if value.is_floating_point():
                tie = (value.untyped_storage().data_ptr(), value.storage_offset())
                if tie not in moved:
                    moved[tie] = value + torch.randn(value.shape, generator=generator) * 1e-3
                state["model"][name] = moved[tie]
        state["step"] = 1000 * (index + 1)
        tmp = Path(f"{path}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)", file=sys.stderr, flush=True)
    return paths


def rows(inputs: list[Path], out_dir: Path, other: Path | None) -> dict[str, list[str]]:
    python = sys.executable
    names = [str(p) for p in inputs]
    ours = ["-m", "ckpttool", "average", *names, "--force", "-o"]
    table_rows = {
        "python start-up": [python, "-m", "ckpttool", "--version"],
        "fairseq average_checkpoints": [
            python, "-m", "bench.fairseq_average", "--inputs", *names,
            "--output", str(out_dir / "average_fairseq.pt"),
        ],
        "ckpttool average": [python, *ours, str(out_dir / "average_ckpttool.pth")],
    }  # fmt: skip
    if other is not None:
        table_rows[f"ckpttool average ({other.name})"] = [
            "env", f"PYTHONPATH={other}", python, "-P", *ours, str(out_dir / "average_other.pth")
        ]  # fmt: skip
    return table_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.average", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--other", type=Path, help="also run the ckpttool checkout in DIR")
    parser.add_argument("--keep", action="store_true", help="keep the 5 input files")
    args = parser.parse_args(argv)
    inputs = build_inputs(args.out)
    other = args.other.resolve() if args.other else None
    size = sum(p.stat().st_size for p in inputs) / 1e9
    try:
        results = measure_all(rows(inputs, args.out, other), runs=args.runs, warmup=args.warmup)
    finally:
        for name in ("average_fairseq.pt", "average_ckpttool.pth", "average_other.pth"):
            (args.out / name).unlink(missing_ok=True)
        if not args.keep:
            for path in inputs:
                path.unlink(missing_ok=True)
    print(f"{COUNT} resume files ({size:.2f} GB), median of {args.runs} runs\n")
    print(table(results, baseline="fairseq average_checkpoints"))
    for name, result in results.items():
        if name.startswith("ckpttool average"):
            fairseq = results["fairseq average_checkpoints"]
            print(
                f"\n{name}: wall vs fairseq {result.median_wall_s / fairseq.median_wall_s:.2f}x "
                f"(target <= 0.5); peak RSS vs fairseq "
                f"{result.median_peak_rss_mb / fairseq.median_peak_rss_mb:.3f}x (target <= 0.1)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
