"""Train a tiny MiniMind-like LM for a few steps, save with ckpttool, then resume from the file.

    python examples/train_tiny.py [--save-dir checkpoints]   # default: a temp dir

Runs in seconds on a CPU. "Crashes" (stops) after ``--stop-after`` steps of a 2-epoch run, right
after a save, then rebuilds everything as a new process would, resumes with ``load_checkpoint`` +
``resume_training`` and finishes the run with ``SkipBatchSampler`` skipping the trained batches.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpttool import (
    SkipBatchSampler,
    checkpoint_paths,
    load_checkpoint,
    resume_training,
    save_checkpoint,
)

VOCAB, HIDDEN, LAYERS, HEADS, SEQ_LEN = 128, 64, 2, 4, 16
SAMPLES, BATCH_SIZE, EPOCHS, SAVE_INTERVAL = 72, 8, 2, 3


class Block(nn.Module):
    """Pre-norm transformer block: RMSNorm, causal attention, SwiGLU MLP (as in MiniMind)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN)
        self.gate_up = nn.Linear(HIDDEN, 2 * 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, HEADS, -1).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, length, HIDDEN)))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.dropout(self.down(F.silu(gate) * up))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as in MiniMind
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


Parts = tuple[TinyLM, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]


def build() -> Parts:
    torch.manual_seed(0)  # once, before the model; afterwards the global RNG is dropout's alone
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = EPOCHS * math.ceil(SAMPLES / BATCH_SIZE)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    return model, optimizer, scheduler


def train(
    save_dir: Path, parts: Parts, start_epoch: int, start_step: int, stop_after: int | None
) -> int:
    """The loop; returns the number of steps trained. ``stop_after`` simulates a crash."""
    model, optimizer, scheduler = parts
    tokens = torch.randint(
        VOCAB, (SAMPLES, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1)
    )
    dataset = TensorDataset(tokens)
    iters, trained = math.ceil(SAMPLES / BATCH_SIZE), 0
    model.train()
    for epoch in range(start_epoch, EPOCHS):
        # Epoch order from its own generator (not a global reseed) and a loader with its own
        # generator: the global RNG restored by resume_training stays untouched.
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(42 + epoch))
        skip = start_step if epoch == start_epoch else 0
        batches = SkipBatchSampler(order.tolist(), BATCH_SIZE, skip_batches=skip)
        loader = DataLoader(dataset, batch_sampler=batches, generator=torch.Generator())
        for step, (batch,) in enumerate(loader, start=skip + 1):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            trained += 1
            if step % SAVE_INTERVAL == 0 or step == iters:
                _, resume_path = save_checkpoint(
                    model, optimizer, save_dir=save_dir, weight="pretrain", hidden_size=HIDDEN,
                    epoch=epoch, step=step, scheduler=scheduler,
                )  # fmt: skip
                print(
                    f"epoch {epoch} step {step}: loss {loss.item():.4f}, saved {resume_path.name}"
                )
            if stop_after is not None and trained == stop_after:
                return trained
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--save-dir", type=Path, default=None, help="checkpoint dir (default: a temp dir)"
    )
    parser.add_argument("--stop-after", type=int, default=12, help="steps before the 'crash'")
    args = parser.parse_args()
    save_dir = args.save_dir or Path(tempfile.mkdtemp(prefix="train_tiny-"))
    torch.set_num_threads(1)

    first = build()
    train(save_dir, first, 0, 0, args.stop_after)
    weights_path, resume_path = checkpoint_paths(save_dir, "pretrain", HIDDEN)
    print(f"wrote {weights_path} ({weights_path.stat().st_size:,} bytes, fp16)")
    print(f"wrote {resume_path} ({resume_path.stat().st_size:,} bytes, fp32 + optimizer + RNG)")

    # A new process would start here: build everything, then restore it from the resume file.
    second = build()
    ckpt = load_checkpoint(save_dir, "pretrain", HIDDEN)
    assert ckpt is not None
    start_epoch, start_step = resume_training(ckpt, second[0], second[1], scheduler=second[2])
    print(f"resumed at epoch {start_epoch}, step {start_step} (batches of that epoch skipped)")
    same = all(
        torch.equal(value, second[0].state_dict()[key])
        for key, value in first[0].state_dict().items()
    )
    print(f"resumed weights equal the model at the 'crash': {same}")
    if not same:
        print("(it trained past its last save; those steps are trained again)")
    trained = train(save_dir, second, start_epoch, start_step, None)
    print(f"finished the run: {trained} more steps")


if __name__ == "__main__":
    main()
