"""`ckpttool show`, `convert`, `diff` and ``ckpttool.load_state_dict`` on a pickle of many small
Python objects (issues 20 and 40).

Run from the repository root: ``python -m bench.object_table [--runs 5] [--before DIR]``
(``DIR``: a checkout of ckpttool to measure beside this one, as extra rows). Builds (once)
``bench/data/object_table/lookup.pth``: ``torch.save`` of ``{"model": 10 fp32 tensors of
512 x 512, "lookup": a dict of 150,000 entries, "step": 10}``, each entry of the lookup table a
``(int, float, str)`` tuple or a ``{"id": int, "freq": float, "pos": (str, int)}`` dict (an
18 MB file whose ``data.pkl`` is 8 MB: the shape of a real checkpoint carrying a tokenizer's or
a dataset's lookup table beside its weights). Then measures, interleaved (:mod:`bench.harness`),
``ckpttool show`` (table and ``--json``), ``ckpttool convert`` (its 10 weights to safetensors),
``ckpttool.load_state_dict`` and ``ckpttool diff`` of the file with itself against:

* the floor: the C ``pickle.Unpickler`` over the same ``data.pkl`` with torch's classes stubbed
  (``find_class`` returns a stub class, ``persistent_load`` the id), nothing imported from torch
  (as ``bench.tensor_count``'s); for ``diff``, which reads both sides, twice in one process;
* ``torch.load(weights_only=False)`` (the table's objects are plain data; ``weights_only=True``
  reads it too), and the start-up every click + tabulate command pays, for scale;
* for ``load_state_dict``, which returns torch tensors and so imports torch, also the floor
  with ``import torch`` first.

Besides the harness's wall-time tables, each command's CPU time (user + system, from
``getrusage`` of the children, median of the same number of interleaved runs): on a shared VM
wall time swings with the neighbours' load, CPU time much less.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.build import DEFAULT_OUT
from bench.diff import _tolerating_exit_1
from bench.harness import compare

ENTRIES = 150_000

# bench.tensor_count's floor, reading data.pkl argv[2] times in one process
FLOOR = """
import pickle, sys, zipfile
class Stub(dict):
    def __init__(self, *args, **kwargs):
        pass
    def __setstate__(self, state):
        pass
class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return Stub
    def persistent_load(self, pid):
        return pid
for _ in range(int(sys.argv[2])):
    with zipfile.ZipFile(sys.argv[1]) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        with archive.open(name) as f:
            Unpickler(f).load()
"""

LOAD_STATE_DICT = """
import sys, ckpttool
ckpttool.load_state_dict(sys.argv[1])
"""

TORCH_LOAD = """
import sys, torch
torch.load(sys.argv[1], map_location="cpu", weights_only=False)
"""


def build_lookup(out_dir: Path) -> Path:
    """``object_table/lookup.pth`` (kept if it exists; written to ``.tmp`` and renamed)."""
    import torch

    path = out_dir / "object_table" / "lookup.pth"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {path} ...", file=sys.stderr, flush=True)
    numbers = random.Random(0)
    lookup: dict[str, object] = {}
    for i in range(ENTRIES):
        if i % 2:
            lookup[f"tok{i}"] = {"id": i, "freq": numbers.random(), "pos": ("NN", i % 7)}
        else:
            lookup[f"tok{i}"] = (i, numbers.random(), f"w{i % 1000}")
    generator = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(512, 512, generator=generator) for i in range(10)}
    temp = path.with_name(path.name + ".tmp")
    torch.save({"model": model, "lookup": lookup, "step": 10}, temp)
    temp.rename(path)
    return path


def cpu_table(rows: Mapping[str, Sequence[str]], baseline: str, runs: int) -> str:
    """Median CPU seconds (user + system) of each command over ``runs`` interleaved runs."""
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(runs):
        for name, cmd in rows.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            samples[name].append(
                after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            )
    medians = {name: statistics.median(values) for name, values in samples.items()}
    lines = ["| command | median CPU (s) | CPU vs baseline |", "|---|---:|---:|"]
    lines += [
        f"| {name} | {cpu:.2f} | {cpu / medians[baseline]:.2f}x |" for name, cpu in medians.items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.object_table", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--before", type=Path, help="a ckpttool checkout to measure too")
    args = parser.parse_args(argv)
    path = build_lookup(args.out)
    converted = path.with_name("lookup.converted.safetensors")
    floor = [sys.executable, "-c", FLOOR, str(path)]
    print(f"### show: {path.name} ({path.stat().st_size / 1e6:.0f} MB, {ENTRIES:,} entries)\n")
    rows = {
        "C unpickler, stubs (floor)": [*floor, "1"],
        "C unpickler, stubs, after import torch": [
            sys.executable, "-c", "import torch\n" + FLOOR, str(path), "1"
        ],
        "torch.load(weights_only=False)": [sys.executable, "-c", TORCH_LOAD, str(path)],
        "python: import click, tabulate": [sys.executable, "-c", "import click, tabulate"],
    }  # fmt: skip
    checkouts = {"": None} if args.before is None else {"": None, " (before)": args.before}
    for suffix, checkout in checkouts.items():
        python = [sys.executable] if checkout is None else [
            "env", f"PYTHONPATH={checkout.resolve()}", sys.executable, "-P"
        ]  # fmt: skip
        rows.update({
            f"ckpttool show{suffix}": [*python, "-m", "ckpttool", "show", str(path)],
            f"ckpttool show --json{suffix}": [*python, "-m", "ckpttool", "show", "--json", str(path)],
            f"ckpttool convert{suffix}": [
                *python, "-m", "ckpttool", "convert", str(path), str(converted), "--force"
            ],
            f"ckpttool.load_state_dict{suffix}": [*python, "-c", LOAD_STATE_DICT, str(path)],
        })  # fmt: skip
    print(compare(rows, baseline="C unpickler, stubs (floor)", runs=args.runs))
    print()
    print(cpu_table(rows, "C unpickler, stubs (floor)", args.runs))
    print("\n### diff of the file with itself\n")
    rows = {
        "C unpickler, stubs, both sides (floor)": [*floor, "2"],
        "ckpttool diff": _tolerating_exit_1(
            [sys.executable, "-m", "ckpttool", "diff", str(path), str(path)]
        ),
    }
    print(compare(rows, baseline="C unpickler, stubs, both sides (floor)", runs=args.runs))
    print()
    print(cpu_table(rows, "C unpickler, stubs, both sides (floor)", args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
