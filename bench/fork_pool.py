"""``--jobs`` on threads or on a *fork* process pool, for scan and edit (issue 43).

Run from the repository root: ``python -m bench.fork_pool [--runs 7] [--out bench/data]``.
Builds (once) MiniMind-512's weights and resume files (:mod:`bench.build`), then:

* ``fork_scan16/``: 16 hard links of ``pretrain_512_resume.pth`` (a pickle walk each: Python
  holding the GIL, the case where processes could help);
* ``fork_many16/``: 16 hard links of a ``torch.save`` of 20,000 tiny tensors (a long walk);
* ``fork_hf16/``: the weights as a Hugging Face directory of 16 safetensors shards with their
  index and a ``config.json``.

and times, in this process, interleaved and repeated (medians), the library calls behind
``ckpttool scan DIR`` and ``ckpttool edit DIR --dtype bf16``: on 1 thread, on 2 threads
and on 2 forked processes (:func:`ckpttool.io.parallel.ordered_map`, ``processes=True``: the
work function is inherited by the fork, only the items' indices and the results cross the
pipe; the pool's start and end are timed). Nothing in the scan imports torch, so the fork is
what the CLI would do; edit's casts import NumPy, not torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SHARDS = 16
MANY = 20_000  # tensors in each file of fork_many16/


def mapped(function: Callable[[Any], Any], items: Sequence[Any], workers: int, forked: bool) -> Any:
    from ckpttool.io.parallel import _can_fork, ordered_map, using

    assert not forked or _can_fork()
    with using(workers):
        return ordered_map(function, items, processes=forked)


def build(out: Path) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file

    from bench.build import build_resume, build_weights

    resume, weights = build_resume(out, hidden=512), build_weights(out, hidden=512)
    scan_dir = out / "fork_scan16"
    if not scan_dir.is_dir():
        scan_dir.mkdir()
        for i in range(SHARDS):
            os.link(resume, scan_dir / f"resume_{i:02d}.pth")
    many_dir = out / "fork_many16"
    if not many_dir.is_dir():
        many = out / "fork_many.pth"
        torch.save({f"layers.{i}.weight": torch.zeros(4) for i in range(MANY)}, many)
        many_dir.mkdir()
        for i in range(SHARDS):
            os.link(many, many_dir / f"many_{i:02d}.pth")
    hf_dir = out / "fork_hf16"
    if not (hf_dir / "model.safetensors.index.json").is_file():
        state = torch.load(weights, weights_only=True)
        keys = list(state)
        per = -(-len(keys) // SHARDS)
        hf_dir.mkdir(exist_ok=True)
        weight_map = {}
        for i in range(SHARDS):
            name = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
            part = {k: state[k].contiguous() for k in keys[i * per : (i + 1) * per]}
            save_file(part, str(hf_dir / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
        (hf_dir / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    return scan_dir, hf_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.fork_pool", description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/data"))
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.build:
        build(args.out)
        return 0
    # built by a child: torch (and its threads) never loaded in this process, which forks
    subprocess.run(
        [sys.executable, "-m", "bench.fork_pool", "--build", "--out", args.out], check=True
    )
    scan_dir, hf_dir = args.out / "fork_scan16", args.out / "fork_hf16"

    from ckpttool.commands.edit import edit_file
    from ckpttool.commands.scan import scan_file

    assert "torch" not in sys.modules
    files = sorted(scan_dir.iterdir())
    many = sorted((args.out / "fork_many16").iterdir())
    shards = sorted(hf_dir.glob("*.safetensors"))
    scratch = Path(tempfile.mkdtemp(prefix="fork_pool", dir=args.out))

    def edit_one(shard: Path) -> Any:
        return edit_file(shard, scratch / shard.name, dtype="bf16", overwrite=True)

    work = {"scan": (scan_file, files), "scan20k": (scan_file, many), "edit": (edit_one, shards)}
    rows: dict[str, dict[str, list[float]]] = {task: {} for task in work}
    variants = {
        "1 thread": lambda f, items: mapped(f, items, 1, False),
        "2 threads": lambda f, items: mapped(f, items, 2, False),
        "fork pool, 2": lambda f, items: mapped(f, items, 2, True),
    }
    for _ in range(args.runs + 1):  # the first round warms the cache and is dropped
        for task, (function, items) in work.items():
            for name, variant in variants.items():
                start = time.perf_counter()
                variant(function, items)
                rows[task].setdefault(name, []).append(time.perf_counter() - start)
    shutil.rmtree(scratch)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, {args.runs} runs")
    for task, timings in rows.items():
        base = statistics.median(timings["1 thread"][1:])
        for name, values in timings.items():
            median = statistics.median(values[1:])
            print(f"{task:7} {name:13} {median:7.3f} s  {median / base:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
