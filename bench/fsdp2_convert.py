"""``ckpttool convert`` of a 2-rank FSDP2 per-rank set against the verl-style merge script.

Run from the repository root: ``python -m bench.fsdp2_convert [--runs 3]``. Builds the set
first if needed (``bench/data/fsdp2_768/``): MiniMind-768 (``tests/support/minimind.py``,
104M parameters, fp32), ``fully_shard`` of every block and of the root by torch's FSDP2 under
``torchrun --nproc_per_node 2`` (gloo, CPU), each rank ``torch.save(model.state_dict())`` as
``model_world_size_2_rank_{r}.pt`` (verl's names and the way its FSDP checkpoint manager saves:
every parameter a ``DTensor`` holding that rank's rows). Then, interleaved, each measured as a
fresh process (:mod:`bench.harness`), every row writing one safetensors file of the full model:

* ``verl-style merge``: what verl's ``model_merger`` and the peer scripts do: ``torch.load`` of
  every rank file (``weights_only=False``: DTensors), each parameter's local pieces
  concatenated along its ``Shard`` dimension, a plain tensor taken from rank 0, ``save_file``;
* ``ckpttool convert`` (the global tensors assembled from the placements, one at a time, and
  the output read back and verified) and ``--no-verify``.

The table is printed as markdown; bench/README.md keeps the last run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from bench.build import DEFAULT_OUT
from bench.harness import compare

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2

WRITER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from tests.support.minimind import MiniMindForCausalLM, minimind_config
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = MiniMindForCausalLM(minimind_config(768))
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.save(model.state_dict(), f"{sys.argv[1]}/model_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    """
)

VERL_MERGE = """
import sys, torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard
source, target, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
ranks = [torch.load(f"{source}/model_world_size_{world}_rank_{r}.pt", weights_only=False,
                    map_location="cpu") for r in range(world)]
merged = {}
for key, first in ranks[0].items():
    if isinstance(first, DTensor):
        (placement,) = first.placements
        assert isinstance(placement, Shard), placement
        merged[key] = torch.cat([r[key]._local_tensor for r in ranks], dim=placement.dim)
    else:
        merged[key] = first
# safetensors refuses tensors that share memory: the tied lm_head keeps one copy
seen = {}
for key in list(merged):
    pointer = merged[key].data_ptr()
    if pointer in seen:
        merged[key] = merged[key].clone()
    seen[pointer] = key
save_file({k: v.contiguous() for k, v in merged.items()}, target)
"""


def build(out_dir: Path = DEFAULT_OUT) -> Path:
    """The 2-rank set (kept if it exists), saved by ``fully_shard`` under torchrun."""
    target = out_dir / "fsdp2_768"
    if (target / f"model_world_size_{WORLD}_rank_{WORLD - 1}.pt").is_file():
        return target
    temp = Path(str(target) + ".tmp")
    temp.mkdir(parents=True, exist_ok=True)
    script = out_dir / "fsdp2_write.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"building {target} ({WORLD} processes, fully_shard)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                    "--standalone", str(script), str(temp)],
                   env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    os.replace(temp, target)
    return target


def rows(source: Path, out: Path) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "verl-style merge (torch.load all, cat, save_file)": [
            python, "-c", VERL_MERGE, str(source), str(out / "verl.safetensors"), str(WORLD),
        ],
        "ckpttool convert": [
            python, "-m", "ckpttool", "convert", str(source), str(out / "ck.safetensors"), "--force",
        ],
        "ckpttool convert --no-verify": [
            python, "-m", "ckpttool", "convert", str(source), str(out / "ck_nv.safetensors"),
            "--force", "--no-verify",
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fsdp2_convert")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    out = ROOT / "bench" / "out" / "fsdp2"
    out.mkdir(parents=True, exist_ok=True)
    source = build()
    size = sum(p.stat().st_size for p in source.glob("*.pt"))
    baseline = "verl-style merge (torch.load all, cat, save_file)"
    print(f"\n{source.name}/ ({WORLD} ranks, {size / 1e9:.2f} GB of .pt files)\n")
    print(compare(rows(source, out), baseline, runs=args.runs, warmup=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
