"""``--jobs 2`` against ``--jobs 1`` on directory checkpoints, and a many-tensor file over HTTP
(issue 33).

Run from the repository root: ``python -m bench.jobs [--runs 5]``. Builds (once), from the
MiniMind-768 weights (:mod:`bench.build`):

* ``bench/data/jobs_hf4/``: a Hugging Face model directory of 4 ``pytorch_model-*.bin`` shards
  and their ``pytorch_model.bin.index.json`` (what ``save_pretrained(safe_serialization=False,
  max_shard_size=...)`` writes: consecutive tensors per shard, each shard a ``torch.save``);
* ``bench/data/dcp_768/``: the 2-rank DCP directory of :mod:`bench.dcp`;
* ``bench/data/jobs_many.pth``: MiniMind-768's first 2,000 x 4,096 fp32 values as 2,000
  tensors of 16 KiB (33 MB), the file the issue's user verified over S3.

Then prints, each table measured side by side (interleaved runs, :mod:`bench.harness`):

1. ``verify`` and ``convert`` (to safetensors) of each directory with ``--jobs 1`` and
   ``--jobs 2``;
2. over loopback HTTP (``tests/support/range_server.py``): a plain download of the
   2,000-tensor file and of the 1.25 GB resume file (``urllib``, 1 MiB reads, to nothing)
   against ``verify URL``, with the requests and bytes ``verify`` fetched (``--verbose``).
   ``--remote-only`` measures only these.

Each table has ckpttool's start-up (``ckpttool --version``: Python and the CLI's imports) as a
row: on files this small, it is most of every row.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from bench.build import weights_and_resume
from bench.dcp import build_dcp
from bench.harness import compare
from tests.support.range_server import RangeServer

DOWNLOAD = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1]) as response:
    while response.read(1 << 20):
        pass
"""
SHARDS = 4
TENSORS, ELEMENTS = 2000, 4096


def build_hf_shards(weights: Path, out_dir: Path) -> Path:
    """``out_dir/jobs_hf4``: ``weights`` in 4 shards of consecutive tensors, with the index."""
    target = out_dir / "jobs_hf4"
    if (target / "pytorch_model.bin.index.json").is_file():
        return target
    print(f"building {target} ...", file=sys.stderr, flush=True)
    state = torch.load(weights, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    keys = list(state)
    total = sum(state[k].numel() * state[k].element_size() for k in keys)
    shards: list[list[str]] = [[]]
    filled = 0
    for key in keys:
        size = state[key].numel() * state[key].element_size()
        if filled + size > total / SHARDS * len(shards) and len(shards) < SHARDS and shards[-1]:
            shards.append([])
        shards[-1].append(key)
        filled += size
    target.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for number, names in enumerate(shards, 1):
        name = f"pytorch_model-{number:05d}-of-{len(shards):05d}.bin"
        torch.save({k: state[k].clone() for k in names}, target / name)
        weight_map.update(dict.fromkeys(names, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    (target / "config.json").write_text(json.dumps({"model_type": "minimind"}))
    return target


def build_many(weights: Path, out_dir: Path) -> Path:
    """``out_dir/jobs_many.pth``: 2,000 tensors of 4,096 fp32 values taken from ``weights``."""
    target = out_dir / "jobs_many.pth"
    if target.is_file():
        return target
    state = torch.load(weights, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    flat = torch.cat([t.reshape(-1).float() for t in state.values()])[: TENSORS * ELEMENTS]
    many = {f"blocks.{i}.weight": flat[i * ELEMENTS : (i + 1) * ELEMENTS].clone()
            for i in range(TENSORS)}  # fmt: skip
    torch.save(many, target)
    return target


def _ckpttool(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *(str(a) for a in args)]


def _fetched(url: str) -> tuple[int, int]:
    """(requests, bytes fetched) that ``ckpttool verify URL --verbose`` reports."""
    result = subprocess.run(
        _ckpttool("verify", url, "--verbose"), capture_output=True, text=True, check=True
    )
    line = result.stderr.strip().splitlines()[-1]
    match = re.match(r"remote: ([\d,]+) requests, ([\d,]+) bytes fetched", line)
    assert match, line
    requests, fetched = (int(group.replace(",", "")) for group in match.groups())
    return requests, fetched


def main(argv: list[str] | None = None) -> int:
    remote_only = "--remote-only" in (argv if argv is not None else sys.argv[1:])
    argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--remote-only"]
    args, weights, resume, work = weights_and_resume(
        argv, "python -m bench.jobs", __doc__, "jobs_out"
    )
    many = build_many(weights, args.out)
    sources = [] if remote_only else [(build_hf_shards(weights, args.out), ()),
                                      (build_dcp(args.out), ("--section", "model"))]  # fmt: skip
    for source, extra in sources:
        size = sum(p.stat().st_size for p in source.iterdir())
        print(f"\n### {source.name}: {size / 1e6:.0f} MB\n")
        rows = {"start-up floor (ckpttool --version)": _ckpttool("--version")}
        for jobs in (1, 2):
            rows[f"verify --jobs {jobs}"] = _ckpttool("verify", source, "--jobs", jobs)
        for jobs in (1, 2):
            out = work / f"{source.name}_{jobs}.safetensors"
            rows[f"convert --jobs {jobs}"] = _ckpttool(
                "convert", source, out, *extra, "--force", "--jobs", jobs
            )
        print(compare(rows, "verify --jobs 1", runs=args.runs, warmup=args.warmup))
        same = (work / f"{source.name}_1.safetensors").read_bytes() == (
            work / f"{source.name}_2.safetensors"
        ).read_bytes()
        print(f"\nconvert outputs identical with --jobs 1 and 2: {same}")

    server = RangeServer().start()
    try:
        for path in (many, resume):
            url = server.add_path(path.name, path)
            size = path.stat().st_size
            requests, fetched = _fetched(url)
            print(f"\n### {path.name} over loopback HTTP: {size / 1e6:.1f} MB\n")
            print(
                f"URL verify: {requests} requests, {fetched:,} bytes fetched of {size:,} "
                f"({fetched / size:.4f}x; target <= 1.05x)\n"
            )
            rows = {
                "download (urllib, 1 MiB reads)": [sys.executable, "-c", DOWNLOAD, url],
                "ckpttool verify URL": _ckpttool("verify", url),
                "ckpttool verify FILE": _ckpttool("verify", path),
                "start-up floor (ckpttool --version)": _ckpttool("--version"),
            }
            print(compare(rows, "download (urllib, 1 MiB reads)", runs=args.runs,
                          warmup=args.warmup))  # fmt: skip
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
