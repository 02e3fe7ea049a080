"""accelerate's ``Accelerator.save_state`` folders.

File names are accelerate's own (``accelerate/utils/constants.py``, ``checkpointing.py``): the
i-th prepared model as ``model.safetensors`` / ``model_{i}.safetensors`` (``pytorch_model.bin`` /
``pytorch_model_{i}.bin`` without safetensors), ``optimizer.bin`` / ``optimizer_{i}.bin``,
``scheduler.bin`` / ``scheduler_{i}.bin``, ``sampler.bin`` / ``sampler_{i}.bin``,
``dl_state_dict.bin`` / ``dl_state_dict_{i}.bin`` (stateful dataloaders), ``scaler.pt``, one
``random_states_{rank}.pkl`` per process (a ``torch.save`` zip despite its name) and
``custom_checkpoint_{i}.pkl`` for objects registered with ``register_for_checkpointing``.

``load_state`` restores every one of them and then the random state of its own process, so a
folder is complete when it has the weights and one random-state file for every rank from 0 to
the highest one present.
"""

from __future__ import annotations

import re

from ckpttool.frameworks.base import (
    CUSTOM,
    OPTIMIZER,
    OTHER,
    RNG,
    SAMPLER,
    SCALER,
    SCHEDULER,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    list_files,
)
from ckpttool.io.source import is_dir

ACCELERATE = "accelerate"

RANDOM_STATES = re.compile(r"^random_states_(\d+)\.pkl$")
CUSTOM_CHECKPOINT = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
#: (pattern, role, section of the first object): the i-th object's section gets ``_{i}``.
NUMBERED = (
    (re.compile(r"^model(?:_(\d+))?\.safetensors$"), WEIGHTS, "model"),
    (re.compile(r"^pytorch_model(?:_(\d+))?\.bin$"), WEIGHTS, "model"),
    (re.compile(r"^optimizer(?:_(\d+))?\.bin$"), OPTIMIZER, "optimizer"),
    (re.compile(r"^scheduler(?:_(\d+))?\.bin$"), SCHEDULER, "scheduler"),
    (re.compile(r"^sampler(?:_(\d+))?\.bin$"), SAMPLER, "sampler"),
    (re.compile(r"^dl_state_dict(?:_(\d+))?\.bin$"), SAMPLER, "dataloader"),
)
SCALER_NAME = "scaler.pt"
#: Files only ``save_state`` writes (a lone ``model.safetensors`` is a model directory).
MARKERS = (RANDOM_STATES, NUMBERED[2][0], NUMBERED[3][0], NUMBERED[4][0])


def detect(path: str) -> FrameworkDirectory | None:
    if not is_dir(path):
        return None
    files = list_files(path)
    if not any(pattern.match(name) for name in files for pattern in MARKERS):
        return None
    members = []
    for name, size in files.items():
        member = _member(name, size, files)
        members.append(member if member is not None else Member(name, OTHER, None, size))
    layout = FrameworkDirectory(
        kind=ACCELERATE, title="accelerate save_state folder", directory=path, members=members
    )
    if not any(m.role == WEIGHTS for m in members):
        layout.missing.append("the model weights (model.safetensors or pytorch_model.bin)")
    ranks = sorted(m.rank for m in members if m.role == RNG and m.rank is not None)
    if ranks:
        layout.details["ranks"] = ranks[-1] + 1
        layout.missing += [f"random_states_{r}.pkl" for r in range(ranks[-1] + 1) if r not in ranks]
    else:
        layout.missing.append("random_states_<rank>.pkl")
    layout.complete = not layout.missing
    return layout


def _member(name: str, size: int, files: dict[str, int]) -> Member | None:
    if name == SCALER_NAME:
        return Member(name, SCALER, "scaler", size)
    match = RANDOM_STATES.match(name)
    if match:
        rank = int(match.group(1))
        return Member(name, RNG, f"rng.rank{rank}", size, rank=rank)
    match = CUSTOM_CHECKPOINT.match(name)
    if match:
        return Member(name, CUSTOM, f"custom.{match.group(1)}", size)
    for pattern, role, section in NUMBERED:
        match = pattern.match(name)
        if match:
            if role == WEIGHTS and name.endswith(".bin") and "model.safetensors" in files:
                return None  # both formats: load_state reads the safetensors one
            index = match.group(1)
            return Member(
                name, role, section if index in (None, "0") else f"{section}_{index}", size
            )
    return None
