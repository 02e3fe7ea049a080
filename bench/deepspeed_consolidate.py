"""``ckpttool convert`` of DeepSpeed ZeRO-2 and ZeRO-3 checkpoints against DeepSpeed's zero_to_fp32.

Run from the repository root: ``python -m bench.deepspeed_consolidate [--runs 3]``. Builds the
checkpoints first if needed (``bench/data/ds_zero{2,3}/``): MiniMind-768's shape
(``tests/support/minimind.py``) with 22 layers instead of 16, 141.2M parameters (the issue's
141.8M-parameter, ~2.3 GB case), trained for one AdamW step by real DeepSpeed on 2 processes
(``torchrun``, gloo, CPU, fp32) and saved: fp32 master weights and both Adam moments in the
``*_optim_states.pt`` files, 2.3 GB per checkpoint. Then, interleaved, each measured as a fresh
process (:mod:`bench.harness`: median wall time and peak RSS), every row writing one
safetensors file of the consolidated fp32 weights:

* ``zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict)``: what the ``zero_to_fp32.py``
  script DeepSpeed saves next to the checkpoint runs: its lazy reconstruction, materialised
  shard by shard (one 5 GB shard here), ``torch.save`` to ``pytorch_model.bin`` (its
  ``--safe_serialization`` fails on MiniMind's tied ``lm_head``: safetensors refuses shared
  tensors, and the script does not drop them);
* ``zero_to_fp32 default (get_fp32_state_dict_from_zero_checkpoint)``: the documented API,
  every tensor materialised, then ``save_file`` (the tied ``lm_head`` dropped first, and each
  ZeRO-1/2 parameter, a view of its group's flat fp32 vector, copied out: safetensors refuses
  tensors that share memory);
* ``zero_to_fp32 lazy (lazy_mode=True + to_torch_tensor)``: the lazy state dict, converted
  with ``to_torch_tensor``, then ``save_file``;
* ``ckpttool convert`` (verifies the output by reading it back) and ``--no-verify``.

The ckpttool and the last two DeepSpeed rows write safetensors; the first DeepSpeed row a
``.bin``. The table is printed as markdown; bench/README.md keeps the last run.
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
LAYERS = 22  # MiniMind-768 with 22 layers: 141.2M parameters

WRITER = textwrap.dedent(
    """
    import dataclasses, sys, torch, deepspeed
    from tests.support.minimind import MiniMindForCausalLM, minimind_config
    stage, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    config = dataclasses.replace(minimind_config(768), num_layers=LAYERS)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**6})
    ids = torch.randint(0, 6400, (1, 8), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    engine.backward(engine(ids).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()
    """
).replace("LAYERS", str(LAYERS))

DEEPSPEED_SCRIPT = """
import sys
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2])
"""

DEEPSPEED_API = """
import sys
from safetensors.torch import save_file
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor
source, target, mode = sys.argv[1:4]
state_dict = get_fp32_state_dict_from_zero_checkpoint(source, lazy_mode=mode == "lazy")
if mode == "lazy":
    state_dict = to_torch_tensor(state_dict)
# safetensors refuses tensors that share memory: keep one name of a tied pair, and copy the
# ZeRO-1/2 parameters out of the flat group they are views of (what save_file needs)
seen, metadata, tensors = {}, {"format": "pt"}, {}
for name, tensor in state_dict.items():
    if tensor.data_ptr() in seen:
        metadata[name] = seen[tensor.data_ptr()]
        continue
    seen[tensor.data_ptr()] = name
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    tensors[name] = tensor if whole else tensor.clone()
save_file(tensors, target, metadata=metadata)
"""


def build(stage: int, out_dir: Path = DEFAULT_OUT) -> Path:
    """The ZeRO-``stage`` save directory (kept if it exists): one step, saved by 2 processes."""
    target = out_dir / f"ds_zero{stage}"
    if (target / "latest").is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    script = out_dir / "ds_write.py"
    script.write_text(WRITER)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "ckpttool-torch-extensions")
    )
    print(f"building {target} (2 processes, one step)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--standalone", str(script), str(stage), str(target) + ".tmp"],
                   env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    os.replace(str(target) + ".tmp", target)
    return target


def rows(source: Path, out: Path) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict)": [
            python, "-c", DEEPSPEED_SCRIPT, str(source), str(out / "ds_script"),
        ],
        "zero_to_fp32 default (get_fp32_state_dict_from_zero_checkpoint)": [
            python, "-c", DEEPSPEED_API, str(source), str(out / "ds_default.safetensors"), "default",
        ],
        "zero_to_fp32 lazy (lazy_mode=True + to_torch_tensor)": [
            python, "-c", DEEPSPEED_API, str(source), str(out / "ds_lazy.safetensors"), "lazy",
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
    parser = argparse.ArgumentParser(prog="python -m bench.deepspeed_consolidate")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(1, 2, 3))
    args = parser.parse_args(argv)
    out = ROOT / "bench" / "out" / "deepspeed"
    out.mkdir(parents=True, exist_ok=True)
    for stage in args.stages:
        source = build(stage)
        size = sum(p.stat().st_size for p in source.rglob("*.pt"))
        baseline = "zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict)"
        print(f"\nZeRO-{stage}: {source.name}/ (2 ranks, {size / 1e9:.2f} GB of .pt files)\n")
        print(compare(rows(source, out), baseline, runs=args.runs, warmup=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
