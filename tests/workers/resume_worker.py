"""A tiny MiniMind-style training run that can be killed and resumed; run as a subprocess by
tests/test_exact_resume.py:

    python tests/workers/resume_worker.py --save-dir DIR --log LOG --final FINAL \
        [--resume] [--pause-after EPOCH:STEP]

It trains a small LM with dropout under fp16 autocast with a GradScaler (whose scale overflows,
backs off and grows again, so skipped steps make the scaler state matter to the weights), AdamW
and a warmup+cosine LambdaLR, over shuffled data through SkipBatchSampler, saving every
``SAVE_INTERVAL`` steps and at the end of each epoch as MiniMind does. Each trained batch is
appended to LOG as a JSON line; the final model/optimizer/scaler/scheduler state goes to FINAL.

The loop follows the rules README.md gives for an exact resume:

* the global RNG is seeded once, before the model is built, and then used only by dropout;
* each epoch's order is a permutation from its own ``torch.Generator`` seeded ``42 + epoch``
  (MiniMind's seed) instead of MiniMind's global ``setup_seed(42 + epoch)``, which would
  overwrite the restored RNG state at the start of the resumed epoch;
* the DataLoader gets its own generator: ``iter(DataLoader)`` otherwise draws a seed from the
  global torch RNG at every epoch start, one draw more in a resumed run than in the original;
* ``resume_training`` runs after everything is built and seeded, right before the loop.

``--pause-after E:S`` stops after epoch E's step S (after its save, if any), prints ``PAUSED``
and blocks until the parent kills it (or closes stdin).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ckpttool import SkipBatchSampler, load_checkpoint, resume_training, save_checkpoint

N_SAMPLES = 30
SEQ_LEN = 8
VOCAB = 32
HIDDEN = 16
BATCH_SIZE = 4
EPOCHS = 3
SAVE_INTERVAL = 3
WARMUP_STEPS = 4
WEIGHT = "pretrain"
#: Batches per epoch, counting the trailing partial one (30 samples / 4 = 7 full + 1 of 2).
ITERS = math.ceil(N_SAMPLES / BATCH_SIZE)


class TokenDataset(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Fixed random token rows; an item is ``(index, input_ids, labels)`` shifted by one."""

    def __init__(self) -> None:
        self.tokens = torch.randint(
            VOCAB, (N_SAMPLES, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1234)
        )

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return index, row[:-1], row[1:]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(
            nn.Dropout(0.1), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Dropout(0.1)
        )
        self.head = nn.Linear(4 * HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(input_ids)))


def lr_factor(step: int) -> float:
    """Linear warmup, then cosine decay to 10% over the whole run."""
    total = EPOCHS * ITERS
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--final", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause-after", default=None, help="EPOCH:STEP")
    args = parser.parse_args()
    pause_after = tuple(map(int, args.pause_after.split(":"))) if args.pause_after else None
    # The scaler skips the very first optimizer step (overflow), which the scheduler warns about.
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    dataset = TokenDataset()
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)

    start_epoch, start_step = 0, 0
    if args.resume:
        ckpt = load_checkpoint(args.save_dir, WEIGHT, HIDDEN)
        if ckpt is None:
            sys.exit(f"no resume file in {args.save_dir}")
        start_epoch, start_step = resume_training(
            ckpt, model, optimizer, scaler=scaler, scheduler=scheduler
        )

    model.train()
    with args.log.open("a") as log:
        for epoch in range(start_epoch, EPOCHS):
            order = torch.randperm(
                N_SAMPLES, generator=torch.Generator().manual_seed(42 + epoch)
            ).tolist()
            skip = start_step if epoch == start_epoch else 0
            loader = DataLoader(
                dataset,
                batch_sampler=SkipBatchSampler(order, BATCH_SIZE, skip),
                generator=torch.Generator(),
            )
            for step, (indices, input_ids, labels) in enumerate(loader, start=skip + 1):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(input_ids)
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                record = {
                    "epoch": epoch,
                    "step": step,
                    "indices": indices.tolist(),
                    "loss": loss.item(),
                    "scale": scaler.get_scale(),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(f"step {epoch} {step}", flush=True)
                if step % SAVE_INTERVAL == 0 or step == ITERS:
                    save_checkpoint(
                        model,
                        optimizer,
                        save_dir=args.save_dir,
                        weight=WEIGHT,
                        hidden_size=HIDDEN,
                        epoch=epoch,
                        step=step,
                        scaler=scaler,
                        scheduler=scheduler,
                    )
                    print(f"saved {epoch} {step}", flush=True)
                if (epoch, step) == pause_after:
                    print("PAUSED", flush=True)
                    sys.stdin.read()  # the parent SIGKILLs us here; EOF means it went away
                    sys.exit(1)

    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "scheduler": scheduler.state_dict(),
        },
        args.final,
    )


if __name__ == "__main__":
    main()
