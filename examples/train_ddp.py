"""Train a tiny MiniMind-style LM under DDP, checkpoint with ckpttool, resume, on any world size.

    torchrun --nproc_per_node 2 examples/train_ddp.py --stop-after 5   # 'crashes'
    torchrun --nproc_per_node 2 examples/train_ddp.py                   # resumes, ends
    python examples/train_ddp.py --epochs 3                             # 1 process

CPU only needs gloo (used when there is no GPU; NCCL and one GPU per rank otherwise); a run takes
seconds. Files go where MiniMind's lm_checkpoint puts them, ``--save-dir`` (default
``checkpoints``): ``pretrain_64.pth`` (fp16 weights) and ``pretrain_64_resume.pth``. Each run
resumes from the resume file when there is one. ``--stop-after N`` stops
after N steps as a crash would, with the steps since the last save lost: the next run trains
them again. Started with another number of processes, ``load_checkpoint`` rescales the saved
step (``step * saved_world_size // world_size``: the same number of samples consumed), and
``ckpttool rescale-step checkpoints/pretrain_64_resume.pth --world-size N`` does the same to the file.

What differs from MiniMind's train_pretrain.py, and why:

* ``save_checkpoint`` is called on **every** rank (MiniMind calls ``lm_checkpoint`` on rank 0
  only): rank 0 writes, then all ranks meet at a barrier, so no rank goes on (or exits) before
  the files are complete. Called on rank 0 alone, that barrier would never be met.
* The sampler is ``DistributedSampler`` for every world size, 1 included (MiniMind shuffles with
  a global ``randperm`` when not distributed): it deals one seeded permutation per epoch out to
  the ranks in turn, so after s steps on N ranks an epoch has consumed the first s * N * B
  samples of that permutation whatever N is, and a rescaled step skips only samples already
  trained (it repeats fewer than one batch per rank when the floor in the rescale bites).
* Only rank 0 restores the saved RNG state (``restore_rng=(rank == 0)``): the file holds rank
  0's, and restoring it everywhere would give every rank the same dropout masks.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ckpttool import SkipBatchSampler, load_checkpoint, resume_training, save_checkpoint

VOCAB, HIDDEN, HEADS, SEQ_LEN, SAMPLES = 128, 64, 4, 16, 64
WEIGHT = "pretrain"


class TinyLM(nn.Module):
    """Embedding, one pre-norm block (causal attention, SwiGLU MLP), tied lm_head: MiniMind's
    shape at toy size."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn_norm, self.mlp_norm, self.norm = (nn.RMSNorm(HIDDEN) for _ in range(3))
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN)
        self.gate_up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.dropout = nn.Dropout(0.1)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, HEADS, -1).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, length, HIDDEN)))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.dropout(self.down(F.silu(gate) * up))
        return self.lm_head(self.norm(x))


def get_lr(current_step: int, total_steps: int, lr: float) -> float:
    """MiniMind's schedule, a function of the step: nothing to save, and after a world-size
    change the rescaled step puts it where the samples consumed say it should be."""
    return lr / 10 + 0.5 * lr * (1 + math.cos(math.pi * current_step / total_steps))


def init_distributed() -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; joins torchrun's process group when launched by it."""
    if int(os.environ.get("RANK", -1)) == -1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def train(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: TensorDataset,
    sampler: DistributedSampler[int],
    start_epoch: int,
    start_step: int,
    device: torch.device,
) -> int:
    """MiniMind's loop from ``(start_epoch, start_step)``; returns the steps trained."""
    say = print if sampler.rank == 0 else (lambda *_: None)
    iters = math.ceil(len(sampler) / args.batch_size)
    trained = 0
    model.train()
    for epoch in range(start_epoch, args.epochs):
        skip = start_step if epoch == start_epoch else 0
        batches = SkipBatchSampler(sampler, args.batch_size, skip)
        batches.set_epoch(epoch)  # forwarded to DistributedSampler: a new order each epoch
        loader = DataLoader(dataset, batch_sampler=batches, generator=torch.Generator())
        for step, (batch,) in enumerate(loader, start=skip + 1):
            for group in optimizer.param_groups:
                group["lr"] = get_lr(epoch * iters + step, args.epochs * iters, args.learning_rate)
            batch = batch.to(device)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            trained += 1
            if step % args.save_interval == 0 or step == iters:
                # On every rank: rank 0 writes, then all wait until the files are complete.
                save_checkpoint(
                    model, optimizer, save_dir=args.save_dir, weight=WEIGHT, hidden_size=HIDDEN,
                    epoch=epoch, step=step,
                )  # fmt: skip
                say(f"epoch {epoch} step {step}/{iters}: loss {loss.item():.3f}, saved")
            if trained == args.stop_after:
                return trained
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--save-dir", type=Path, default=Path("checkpoints"), help="checkpoint directory"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--save-interval", type=int, default=3)
    parser.add_argument("--stop-after", type=int, default=None, help="steps, then 'crash'")
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank, world_size, device = init_distributed()
    # The "ckpttool" logger reports a world-size rescale at INFO; rank 0 speaks for all, on
    # stdout with the progress lines, in order.
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stdout)
    say = print if rank == 0 else (lambda *_: None)
    torch.manual_seed(42 + rank)  # once, before the model; later only dropout draws from it
    tokens = torch.randint(
        VOCAB, (SAMPLES, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1)
    )
    dataset = TensorDataset(tokens)
    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    say(f"world size {world_size} ({dist.get_backend() if world_size > 1 else 'no process group'})")

    start_epoch, start_step = 0, 0
    ckpt = load_checkpoint(args.save_dir, WEIGHT, HIDDEN, map_location=device)  # on every rank
    if ckpt is not None:
        start_epoch, start_step = resume_training(ckpt, model, optimizer, restore_rng=rank == 0)
        say(f"resumed at epoch {start_epoch}, step {start_step}")
    if world_size > 1:
        model = DistributedDataParallel(model)  # type: ignore[assignment]

    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, seed=42
    )
    trained = train(args, model, optimizer, dataset, sampler, start_epoch, start_step, device)
    if trained == args.stop_after:
        say(f"stopped after {trained} steps; run again to resume from the last save")
    else:
        say(f"done: epoch {args.epochs - 1} finished, {trained} steps in this run")
    if world_size > 1:
        # every rank done with gloo before any tears it down: a rank that exits while a peer's
        # gloo thread still talks to it can abort ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
