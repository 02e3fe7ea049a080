"""``ckpttool trend`` over a run's 10 MiniMind-512 checkpoints: its peak memory (and time).

    python -m bench.trend [--runs 3] [--checkpoints 10]

The run: MiniMind2-small (hidden 512, 8 layers, 26M parameters) trained for a few AdamW steps
on random tokens, saved after each by ckpttool's own ``save_checkpoint`` (resume files: the
fp32 model, AdamW's state, epoch and step; 312 MB each), into ``bench/data/trend_512/``
(built once: ``step_NN/pretrain_512_resume.pth``, kept; ``--force`` rebuilds). ``trend``
compares each consecutive pair's model, one tensor of two checkpoints at a time, so its peak
RSS should not grow with the number or the size of the checkpoints.

Rows (whole processes, :mod:`bench.harness`: medians of ``--runs`` interleaved runs, peak RSS
from ``wait4``): ``ckpttool trend`` of the run's files, ``--json``, and ``ckpttool diff`` of
the first and last checkpoints' models for scale. Target (issue #31): peak RSS at most 128 MB.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT, _log, _model
from bench.harness import measure_all, table

HIDDEN = 512
TARGET_MB = 128.0


def build_run(out_dir: Path, count: int = 10, *, force: bool = False) -> list[Path]:
    """``count`` resume files of one training run, one per step (built once, then kept)."""
    from ckpttool.train import save_checkpoint

    run = out_dir / f"trend_{HIDDEN}_{count}"
    files = [run / f"step_{i:02d}" / f"pretrain_{HIDDEN}_resume.pth" for i in range(1, count + 1)]
    if run.exists() and not force and all(path.exists() for path in files):
        return files
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{run.name}.", dir=out_dir))
    try:
        torch.manual_seed(0)
        model = _model(HIDDEN)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, count + 1):
            ids = torch.randint(0, 6400, (2, 32))
            optimizer.zero_grad()
            model(ids).float().mean().backward()
            optimizer.step()
            save_checkpoint(
                model, optimizer, save_dir=work / f"step_{step:02d}", weight="pretrain",
                hidden_size=HIDDEN, epoch=0, step=step, weights_dtype=None,
            )  # fmt: skip
            _log(f"trend run: step {step} of {count} saved")
        if run.exists():
            shutil.rmtree(run)
        work.rename(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return files


def _ckpttool(*argv: str) -> list[str]:
    """A ckpttool command whose output is dropped; exit 1 (found something) is a result."""
    command = [sys.executable, "-m", "ckpttool", *argv]
    return ["sh", "-c", '"$@" > /dev/null; test $? -le 1', "sh", *command]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trend", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild the run's checkpoints")
    args = parser.parse_args(argv)
    files = [str(path) for path in build_run(args.out, args.checkpoints, force=args.force)]
    size = sum(Path(path).stat().st_size for path in files) / 1e9
    print(
        f"\n### trend over {len(files)} MiniMind-{HIDDEN} resume files ({size:.2f} GB), "
        f"median of {args.runs} runs\n"
    )
    rows = {
        "ckpttool trend": _ckpttool("trend", *files),
        "ckpttool trend --json": _ckpttool("trend", "--json", *files),
        "ckpttool diff (first, last)": _ckpttool("diff", files[0], files[-1], "--section", "model"),
    }
    results = measure_all(rows, runs=args.runs, warmup=args.warmup)
    print(table(results, baseline="ckpttool trend"))
    peak = results["ckpttool trend"].median_peak_rss_mb
    print(f"\ntrend peak RSS: {peak:.1f} MB (target <= {TARGET_MB:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
