"""Benchmark ``ckpttool edit --map llama-meta-to-hf`` on MiniMind-768's fp16 weights (218 MB)
in Meta's Llama layout.

    python -m bench.edit_map [--runs 5] [--warmup 1] [--keep]

The Meta-layout file is made once from ``pretrain_768.pth`` by ``ckpttool edit --map
llama-hf-to-meta`` (8 heads, 2 key/value heads). Rows, interleaved by :mod:`bench.harness`
(warm page cache, medians):

* ``reference script`` is what conversion scripts do (Hugging Face's
  ``convert_llama_weights_to_hf``, torchtune's ``meta_to_tune``): ``torch.load`` everything,
  rename, permute the q/k rows of every layer, ``torch.save``.
* ``ckpttool edit --map`` renames without touching the bytes (storages copied by the kernel) and
  permutes q/k one tensor at a time.

Targets (issue #30): wall time at most 0.5x the script's, peak RSS at most 0.25x.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_weights
from bench.harness import measure_all, table

HEADS, KV_HEADS = 8, 2

REFERENCE = """
import re, sys, torch
heads, kv_heads = 8, 2
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
def permute(w, n):
    rows, cols = w.shape
    return w.view(n, rows // n // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
layer = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
         "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
         "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
         "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm"}
out = {}
for key, value in sd.items():
    if key in names:
        out[names[key]] = value
        continue
    i, rest = re.match(r"layers\\.(\\d+)\\.(.+)\\.weight", key).groups()
    if rest == "attention.wq":
        value = permute(value, heads)
    elif rest == "attention.wk":
        value = permute(value, kv_heads)
    out[f"model.layers.{i}.{layer[rest]}.weight"] = value
torch.save(out, sys.argv[2])
"""


def meta_file(out_dir: Path) -> Path:
    """MiniMind-768's weights in Meta's layout (made once by ckpttool itself)."""
    source = build_weights(out_dir)
    meta = out_dir / "pretrain_768_meta.pth"
    if not meta.exists():
        subprocess.run(
            [sys.executable, "-m", "ckpttool", "edit", str(source), "--map", "llama-hf-to-meta",
             "--map-param", f"n_heads={HEADS}", "--map-param", f"n_kv_heads={KV_HEADS}",
             "-o", str(meta)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return meta


def rows(meta: Path, out_dir: Path) -> dict[str, list[str]]:
    reference, tool = (str(out_dir / f"edit_map_{name}.pth") for name in ("reference", "tool"))
    return {
        "reference script": [sys.executable, "-c", REFERENCE, str(meta), reference],
        "ckpttool edit --map": [
            sys.executable, "-m", "ckpttool", "edit", str(meta), "--map", "llama-meta-to-hf",
            "--map-param", f"n_heads={HEADS}", "--map-param", f"n_kv_heads={KV_HEADS}",
            "-o", tool, "--force",
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.edit_map", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    args = parser.parse_args(argv)
    meta = meta_file(args.out)
    try:
        results = measure_all(rows(meta, args.out), runs=args.runs, warmup=args.warmup)
    finally:
        if not args.keep:
            for path in args.out.glob("edit_map_*.pth"):
                path.unlink()
    print(f"{meta.name}: {meta.stat().st_size / 1e6:.0f} MB, median of {args.runs} runs\n")
    print(table(results, baseline="reference script"))
    tool, reference = results["ckpttool edit --map"], results["reference script"]
    print(
        f"\nwall vs the script: {tool.median_wall_s / reference.median_wall_s:.2f}x (target <= "
        f"0.5); peak RSS: {tool.median_peak_rss_mb / reference.median_peak_rss_mb:.3f}x "
        "(target <= 0.25)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
