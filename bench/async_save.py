"""Benchmark ``save_checkpoint(..., async_save=True)``: how long the training loop is blocked.

    python -m bench.async_save [--runs 5]

In one process: MiniMind-768 (104M parameters, fp32) with AdamW state after one real step,
saved as MiniMind saves (fp16 weights file + resume file, ~1.45 GB together) with
``save_checkpoint``, synchronously and asynchronously, alternating. For the asynchronous save
the time the call blocks (tensors copied to CPU memory on the caller's thread) is measured, and
separately the time until :func:`ckpttool.wait_for_save` returns (the files durable). Medians
of ``--runs`` saves each.

Target (issue #32): the time the loop is blocked by an asynchronous save at most 0.3x a
synchronous save's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT, _model
from ckpttool import save_checkpoint, wait_for_save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.async_save", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = _model(768)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 6400, (1, 32))
    model(ids).float().mean().backward()
    optimizer.step()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="async_save.", dir=args.out))
    sync, blocked, durable = [], [], []
    try:
        for step in range(args.runs):
            start = time.perf_counter()
            save_checkpoint(model, optimizer, save_dir=work, weight="sync", hidden_size=768,
                            epoch=0, step=step)  # fmt: skip
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            save_checkpoint(model, optimizer, save_dir=work, weight="async", hidden_size=768,
                            epoch=0, step=step, async_save=True)  # fmt: skip
            blocked.append(time.perf_counter() - start)
            wait_for_save()
            durable.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s, b, d = (statistics.median(x) for x in (sync, blocked, durable))
    print(f"median of {args.runs} saves, MiniMind-768 with AdamW state\n")
    print("| save | median wall (s) | vs synchronous |")
    print("|---|---:|---:|")
    print(f"| synchronous save_checkpoint | {s:.3f} | 1.00x |")
    print(f"| async_save=True: the loop blocked | {b:.3f} | {b / s:.2f}x |")
    print(f"| async_save=True: until durable | {d:.3f} | {d / s:.2f}x |")
    print(f"\nblocked vs synchronous: {b / s:.2f}x (target <= 0.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
