"""`ckpttool diff` against the obvious script, on two MiniMind-768 resume checkpoints (~1.25 GB).

Run from the repository root: ``python -m bench.diff [--runs 3]``. Builds the pair if needed
(:func:`bench.build.build_resume_pair`) and prints two markdown tables: a pair that differs in
one element of one tensor, and two identical files (a byte copy). The baseline is the script
everyone writes first: ``torch.load`` both files, then ``torch.equal`` on every tensor.

Every command runs under ``sh -c '...; test $? -le 1'`` because ``ckpttool diff`` exits 1 when
the files differ (which the harness would take for a failure); the script gets the same wrapper
so both pay the same few milliseconds. Peak RSS is the largest of the shell and its child.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_resume_pair
from bench.harness import compare

# The obvious script: load everything, compare every tensor exactly.
SCRIPT = """
import sys, torch
def flat(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from flat(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from flat(value, f"{prefix}.{index}" if prefix else str(index))
mmap = sys.argv[3] == "mmap"
a = dict(flat(torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=mmap)))
b = dict(flat(torch.load(sys.argv[2], map_location="cpu", weights_only=True, mmap=mmap)))
differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])] + [k for k in b if k not in a]
print(len(a), "tensors,", len(differ), "differ:", differ)
sys.exit(1 if differ else 0)
"""


def _tolerating_exit_1(argv: list[str]) -> list[str]:
    return ["sh", "-c", '"$@"; test $? -le 1', "sh", *argv]


def _script(a: Path, b: Path, mode: str) -> list[str]:
    return _tolerating_exit_1([sys.executable, "-c", SCRIPT, str(a), str(b), mode])


def _ckpttool(a: Path, b: Path, *options: str) -> list[str]:
    return _tolerating_exit_1([sys.executable, "-m", "ckpttool", "diff", str(a), str(b), *options])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.diff", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    resume, copy, changed = build_resume_pair(args.out)
    size = resume.stat().st_size / 1e9
    for title, other in (("one tensor differs", changed), ("identical files", copy)):
        print(f"\n### diff of two {size:.2f} GB resume files: {title} ({other.name})\n")
        rows = {
            "script: torch.load + torch.equal": _script(resume, other, "full"),
            "script: torch.load(mmap=True) + torch.equal": _script(resume, other, "mmap"),
            "ckpttool diff": _ckpttool(resume, other),
            "ckpttool diff --quick": _ckpttool(resume, other, "--quick"),
        }
        print(compare(rows, "script: torch.load + torch.equal", runs=args.runs, warmup=args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
