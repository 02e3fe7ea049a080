"""What transformers' ``Trainer`` writes beside a model's weights in ``checkpoint-N/``: read by
the Hugging Face plug-in (a Trainer checkpoint) and by the PEFT plug-in (Trainer saves a PEFT
model's adapter in place of the weights), which may not import each other.

File names are transformers' own (``trainer.py``): ``optimizer.pt`` and ``scheduler.pt``,
``scaler.pt`` (mixed precision only), ``rng_state.pth`` (one process) or ``rng_state_{rank}.pth``
(each of several), ``training_args.bin``, and ``trainer_state.json``.
"""

from __future__ import annotations

import re

from ckpttool.frameworks.base import (
    OPTIMIZER,
    RNG,
    SCALER,
    SCHEDULER,
    TRAINER_STATE,
    TRAINING_ARGS,
    Member,
)

TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "rng_state.pth"
RNG_STATE_RANK = re.compile(r"^rng_state_(\d+)\.pth$")

#: Each file: its name, role, section of the merged tree and whether it is JSON.
TRAINER_MEMBERS = (
    (TRAINER_STATE_NAME, TRAINER_STATE, "trainer_state", True),
    (OPTIMIZER_NAME, OPTIMIZER, "optimizer", False),
    (SCHEDULER_NAME, SCHEDULER, "scheduler", False),
    (SCALER_NAME, SCALER, "scaler", False),
    (RNG_STATE_NAME, RNG, "rng", False),
    (TRAINING_ARGS_NAME, TRAINING_ARGS, "training_args", False),
)


def trainer_members(files: dict[str, int]) -> list[Member]:
    """The Trainer's files among ``files`` (name -> size) as members, then one RNG file per
    process of a multi-process run (``rng_state_{rank}.pth``, section ``rng.rank{rank}``)."""
    members = [
        Member(name, role, section, files[name], json=is_json)
        for name, role, section, is_json in TRAINER_MEMBERS
        if name in files
    ]
    for name, size in files.items():
        match = RNG_STATE_RANK.match(name)
        if match:
            rank = int(match.group(1))
            members.append(Member(name, RNG, f"rng.rank{rank}", size, rank=rank))
    return members
