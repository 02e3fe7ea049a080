"""One DeepSpeed run of tests/test_deepspeed_resume.py, under torchrun (gloo, CPU).

``train OUT STAGE ACCUM SAVE_AT STEPS``: train a tiny model from dyadic weights for ``STEPS``
optimizer steps, ``save_checkpoint(OUT)`` after ``SAVE_AT`` of them (tag ``global_stepN``) and
at the end (tag ``final``): the reference run. ``resume OUT STAGE ACCUM UNIVERSAL STEPS``: load
the universal checkpoint ``UNIVERSAL`` (``load_universal``), train until ``STEPS`` and save
``final`` into ``OUT``. Every run reads the same global batches: micro-batch ``j`` of optimizer
step ``s`` is drawn from seed ``1000 s + j``, and rank ``r`` with ``ACCUM`` micro-batches per
step takes ``j = r * ACCUM + i``, so a run on 2 ranks x 1 and one on 1 rank x 2 see the same
samples per step. An optional last argument ``bf16`` trains in bf16. The last line printed is JSON: the engine's counters after the run.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

VOCAB, HIDDEN, SEQ, MICRO = 11, 6, 5, 2


class Tiny(nn.Module):
    """An embedding tied to the output layer, an odd-sized MLP, a frozen parameter, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(HIDDEN, 7)
        self.back = nn.Linear(7, HIDDEN)
        self.frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.arange(SEQ, dtype=torch.float32) / 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self.embed.weight.dtype  # bf16 runs: DeepSpeed casts the parameters only
        hidden = self.embed(ids) + self.offset[: ids.shape[1], None].to(dtype) + self.frozen.sum()
        hidden = hidden + self.back(torch.relu(self.fc(hidden)))
        return self.head(hidden)


def tiny() -> Tiny:
    model = Tiny()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # k / 256: the same bytes on every CPU
            param.copy_(torch.randint(-32, 33, param.shape, generator=generator) / 256)
    return model


def config(stage: int, accum: int, world: int, universal: bool, dtype: str) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "train_batch_size": MICRO * accum * world,
        "steps_per_print": 10**6,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 2.0**-6,
                "betas": [0.875, 0.9375],
                "eps": 2.0**-20,
                "weight_decay": 2.0**-4,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 2.0**-6,
                "warmup_num_steps": 8,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "checkpoint": {"load_universal": universal},
        "bf16": {"enabled": dtype == "bf16"},
    }


def micro_batch(step: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + index)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)


def main(mode: str, out: str, stage: int, accum: int, arg: str, steps: int, dtype: str) -> None:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny()
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=trained,
        config=config(stage, accum, world, mode == "resume", dtype),
    )
    save_at = int(arg) if mode == "train" else -1
    if mode == "resume":
        engine.load_checkpoint(arg)
    start, samples_at_start, lr_at_start = (
        engine.global_steps,
        engine.global_samples,
        engine.get_lr()[0],
    )
    for step in range(start, steps):
        for i in range(accum):
            ids = micro_batch(step, rank * accum + i)
            logits = engine(ids[:, :-1]).float()
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        if step + 1 == save_at:
            engine.save_checkpoint(out)
    engine.save_checkpoint(out, tag="final")
    torch.distributed.barrier()
    if rank == 0:
        counters = {"start": start, "samples_at_start": samples_at_start,
                    "lr_at_start": lr_at_start, "global_steps": engine.global_steps,
                    "global_samples": engine.global_samples, "lr": engine.get_lr()[0]}  # fmt: skip
        print(json.dumps(counters), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    mode, out, stage, accum, arg, steps = sys.argv[1:7]
    main(mode, out, int(stage), int(accum), arg, int(steps), (sys.argv[7:] or ["fp32"])[0])
    sys.stdout.flush()
    os._exit(0)
