"""One rank of a small torch.distributed (gloo, CPU) run of ckpttool's training API; started by
tests/test_distributed.py as one process per rank, with the environment torchrun would give it
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Without ``WORLD_SIZE`` (or with 1)
it runs alone, without a process group, as ``python train.py`` would.

    python tests/workers/dist_worker.py train --save-dir DIR --log-dir DIR --name NAME
        [--resume] [--compile] [--pause-after EPOCH:STEP]
    python tests/workers/dist_worker.py probe-save --save-dir DIR

``train``: a MiniMind-shaped loop (DistributedSampler + SkipBatchSampler with ``set_epoch``,
DDP, AdamW, ``save_checkpoint`` every ``SAVE_INTERVAL`` steps and at each epoch's end,
``load_checkpoint`` + ``resume_training`` on every rank). Every trained batch is appended to
``LOG_DIR/NAME_rank{R}.jsonl`` (epoch, step, the global sample ids); at the end each rank writes
its model and optimizer state to ``LOG_DIR/NAME_final_rank{R}.pt``. ``--compile`` wraps the model
in ``torch.compile(backend="eager")`` (which adds the ``_orig_mod.`` prefix) under DDP, as
MiniMind does. ``--pause-after E:S`` stops after epoch E's step S (after its save, if any),
prints ``PAUSED`` and blocks until the parent SIGKILLs the whole group.

``probe-save``: checks the two distributed promises of ``save_checkpoint`` from inside every
rank (see ``probe_save``) and prints what each rank observed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ckpttool import SkipBatchSampler, checkpoint_paths, load_checkpoint, resume_training
from ckpttool import save_checkpoint as ckpttool_save_checkpoint

#: Divisible by BATCH_SIZE * world size for 1, 2 and 4 ranks: no padding by DistributedSampler,
#: no partial batch, so every epoch of an uninterrupted run trains each sample exactly once.
N_SAMPLES = 64
BATCH_SIZE = 2
EPOCHS = 3
SAVE_INTERVAL = 3
SEED = 42
WEIGHT = "dist"
HIDDEN = 4
#: How long a slowed ``torch.save`` sleeps in ``probe-save``: long enough that a rank not held
#: by a barrier reads the files before rank 0 has replaced them.
PROBE_DELAY_S = 0.5


class IndexedDataset(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Fixed random regression rows; an item carries its own index, the global sample id."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.features = torch.randn(N_SAMPLES, HIDDEN, generator=generator)
        self.targets = self.features @ torch.randn(HIDDEN, 1, generator=generator)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.features[index], self.targets[index]


def setup() -> tuple[int, int]:
    """``(rank, world_size)``; joins the process group when launched with more than one rank."""
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    rank = int(os.environ["RANK"])
    # a hang's bound, scaled as tests/support/timeouts.py does (this script runs by path, where
    # the tests package may not be importable)
    scale = float(os.environ.get("CKPTTOOL_TEST_TIMEOUT_SCALE") or 1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600 * scale)
    )
    return rank, world_size


def save(model: nn.Module, optimizer: Any, save_dir: Path, **kwargs: Any) -> tuple[Path, Path]:
    return ckpttool_save_checkpoint(
        model, optimizer, save_dir=save_dir, weight=WEIGHT, hidden_size=HIDDEN, **kwargs
    )


def train(args: argparse.Namespace, rank: int, world_size: int) -> None:
    pause_after = tuple(map(int, args.pause_after.split(":"))) if args.pause_after else None
    torch.manual_seed(0)
    dataset = IndexedDataset()
    model: nn.Module = nn.Linear(HIDDEN, 1)
    if args.compile:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    if world_size > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)

    start_epoch, start_step = 0, 0
    if args.resume:
        ckpt = load_checkpoint(args.save_dir, WEIGHT, HIDDEN)  # every rank loads
        if ckpt is None:
            sys.exit(f"rank {rank}: no resume file in {args.save_dir}")
        start_epoch, start_step = resume_training(ckpt, model, optimizer)
        print(f"RESUMED {start_epoch} {start_step}", flush=True)

    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, seed=SEED
    )
    log_path = args.log_dir / f"{args.name}_rank{rank}.jsonl"
    with log_path.open("a") as log:
        for epoch in range(start_epoch, EPOCHS):
            skip = start_step if epoch == start_epoch else 0
            batches = SkipBatchSampler(sampler, BATCH_SIZE, skip)
            batches.set_epoch(epoch)
            loader = DataLoader(dataset, batch_sampler=batches, generator=torch.Generator())
            iters = skip + len(loader)
            for step, (indices, features, targets) in enumerate(loader, start=skip + 1):
                loss = F.mse_loss(model(features), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                record = {"epoch": epoch, "step": step, "indices": indices.tolist()}
                log.write(json.dumps(record) + "\n")
                log.flush()
                if step % SAVE_INTERVAL == 0 or step == iters:
                    save(model, optimizer, args.save_dir, epoch=epoch, step=step)
                if (epoch, step) == pause_after:
                    print("PAUSED", flush=True)
                    sys.stdin.read()  # the parent SIGKILLs the group here; EOF: it went away
                    sys.exit(1)
    raw_model = model.module if isinstance(model, DistributedDataParallel) else model
    raw_model = getattr(raw_model, "_orig_mod", raw_model)  # torch.compile's wrapper
    final = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(final, args.log_dir / f"{args.name}_final_rank{rank}.pt")


def observe(save_dir: Path, rank: int) -> dict[str, Any]:
    """What this rank sees of the two files right after ``save_checkpoint`` returned."""
    weights_path, resume_path = checkpoint_paths(save_dir, WEIGHT, HIDDEN)
    seen: dict[str, Any] = {"files": sorted(os.listdir(save_dir))}
    try:
        resume = torch.load(resume_path, weights_only=True)
        weights = torch.load(weights_path, weights_only=True)
    except Exception as error:  # missing or incomplete: report it, the test asserts
        seen["error"] = f"{type(error).__name__}: {error}"[:200]
        return seen
    seen.update(
        step=resume["step"],
        world_size=resume["world_size"],
        saved_by=resume["saved_by"],
        weights_keys=sorted(weights),
        model_keys=sorted(resume["model"]),
    )
    return seen


def probe_save(save_dir: Path, rank: int, world_size: int) -> None:
    """Save three times; after each ``save_checkpoint`` returns, look at the files.

    ``torch.save`` is wrapped to count this rank's calls and to sleep ``PROBE_DELAY_S`` before
    writing: on rank 0 for saves 1 and 2, so a rank that returned without waiting for rank 0
    would find no files (save 1) or the previous save's (save 2); on every other rank always,
    so if another rank also wrote, its file would land after rank 0's and save 3 (rank 0 not
    slowed) would show its ``saved_by``. ``saved_by`` is this rank's number, passed in
    ``extra_state``: the files must always hold rank 0's.
    """
    real_save = torch.save
    calls = [0]
    slow_rank_zero = [True]

    def probing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if rank != 0 or slow_rank_zero[0]:
            time.sleep(PROBE_DELAY_S)
        real_save(obj, f, *args, **kwargs)

    torch.save = probing_save
    torch.manual_seed(0)
    model = nn.Linear(HIDDEN, 1)  # the same on every rank
    # DDP and real optimizers import torch._dynamo (seconds per rank); writing is what is probed.
    optimizer = types.SimpleNamespace(state_dict=dict)
    observed = []
    for step in (1, 2, 3):
        slow_rank_zero[0] = step < 3
        save(model, optimizer, save_dir, epoch=0, step=step, extra_state={"saved_by": rank})
        observed.append(observe(save_dir, rank))
        dist.barrier()  # the probe's own: every rank has looked before rank 0 saves again
    torch.save = real_save
    print(json.dumps({"rank": rank, "torch_save_calls": calls[0], "observed": observed}))


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train")
    train_parser.add_argument("--save-dir", type=Path, required=True)
    train_parser.add_argument("--log-dir", type=Path, required=True)
    train_parser.add_argument("--name", required=True)
    train_parser.add_argument("--resume", action="store_true")
    train_parser.add_argument("--compile", action="store_true")
    train_parser.add_argument("--pause-after", default=None, help="EPOCH:STEP")
    probe_parser = commands.add_parser("probe-save")
    probe_parser.add_argument("--save-dir", type=Path, required=True)
    args = parser.parse_args()

    rank, world_size = setup()
    if args.command == "train":
        train(args, rank, world_size)
    else:
        probe_save(args.save_dir, rank, world_size)
    if dist.is_initialized():
        dist.barrier()  # all ranks done with gloo before teardown (as examples/train_ddp.py)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
