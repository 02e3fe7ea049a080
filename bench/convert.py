"""``ckpttool convert`` against the reference pipeline and against ``cp``, on MiniMind-768 files.

Run from the repository root: ``python -m bench.convert [--runs 3]``. Builds the files if
needed (:mod:`bench.build`) and prints two markdown tables:

1. the fp16 weights file ``pretrain_768.pth`` (~218 MB) to safetensors;
2. the ``model`` section of the resume file ``pretrain_768_resume.pth`` (~1.25 GB; the model
   is fp32, ~417 MB, with ``lm_head`` tied to the embedding), as it is and cast to bf16.

The reference is what safetensors' own ``convert.py`` does: ``torch.load`` the file, drop
shared names (``_remove_duplicate_names``, recorded in ``__metadata__``), make every tensor
contiguous, ``save_file``, then ``load_file`` and ``torch.equal`` every tensor. ``cp`` of the
same number of bytes (the whole weights file; the first N bytes of the resume file, N the
model's size, with ``os.copy_file_range`` as cp does) is the physical floor: read once, write once, in the kernel. Every ckpttool row
includes its verification (a second read of source and output) unless it says ``--no-verify``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.build import weights_and_resume
from bench.harness import compare

REFERENCE = """
import sys, torch
from safetensors.torch import _remove_duplicate_names, load_file, save_file
source, target, section, dtype = sys.argv[1:5]
state_dict = torch.load(source, map_location="cpu", weights_only=True)
if section != "-":
    state_dict = state_dict[section]
if dtype != "keep":
    cast = getattr(torch, dtype)
    state_dict = {k: v.to(cast) if v.is_floating_point() else v for k, v in state_dict.items()}
metadata = {"format": "pt"}
for kept, removed in _remove_duplicate_names(state_dict).items():
    for name in removed:
        metadata[name] = kept
        del state_dict[name]
state_dict = {k: v.contiguous() for k, v in state_dict.items()}
save_file(state_dict, target, metadata=metadata)
reloaded = load_file(target)
for name, tensor in state_dict.items():
    if not torch.equal(tensor, reloaded[name]):
        sys.exit(f"{name} differs after reloading")
"""


# cp for the first N bytes of a file: the kernel copies, as cp does (head -c reads 8 KiB at a time)
COPY_HEAD = """
import os, sys
source, target, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(source, "rb") as src, open(target, "wb") as dst:
    done = 0
    while done < size:
        done += os.copy_file_range(src.fileno(), dst.fileno(), size - done)
"""


def _reference(source: Path, target: Path, section: str = "-", dtype: str = "keep") -> list[str]:
    return [sys.executable, "-c", REFERENCE, str(source), str(target), section, dtype]


def _ckpttool(source: Path, target: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "ckpttool", "convert", str(source), str(target), "--force",
            *options]  # fmt: skip


def _model_bytes(resume: Path) -> int:
    """Bytes of the resume file's model tensors (what a conversion reads and writes)."""
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.commands.selection import select

    with open_checkpoint(resume) as ckpt:
        selection = select(ckpt)
        storages = {r.storage: r.nbytes for r in selection.tensors.values()}
    return sum(storages.values())


def main(argv: list[str] | None = None) -> int:
    args, weights, resume, work = weights_and_resume(
        argv, "python -m bench.convert", __doc__, "convert_out"
    )

    print(f"\n### {weights.name} ({weights.stat().st_size / 1e6:.0f} MB, fp16) to safetensors\n")
    rows = {
        "cp (same bytes, physical floor)": ["cp", str(weights), str(work / "cp.bin")],
        "reference: torch.load + save_file + load_file + compare": _reference(
            weights, work / "reference.safetensors"
        ),
        "ckpttool convert": _ckpttool(weights, work / "ckpttool.safetensors"),
        "ckpttool convert --no-verify": _ckpttool(
            weights, work / "noverify.safetensors", "--no-verify"
        ),
    }
    print(compare(rows, "reference: torch.load + save_file + load_file + compare",
                  runs=args.runs, warmup=args.warmup))  # fmt: skip

    model_bytes = _model_bytes(resume)
    print(
        f"\n### model section of {resume.name} ({resume.stat().st_size / 1e9:.2f} GB file, "
        f"{model_bytes / 1e6:.0f} MB fp32 model) to safetensors\n"
    )
    head = [sys.executable, "-c", COPY_HEAD, str(resume), str(work / "head.bin"), str(model_bytes)]
    rows = {
        "copy_file_range of the same bytes (physical floor)": head,
        "reference": _reference(resume, work / "ref_model.safetensors", "model"),
        "ckpttool convert": _ckpttool(resume, work / "model.safetensors"),
        "ckpttool convert --no-verify": _ckpttool(
            resume, work / "model_nv.safetensors", "--no-verify"
        ),
        "reference, cast to bf16": _reference(
            resume, work / "ref_bf16.safetensors", "model", "bfloat16"
        ),
        "ckpttool convert --dtype bf16": _ckpttool(
            resume, work / "model_bf16.safetensors", "--dtype", "bf16"
        ),
    }
    print(compare(rows, "reference", runs=args.runs, warmup=args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
