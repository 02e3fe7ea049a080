"""Benchmark ``ckpttool lora merge`` of a rank-16 LoRA into MiniMind-768's fp16 weights (218 MB)
against PEFT's ``merge_and_unload``.

    python -m bench.lora_merge [--runs 3] [--warmup 1]

The adapter (``bench/data/lora_768_r16/``, built once) is PEFT's ``save_pretrained`` of
``get_peft_model`` on MiniMind-768 with r 16, alpha 32 on every attention and MLP projection
(q, k, v, o, gate, up, down of 16 layers: 112 modules), ``lora_B`` set to small random values
(PEFT starts it at zero). Rows, interleaved by :mod:`bench.harness` (warm page cache, medians):

* ``python start-up`` is ``python -m ckpttool --version``: interpreter and CLI import, no work.
* ``peft merge_and_unload``: the usual script: the model class built in fp16, the weights
  loaded (``torch.load(mmap=True)`` + ``load_state_dict``), ``PeftModel.from_pretrained``,
  ``merge_and_unload()`` (PEFT computes each delta in fp32 on CPU, then adds it in fp16) and
  ``torch.save`` of the merged state dict.
* ``ckpttool lora merge``: the same inputs to a ``.pth``, each merged tensor computed in fp32 and
  rounded once, the output read back before it replaces anything.

Targets (issue 29): at most 0.5x PEFT's wall time and 0.25x its peak RSS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT, build_weights
from bench.harness import measure_all, table
from tests.support.minimind import MiniMindForCausalLM, minimind_config

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(out_dir: Path, hidden: int = 768) -> Path:
    """The rank-16 adapter directory, written by PEFT (kept between runs)."""
    from peft import LoraConfig, get_peft_model

    path = out_dir / f"lora_{hidden}_r{RANK}"
    if (path / "adapter_model.safetensors").exists():
        return path
    model = get_peft_model(
        MiniMindForCausalLM(minimind_config(hidden)),
        LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS),
    )
    generator = torch.Generator().manual_seed(RANK)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 1e-2)
    model.save_pretrained(path)
    return path


def peft_merge(base: str, adapter: str, output: str) -> None:
    """The baseline: what a user runs with the model class, PEFT and torch."""
    from peft import PeftModel

    model = MiniMindForCausalLM(minimind_config(768)).half()
    model.load_state_dict(torch.load(base, mmap=True, weights_only=True))
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    torch.save(merged.state_dict(), output)


def rows(base: Path, adapter: Path, out_dir: Path) -> dict[str, list[str]]:
    python = sys.executable
    baseline = "import sys; from bench.lora_merge import peft_merge; peft_merge(*sys.argv[1:])"
    return {
        "python start-up": [python, "-m", "ckpttool", "--version"],
        "peft merge_and_unload": [
            python, "-c", baseline, str(base), str(adapter), str(out_dir / "merged_peft.pth")
        ],
        "ckpttool lora merge": [
            python, "-m", "ckpttool", "lora", "merge", str(base), str(adapter),
            "-o", str(out_dir / "merged_ckpttool.pth"), "--force",
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_merge", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    base = build_weights(args.out)
    adapter = build_adapter(args.out)
    results = measure_all(rows(base, adapter, args.out), runs=args.runs, warmup=args.warmup)
    for name in ("merged_peft.pth", "merged_ckpttool.pth"):
        (args.out / name).unlink(missing_ok=True)
    print(f"{base.name} + {adapter.name}, median of {args.runs} runs\n")
    print(table(results, baseline="peft merge_and_unload"))
    tool, peft = results["ckpttool lora merge"], results["peft merge_and_unload"]
    print(
        f"\nwall vs peft: {tool.median_wall_s / peft.median_wall_s:.2f}x (target <= 0.5); "
        f"peak RSS vs peft: {tool.median_peak_rss_mb / peft.median_peak_rss_mb:.2f}x "
        "(target <= 0.25)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
