"""Benchmark GGUF -> safetensors: ``ckpttool convert --dequantize`` of a Q8_0 GGUF file of the
MiniMind-768 weights, against the ``gguf`` package's way.

    python -m bench.gguf [--runs 3] [--warmup 1] [--keep]

The GGUF file (``bench/data/pretrain_768_q8_0.gguf``, ~115 MB) is built once from
``pretrain_768.pth`` (:mod:`bench.build`): every 2-D weight quantized to Q8_0 by
``gguf.quants.quantize`` (as ``llama-quantize`` would, rows of whole blocks), the 1-D norms
kept F32, names as MiniMind's, written by ``gguf.GGUFWriter``. Rows, interleaved by
:mod:`bench.harness` (warm page cache, medians), each writing its own float32 safetensors file:

* ``python start-up`` is ``python -m ckpttool --version``: interpreter and CLI import, no work.
* ``gguf + numpy + save_file`` is the reference: ``gguf.GGUFReader`` (memory-mapped),
  ``gguf.quants.dequantize`` of every tensor into one dict, ``safetensors.numpy.save_file``.
* ``ckpttool convert --dequantize`` decodes one tensor at a time, writes, fsyncs and reads the
  output back against the source, decoded again (its verification); ``--no-verify`` without
  that second pass.

Targets (issue #29): at most 0.5x the reference's wall time and 0.5x its peak RSS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT, build_weights
from bench.harness import measure_all, table

REFERENCE = """
import sys
import gguf
from safetensors.numpy import save_file
reader = gguf.GGUFReader(sys.argv[1])
tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
save_file(tensors, sys.argv[2])
"""


def build_gguf(out_dir: Path) -> Path:
    """The Q8_0 GGUF file of MiniMind-768's weights (kept between runs)."""
    import gguf
    import torch

    target = out_dir / "pretrain_768_q8_0.gguf"
    if target.exists():
        return target
    state = torch.load(build_weights(out_dir), map_location="cpu", weights_only=True)
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "minimind")
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in state.items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(target)
    return target


def rows(source: Path, out_dir: Path) -> dict[str, list[str]]:
    ckpttool = [sys.executable, "-m", "ckpttool"]
    out = {name: str(out_dir / f"gguf_{name}.safetensors") for name in ("ref", "tool", "fast")}
    convert = [*ckpttool, "convert", str(source)]
    return {
        "gguf + numpy + save_file": [sys.executable, "-c", REFERENCE, str(source), out["ref"]],
        "python start-up": [*ckpttool, "--version"],
        "ckpttool convert --dequantize": [*convert, out["tool"], "--dequantize", "--force"],
        "ckpttool convert --dequantize --no-verify": [
            *convert, out["fast"], "--dequantize", "--force", "--no-verify",
        ],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    args = parser.parse_args(argv)
    source = build_gguf(args.out)
    try:
        results = measure_all(rows(source, args.out), runs=args.runs, warmup=args.warmup)
    finally:
        if not args.keep:
            for path in args.out.glob("gguf_*.safetensors"):
                path.unlink()
    print(table(results, baseline="gguf + numpy + save_file"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
