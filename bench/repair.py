"""Benchmark ``ckpttool repair`` on MiniMind-768's resume file (~1.25 GB) cut at 60%.

    python -m bench.repair [--runs 5] [--warmup 1] [--fraction 0.6] [--keep]

No other tool repairs such a file (the advice everywhere is "re-download" or "resume from the
previous one"), so the floor is copying the same bytes. Rows, interleaved by
:mod:`bench.harness` (warm page cache, medians), each writing its own output:

* ``cp`` copies the cut file: the floor for writing those bytes, without durability.
* ``cp + sync`` adds ``sync FILE`` (an fsync): what ckpttool's atomic, durable write promises.
* ``python start-up`` is ``python -m ckpttool --version``: interpreter and CLI import, no work.
* ``ckpttool repair --dry-run`` walks the records and checks every CRC-32: the diagnosis alone.
* ``ckpttool repair`` diagnoses, writes the salvaged archive (storages copied in the kernel),
  fsyncs it and reads every tensor back against the source's bytes.

Targets (issue #27): wall time within 2x of ``cp``; peak RSS at most 64 MB, not growing with
the file. Outputs are deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_resume
from bench.harness import measure_all, table

RSS_TARGET_MB = 64


def cut_file(source: Path, fraction: float) -> Path:
    """``source``'s first ``fraction`` of bytes, as a file beside it (kept between runs)."""
    cut = source.with_name(f"{source.stem}_cut{round(fraction * 100)}{source.suffix}")
    length = int(source.stat().st_size * fraction)
    if not cut.exists() or cut.stat().st_size != length:
        tmp = cut.with_suffix(".tmp")
        with open(source, "rb") as src, open(tmp, "wb") as out:
            remaining = length
            while remaining:
                chunk = src.read(min(remaining, 64 << 20))
                out.write(chunk)
                remaining -= len(chunk)
        tmp.replace(cut)
    return cut


def _exiting_1(argv: list[str]) -> list[str]:
    """``argv`` run by ``sh``, which fails unless it exits 1: the cut file lost tensors, and
    ``repair`` says so with exit 1 (a bench of the wrong outcome would mean nothing)."""
    return ["sh", "-c", '"$@"; test $? -eq 1', "sh", *argv]


def rows(cut: Path, out_dir: Path) -> dict[str, list[str]]:
    ckpttool = [sys.executable, "-m", "ckpttool"]
    out = {name: str(out_dir / f"repair_{name}.pth") for name in ("cp", "sync", "tool")}
    return {
        "cp": ["cp", str(cut), out["cp"]],
        "cp + sync": ["sh", "-c", f'cp "{cut}" "{out["sync"]}" && sync "{out["sync"]}"'],
        "python start-up": [*ckpttool, "--version"],
        "ckpttool repair --dry-run": _exiting_1([*ckpttool, "repair", str(cut), "--dry-run"]),
        "ckpttool repair": _exiting_1(
            [*ckpttool, "repair", str(cut), "-o", out["tool"], "--force"]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repair", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    args = parser.parse_args(argv)
    cut = cut_file(build_resume(args.out), args.fraction)
    try:
        results = measure_all(rows(cut, args.out), runs=args.runs, warmup=args.warmup)
    finally:
        if not args.keep:
            for path in args.out.glob("repair_*.pth"):
                path.unlink()
    print(f"{cut.name}: {cut.stat().st_size / 1e9:.2f} GB, median of {args.runs} runs\n")
    print(table(results, baseline="cp"))
    tool = results["ckpttool repair"]
    print(
        f"\nwall vs cp: {tool.median_wall_s / results['cp'].median_wall_s:.2f}x (target <= 2); "
        f"vs cp + sync: {tool.median_wall_s / results['cp + sync'].median_wall_s:.2f}x\n"
        f"peak RSS: {tool.median_peak_rss_mb:.0f} MB (target <= {RSS_TARGET_MB})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
