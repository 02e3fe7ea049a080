"""`ckpttool show` against torch.load, on a MiniMind-768 resume checkpoint (~1.25 GB).

Run from the repository root: ``python -m bench.show [--runs 5]``. Prints two markdown tables:
show vs ``torch.load(weights_only=True, mmap=True)`` vs a full ``torch.load`` (with the bare
cost of starting Python and importing click and tabulate, which every run of a click command
pays, for scale), and show on the weights file vs the same tensors 4x larger (listing time
should not grow with file size).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_resume, build_scaled_weights, build_weights
from bench.harness import compare


def _torch_load(path: Path, mmap: bool) -> list[str]:
    code = f"import torch; torch.load({str(path)!r}, weights_only=True, mmap={mmap})"
    return [sys.executable, "-c", code]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    resume = build_resume(args.out)
    weights = build_weights(args.out)
    scaled = build_scaled_weights(args.out, 4)
    show = [sys.executable, "-m", "ckpttool", "show"]
    print(f"### show vs torch.load ({resume.name}, {resume.stat().st_size / 1e9:.2f} GB)\n")
    rows = {
        "torch.load (full)": _torch_load(resume, mmap=False),
        "torch.load (mmap)": _torch_load(resume, mmap=True),
        "ckpttool show": [*show, str(resume)],
        # the floor under any click + tabulate command on this machine, for scale
        "python: import click, tabulate": [sys.executable, "-c", "import click, tabulate"],
    }
    print(compare(rows, baseline="torch.load (mmap)", runs=args.runs))
    print(f"\n### show: flat with file size ({weights.name} vs {scaled.name})\n")
    rows = {
        f"show {weights.name} ({weights.stat().st_size / 1e6:.0f} MB)": [*show, str(weights)],
        f"show {scaled.name} ({scaled.stat().st_size / 1e6:.0f} MB)": [*show, str(scaled)],
    }
    print(compare(rows, baseline=next(iter(rows)), runs=args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
