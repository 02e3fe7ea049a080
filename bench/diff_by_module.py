"""`ckpttool diff --by-module` against plain `ckpttool diff`, on MiniMind-768 resume files (~1.25 GB).

Run from the repository root: ``python -m bench.diff_by_module [--runs 3]``. The change
measures (rel change, cosine, changed fraction) ride diff's one streamed pass; ``--by-module``
adds the norms of the tensors that are identical (their ‖A‖ weighs in their group's sums), so
it costs about the same when every tensor changed (a fine-tune: ``_tuned``, every float
tensor of the resume file scaled by 1.001) and more when almost nothing did (``_changed``: one
element of one tensor), where plain ``diff`` decodes nothing but that tensor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT, _save, _skip, build_resume_pair
from bench.harness import compare


def build_tuned(resume: Path, force: bool = False) -> Path:
    """The resume file with every floating tensor scaled by 1.001 (mmap, copy-on-write)."""
    tuned = resume.with_name(resume.stem + "_tuned.pth")
    if _skip(tuned, force):
        return tuned
    ckpt = torch.load(resume, map_location="cpu", mmap=True, weights_only=True)

    def scale(node: object) -> None:
        if isinstance(node, torch.Tensor) and node.is_floating_point():
            node.mul_(1.001)
        elif isinstance(node, dict):
            for value in node.values():
                scale(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                scale(value)

    scale(ckpt)
    _save(ckpt, tuned)
    return tuned


def _ckpttool(a: Path, b: Path, *options: str, tree: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "ckpttool", "diff", str(a), str(b), *options]
    if tree is not None:  # another checkout's ckpttool (--before); -P: not the one in the
        # working directory, which ``-m`` would put ahead of PYTHONPATH
        argv = ["env", f"PYTHONPATH={tree}", sys.executable, "-P", *argv[1:]]
    return ["sh", "-c", '"$@" > /dev/null; test $? -le 1', "sh", *argv]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.diff_by_module", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--before", type=Path, metavar="DIR",
        help="also time the diff of a checkout without the measures (DIR holds its ckpttool/: "
        "git archive COMMIT ckpttool | tar -x -C DIR)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    resume, _, changed = build_resume_pair(args.out)
    tuned = build_tuned(resume)
    size = resume.stat().st_size / 1e9
    for title, other in (("every tensor changed", tuned), ("one tensor differs", changed)):
        print(f"\n### diff of two {size:.2f} GB resume files: {title} ({other.name})\n")
        rows = {
            **(
                {"diff before the measures": _ckpttool(resume, other, tree=args.before)}
                if args.before
                else {}
            ),
            "ckpttool diff": _ckpttool(resume, other),
            "ckpttool diff --by-module": _ckpttool(resume, other, "--by-module"),
        }
        print(compare(rows, "ckpttool diff", runs=args.runs, warmup=args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
