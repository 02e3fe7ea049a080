"""ckpttool convert of a Megatron ``torch_dist`` save of a MiniMind-768-shaped GPT, against
torch's ``dcp_to_torch_save`` and the renaming a conversion script does after it.

Run from the repository root: ``python -m bench.megatron [--runs 3]`` (needs megatron-core,
from the test extra). Builds (once) ``bench/data/megatron_768/iter_0000100/``: megatron-core's
``GPTModel`` with MiniMind-768's shapes (hidden 768, 16 layers, 8 heads, 2 query groups, FFN
2048 with SwiGLU, vocabulary 6400, RMSNorm; ~104M parameters, fp32) under tensor parallel 2,
saved by ``dist_checkpointing.save`` from 2 gloo processes on CPU (``torch.cuda.synchronize``
and ``current_device`` stubbed in the writer only), as Megatron-LM saves it: layers stacked,
``common.pt`` with ``iteration`` and ``args``, ``metadata.json``. Then measures, as fresh
processes (:mod:`bench.harness`):

* the baseline: ``dcp_to_torch_save`` to a ``.pth``, ``torch.load`` of it, each stacked
  ``decoder.layers.{name}`` split into ``decoder.layers.N.{name}``, ``safetensors`` ``save_file``
  (what the conversion scripts in Megatron-LM and NeMo threads do, without a GPU);
* ``ckpttool convert DIR out.safetensors`` (per-layer names, streamed tensor by tensor, read
  back and compared bit for bit) and the same with ``--no-verify``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from bench.build import DEFAULT_OUT
from bench.harness import compare

WRITER = textwrap.dedent("""
    import argparse, os, sys, warnings
    import torch, torch.distributed as dist
    warnings.simplefilter("ignore")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")

    def main():
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        torch.manual_seed(0)
        shape = dict(num_layers=16, hidden_size=768, ffn_hidden_size=2048,
                     num_attention_heads=8, num_query_groups=2)
        config = TransformerConfig(**shape, use_cpu_initialization=True,
                                   tensor_model_parallel_size=2, gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu,
                                   normalization="RMSNorm", add_bias_linear=False)
        model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(
                             normalization="RMSNorm"), vocab_size=6400,
                         max_sequence_length=512, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        args = argparse.Namespace(**shape, tensor_model_parallel_size=2,
                                  pipeline_model_parallel_size=1, swiglu=True,
                                  padded_vocab_size=6400, iteration=100,
                                  consumed_train_samples=12800)
        out = sys.argv[1]
        os.makedirs(out, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 100,
                                 "args": args, "checkpoint_version": 3.0}, out)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
""")

#: The baseline: torch's converter, then the renaming every script does (unstack the layers).
PEER = textwrap.dedent("""
    import sys, warnings
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    warnings.simplefilter("ignore")
    source, scratch, out = sys.argv[1:4]
    dcp_to_torch_save(source, scratch)
    state = torch.load(scratch, weights_only=False)
    model = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
            rest = key[len("decoder.layers."):]
            for layer in range(value.shape[0]):
                model[f"decoder.layers.{layer}.{rest}"] = value[layer].contiguous()
        else:
            model[key] = value
    save_file(model, out)
""")


def build_megatron(out_dir: Path, *, force: bool = False) -> Path:
    """``out_dir/megatron_768`` (a save directory with its tracker), written to a temp name and
    renamed when complete."""
    target = out_dir / "megatron_768"
    if target.is_dir() and not force:
        return target
    temp = (out_dir / "megatron_768.tmp").resolve()
    shutil.rmtree(temp, ignore_errors=True)
    (temp / "iter_0000100").mkdir(parents=True)
    script = temp / "writer.py"
    script.write_text(WRITER)
    print(f"building {target} (megatron-core, 2 ranks) ...", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(temp / "iter_0000100")],
        check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=temp,
    )  # fmt: skip
    script.unlink()
    (temp / "latest_checkpointed_iteration.txt").write_text("100")
    shutil.rmtree(target, ignore_errors=True)
    temp.rename(target)
    return target


def _ckpttool(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *(str(a) for a in args)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.megatron", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild the Megatron save")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    source = build_megatron(args.out, force=args.force) / "iter_0000100"
    work = args.out / "megatron_out"
    work.mkdir(exist_ok=True)
    size = sum(p.stat().st_size for p in source.iterdir())
    print(f"\n### {source.parent.name}: Megatron torch_dist, TP 2, {size / 1e6:.0f} MB (fp32)\n")
    baseline = "dcp_to_torch_save + load + unstack + save_file"
    rows = {
        baseline: [sys.executable, "-c", PEER, str(source), str(work / "torch.pth"),
                   str(work / "peer.safetensors")],
        "ckpttool convert to .safetensors": _ckpttool(
            "convert", source, work / "model.safetensors", "--force"
        ),
        "ckpttool convert ... --no-verify": _ckpttool(
            "convert", source, work / "nv.safetensors", "--force", "--no-verify"
        ),
    }  # fmt: skip
    print(compare(rows, baseline, runs=args.runs, warmup=args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
