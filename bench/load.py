"""Benchmark ``ckpttool.open`` and ``ckpttool.load_state_dict`` on MiniMind-768's resume file
(~1.25 GB) against ``torch.load``.

    python -m bench.load [--runs 5] [--warmup 1]

Rows, interleaved by :mod:`bench.harness` (warm page cache, medians, whole processes with their
imports), in two groups:

* one tensor: ``torch.load(mmap=True, weights_only=True)["model"][KEY]`` against
  ``ckpttool.open(PATH).get_tensor("model." + KEY)``, each summing the tensor (its pages read);
* the model's weights: ``torch.load(weights_only=True)["model"]`` against
  ``ckpttool.load_state_dict(PATH)``, each summing every tensor (every page of the model read:
  a memory map counts in RSS once touched).

Targets (issue #32): one tensor at most 0.5x torch's wall time; the model's weights at most
1x its wall time and 0.5x its peak RSS. The one-tensor group also times ``python -c "import
torch"`` alone: the floor of both processes, since a function that returns a ``torch.Tensor``
imports torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_resume
from bench.harness import measure_all, table

KEY = "model.layers.3.mlp.down_proj.weight"

TORCH_ONE = """
import sys, torch
tensor = torch.load(sys.argv[1], mmap=True, weights_only=True)["model"][sys.argv[2]]
print(float(tensor.sum()))
"""
TOOL_ONE = """
import sys, ckpttool
with ckpttool.open(sys.argv[1]) as ckpt:
    tensor = ckpt.get_tensor("model." + sys.argv[2])
print(float(tensor.sum()))
"""
TORCH_MODEL = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=True)["model"]
print(sum(float(t.sum()) for t in model.values()))
"""
TOOL_MODEL = """
import sys, ckpttool
model = ckpttool.load_state_dict(sys.argv[1])
print(sum(float(t.sum()) for t in model.values()))
"""


FLOOR = "python -c 'import torch' (the floor)"


def rows(source: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    def run(code: str, *args: str) -> list[str]:
        return [sys.executable, "-c", code, str(source), *args]

    one = {
        "torch.load(mmap=True)[...][key]": run(TORCH_ONE, KEY),
        "ckpttool.open().get_tensor(key)": run(TOOL_ONE, KEY),
        # the floor of both: a function returning a torch.Tensor imports torch
        FLOOR: [sys.executable, "-c", "import torch"],
    }
    model = {
        'torch.load(weights_only=True)["model"]': run(TORCH_MODEL),
        "ckpttool.load_state_dict()": run(TOOL_MODEL),
    }
    return one, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    source = build_resume(args.out)
    one, model = rows(source)
    print(f"{source.name}: {source.stat().st_size / 1e9:.2f} GB, median of {args.runs} runs\n")
    for group, baseline in ((one, next(iter(one))), (model, next(iter(model)))):
        results = measure_all(group, runs=args.runs, warmup=args.warmup)
        print(table(results, baseline=baseline))
        base, tool = (results[name] for name in list(group)[:2])
        print(
            f"\nwall: {tool.median_wall_s / base.median_wall_s:.2f}x, peak RSS: "
            f"{tool.median_peak_rss_mb / base.median_peak_rss_mb:.2f}x"
        )
        if FLOOR in results:
            floor = results[FLOOR].median_wall_s
            print(
                f"import torch alone: {floor / base.median_wall_s:.2f}x of torch's process; "
                f"after it, ckpttool's process takes {tool.median_wall_s - floor:.3f} s and "
                f"torch's {base.median_wall_s - floor:.3f} s"
            )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
