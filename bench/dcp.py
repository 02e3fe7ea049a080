"""ckpttool on a torch.distributed.checkpoint directory of MiniMind-768, against torch's converter.

Run from the repository root: ``python -m bench.dcp [--runs 3]``. Builds (once)
``bench/data/dcp_768/``: ``{"model": MiniMind-768's fp32 weights, "step": 1200, "epoch": 1}``
saved by a real 2-process gloo group, every 2-D weight a ``Shard(0)`` DTensor split between the
ranks' files, the norms replicated (~440 MB in two ``.distcp`` files; the largest tensor, the
6400 x 768 embedding, is 19.7 MB). Then measures, as fresh processes (:mod:`bench.harness`):

* torch's ``dcp_to_torch_save`` (the baseline: loads the whole state into memory, ``torch.save``);
* ``ckpttool convert`` of the model to ``.pth`` and to ``.safetensors`` (streamed tensor by
  tensor, then read back and compared bit for bit), and without the read-back;
* ``ckpttool show`` (metadata only) and ``ckpttool verify`` (every item's CRC-32).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT
from bench.harness import compare

DCP_TO_TORCH_SAVE = """
import sys, warnings
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
warnings.simplefilter("ignore")
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def _rank(rank: int, port: int, out: str) -> None:
    """One rank: MiniMind-768 (same seed on both), distributed, saved with DCP."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.support.minimind import MiniMindForCausalLM, minimind_config

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(minutes=10),
    )  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = MiniMindForCausalLM(minimind_config(768))
        state = {
            key: distribute_tensor(value, mesh, [Shard(0) if value.dim() > 1 else Replicate()])
            for key, value in model.state_dict().items()
        }
        dcp.save({"model": state, "step": 1200, "epoch": 1}, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def build_dcp(out_dir: Path, *, force: bool = False) -> Path:
    """``out_dir/dcp_768``, written to ``dcp_768.tmp`` and renamed when complete."""
    import torch.multiprocessing as mp

    target = out_dir / "dcp_768"
    if target.is_dir() and not force:
        return target
    temp = out_dir / "dcp_768.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    print(f"building {target} (2 ranks) ...", file=sys.stderr, flush=True)
    mp.spawn(_rank, args=(port, str(temp)), nprocs=2, join=True)
    shutil.rmtree(target, ignore_errors=True)
    temp.rename(target)
    return target


def _ckpttool(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *(str(a) for a in args)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dcp", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild the DCP directory")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    source = build_dcp(args.out, force=args.force)
    work = args.out / "dcp_out"
    work.mkdir(exist_ok=True)
    size = sum(p.stat().st_size for p in source.iterdir())
    print(f"\n### {source.name}: DCP directory, 2 ranks, {size / 1e6:.0f} MB (fp32)\n")
    convert = ("convert", source, "--section", "model", "--force")
    rows = {
        "torch dcp_to_torch_save (all of it, to .pth)": [
            sys.executable, "-c", DCP_TO_TORCH_SAVE, str(source), str(work / "torch.pth"),
        ],
        "ckpttool convert (model) to .pth": _ckpttool(*convert, work / "model.pth"),
        "ckpttool convert (model) to .safetensors": _ckpttool(*convert, work / "m.safetensors"),
        "ckpttool convert ... --no-verify": _ckpttool(
            *convert, work / "nv.safetensors", "--no-verify"
        ),
        "ckpttool show": _ckpttool("show", source),
        "ckpttool verify": _ckpttool("verify", source),
    }  # fmt: skip
    print(compare(rows, "torch dcp_to_torch_save (all of it, to .pth)", runs=args.runs,
                  warmup=args.warmup))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
