"""Build MiniMind-sized checkpoints for the benchmarks; files that already exist are kept.

    python -m bench.build [--hidden 768] [--out bench/data] [--scale N] [--pair] [--force]

pretrain_{H}.pth
    MiniMind's weights file: ``{name: tensor.half()}`` of MiniMind2's shape (H=768: 16 layers,
    104M parameters, ~208 MB; the tied ``lm_head.weight`` is a second fp16 copy, as MiniMind's
    per-key ``.half()`` makes it).
pretrain_{H}_resume.pth
    A resume file in MiniMind's key order (``model``, ``optimizer``, ``epoch``, ``step``,
    ``world_size``, ``wandb_id``, ``scaler``) with the model in fp32, as ckpttool's resume file
    keeps it (MiniMind's own is fp16), and AdamW's state after one real ``step()`` on random
    gradients: fp32 ``exp_avg`` and ``exp_avg_sq`` per parameter. ~1.25 GB for H=768.
pretrain_{H}_x{N}.pth (``--scale N``)
    The weights file with the same keys, dtypes and tensor count but every tensor's first
    dimension N times longer: N times the bytes, for checking that listing stays flat.
pretrain_{H}_resume_copy.pth, pretrain_{H}_resume_changed.pth (``--pair``)
    For diff benchmarks: a byte copy of the resume file, and a rewrite of it with one element
    of one tensor changed (see :func:`build_resume_pair`).

Every file is written to ``<name>.tmp`` and renamed, so an interrupted build never leaves a
truncated file that a later run would skip. Peak memory is about 2 GB for H=768 (the fp32 model,
its gradients and AdamW's two moments), plus ``2 * N * 104M`` bytes with ``--scale N``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tests.support.minimind import MiniMindForCausalLM, minimind_config

DEFAULT_OUT = Path(__file__).resolve().parent / "data"
CHANGED_TENSOR = "model.layers.3.mlp.up_proj.weight"

__all__ = [
    "build_resume",
    "build_resume_pair",
    "build_scaled_weights",
    "build_weights",
    "weights_and_resume",
]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _save(obj: Any, path: Path) -> None:
    tmp = Path(f"{path}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _log(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB)")


def _skip(path: Path, force: bool) -> bool:
    if path.exists() and not force:
        _log(f"kept {path} ({path.stat().st_size / 1e6:.0f} MB)")
        return True
    return False


@contextmanager
def _single_seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _model(hidden: int) -> MiniMindForCausalLM:
    with _single_seeded(hidden):
        return MiniMindForCausalLM(minimind_config(hidden))


def weights_and_resume(
    argv: list[str] | None, prog: str, doc: str | None, work_name: str
) -> tuple[argparse.Namespace, Path, Path, Path]:
    """A comparison script's start: its options (``--runs``, ``--warmup``, ``--out``), the
    MiniMind-768 weights and resume files (built once) and its work directory under ``--out``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    weights = build_weights(args.out)
    resume = build_resume(args.out)
    work = args.out / work_name
    work.mkdir(exist_ok=True)
    return args, weights, resume, work


def build_weights(out_dir: Path, hidden: int = 768, *, force: bool = False) -> Path:
    """MiniMind's fp16 weights file ``pretrain_{hidden}.pth``."""
    path = out_dir / f"pretrain_{hidden}.pth"
    if not _skip(path, force):
        out_dir.mkdir(parents=True, exist_ok=True)
        state_dict = _model(hidden).state_dict()
        _save({k: v.half().cpu() for k, v in state_dict.items()}, path)
    return path


def build_resume(out_dir: Path, hidden: int = 768, *, force: bool = False) -> Path:
    """The resume file ``pretrain_{hidden}_resume.pth`` (fp32 model, AdamW after one step)."""
    path = out_dir / f"pretrain_{hidden}_resume.pth"
    if _skip(path, force):
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _model(hidden)
    # Real AdamW step on random gradients: the state's keys, dtypes and layout are exactly
    # torch's, without the cost of a forward/backward pass at 104M parameters.
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, foreach=False)
    generator = torch.Generator().manual_seed(hidden + 1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu")
    resume_data = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 0,
        "step": 2000,
        "world_size": 8,
        "wandb_id": "bench-run",
        "scaler": scaler.state_dict(),
    }
    _save(resume_data, path)
    return path


def build_scaled_weights(
    out_dir: Path, scale: int, hidden: int = 768, *, force: bool = False
) -> Path:
    """``pretrain_{hidden}_x{scale}.pth``: the weights file's keys, each first dim times scale."""
    if scale < 1:
        raise ValueError("scale must be at least 1")
    path = out_dir / f"pretrain_{hidden}_x{scale}.pth"
    if _skip(path, force):
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in _model(hidden).state_dict().items()}
    generator = torch.Generator().manual_seed(scale)
    state_dict = {}
    for name, shape in shapes.items():
        tensor = torch.empty((shape[0] * scale, *shape[1:]), dtype=torch.float16)
        state_dict[name] = tensor.normal_(std=0.02, generator=generator)
    _save(state_dict, path)
    return path


def build_resume_pair(
    out_dir: Path = DEFAULT_OUT, hidden: int = 768, *, force: bool = False
) -> tuple[Path, Path, Path]:
    """``(resume, copy, changed)`` for diff benchmarks.

    ``copy`` is a byte copy of the resume file. ``changed`` is the resume file loaded (mmap,
    copy-on-write: the original is untouched), with element ``[0, 0]`` of ``model`` tensor
    ``CHANGED_TENSOR`` increased by 1, and saved again: every other tensor is equal.
    """
    resume = build_resume(out_dir, hidden, force=force)
    copy = out_dir / f"pretrain_{hidden}_resume_copy.pth"
    if not _skip(copy, force):
        tmp = Path(f"{copy}.tmp")
        shutil.copyfile(resume, tmp)
        os.replace(tmp, copy)
        _log(f"wrote {copy} (byte copy)")
    changed = out_dir / f"pretrain_{hidden}_resume_changed.pth"
    if not _skip(changed, force):
        ckpt = torch.load(resume, map_location="cpu", mmap=True, weights_only=True)
        ckpt["model"][CHANGED_TENSOR][0, 0] += 1
        _save(ckpt, changed)
    return resume, copy, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.build", description="Build MiniMind-sized benchmark checkpoints."
    )
    parser.add_argument("--hidden", type=int, default=768, choices=(512, 768))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--scale", type=int, metavar="N", help="also build the N-times file")
    parser.add_argument("--pair", action="store_true", help="also build the diff pair")
    parser.add_argument("--force", action="store_true", help="rebuild files that exist")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    build_weights(args.out, args.hidden, force=args.force)
    build_resume(args.out, args.hidden, force=args.force)
    if args.scale:
        build_scaled_weights(args.out, args.scale, args.hidden, force=args.force)
    if args.pair:
        build_resume_pair(args.out, args.hidden, force=args.force)
    _log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
