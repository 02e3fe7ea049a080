"""Benchmark ``ckpttool merge --method ties`` of two fine-tunes of a ~1 GB Hugging Face model
against mergekit on CPU.

    python -m bench.merge [--runs 3] [--warmup 1] [--density 0.5] [--other DIR] [--keep]

The inputs (``bench/data/merge_llama_{base,chat,code}/``, built once, 1.02 GB each) are
Hugging Face folders written by transformers' ``save_pretrained`` (one ``model.safetensors``,
float32): a LlamaForCausalLM of 254M parameters (hidden 1024, 16 layers, 16 heads, 8 key/value
heads, MLP 2816, vocabulary 32000, untied head) as transformers initialises it, and two
fine-tunes: ``chat`` the base plus seeded noise ``N(0, 1e-3)`` on every weight, ``code`` that
plus another. Rows, interleaved by :mod:`bench.harness` (warm page cache, medians):

* ``python start-up``: ``python -m ckpttool --version``, the floor of the ckpttool rows.
* ``mergekit ties``: ``mergekit-yaml`` (mergekit 0.1.5) with ``merge_method: ties``, the base,
  both fine-tunes at weight 1 and ``--density``, ``dtype: float32``, its defaults otherwise (CPU,
  no lazy unpickling, 5B-parameter shards) but ``--no-copy-tokenizer`` (the folders have none).
* ``ckpttool merge --method ties``: the same inputs and parameters to one ``.safetensors``,
  float64 arithmetic rounded once to float32, the output read back.
* with ``--other DIR``: the ckpttool row run from the checkout in DIR.

Targets (issue 44): at most 0.5x mergekit's wall time and 0.25x its peak RSS. Outputs are
deleted afterwards; the inputs too unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT
from bench.harness import measure_all, table

NAMES = ("base", "chat", "code")


def build_models(out_dir: Path) -> list[Path]:
    """``merge_llama_{base,chat,code}/``: a ~1 GB Llama and two fine-tunes of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    paths = [out_dir / f"merge_llama_{name}" for name in NAMES]
    if all((p / "model.safetensors").exists() for p in paths):
        return paths
    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(44)
    model = LlamaForCausalLM(config)
    for index, path in enumerate(paths):
        if index:  # each fine-tune moves every weight of the previous model by its own noise
            generator = torch.Generator().manual_seed(index)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 1e-3)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e9
        print(f"wrote {path} ({size:.2f} GB)", file=sys.stderr, flush=True)
    return paths


def mergekit_config(paths: list[Path], density: float, out_dir: Path) -> Path:
    """The YAML (JSON is YAML) that mergekit-yaml reads."""
    base, *models = paths
    config = {
        "merge_method": "ties",
        "base_model": str(base),
        "dtype": "float32",
        "models": [
            {"model": str(m), "parameters": {"weight": 1.0, "density": density}} for m in models
        ],
    }
    path = out_dir / "merge_ties.yml"
    path.write_text(json.dumps(config, indent=2))
    return path


def rows(
    paths: list[Path], config: Path, density: float, out_dir: Path, other: Path | None
) -> dict[str, list[str]]:
    python = sys.executable
    mergekit_yaml = str(Path(python).with_name("mergekit-yaml"))
    ours = ["-m", "ckpttool", "merge", *map(str, paths), "--method", "ties",
            "--density", str(density), "--force", "-o"]  # fmt: skip
    table_rows = {
        "python start-up": [python, "-m", "ckpttool", "--version"],
        "mergekit ties": [
            "env", "HF_HUB_OFFLINE=1", mergekit_yaml, str(config), str(out_dir / "merged_mergekit"),
            "--no-copy-tokenizer", "--quiet",
        ],
        "ckpttool merge --method ties": [python, *ours, str(out_dir / "merged_ckpttool.safetensors")],
    }  # fmt: skip
    if other is not None:
        table_rows[f"ckpttool merge ({other.name})"] = [
            "env", f"PYTHONPATH={other}", python, "-P", *ours,
            str(out_dir / "merged_other.safetensors"),
        ]  # fmt: skip
    return table_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.merge", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--other", type=Path, help="also run the ckpttool checkout in DIR")
    parser.add_argument("--keep", action="store_true", help="keep the three input folders")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = build_models(args.out)
    config = mergekit_config(paths, args.density, args.out)
    other = args.other.resolve() if args.other else None
    try:
        results = measure_all(
            rows(paths, config, args.density, args.out, other), runs=args.runs, warmup=args.warmup
        )
    finally:
        shutil.rmtree(args.out / "merged_mergekit", ignore_errors=True)
        for name in ("merged_ckpttool.safetensors", "merged_other.safetensors", config.name):
            (args.out / name).unlink(missing_ok=True)
        if not args.keep:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
    print(f"TIES, density {args.density}: base + 2 fine-tunes, median of {args.runs} runs\n")
    print(table(results, baseline="mergekit ties"))
    mergekit = results["mergekit ties"]
    for name, result in results.items():
        if name.startswith("ckpttool merge"):
            print(
                f"\n{name}: wall vs mergekit {result.median_wall_s / mergekit.median_wall_s:.2f}x "
                f"(target <= 0.5); peak RSS vs mergekit "
                f"{result.median_peak_rss_mb / mergekit.median_peak_rss_mb:.3f}x (target <= 0.25)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
