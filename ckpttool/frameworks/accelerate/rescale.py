"""``rescale-step`` of an accelerate ``save_state`` folder: the per-rank ``step``, the
schedulers' counters and the random-state files, planned file by file (the command writes the
directory).

The rules, from accelerate's own source (1.15, ``checkpointing.py``, ``scheduler.py``), assuming
the per-device batch size stays the same (docs/rescale-step.md explains each):
``random_states_{rank}.pkl`` holds
``accelerator.step``, the per-rank count of batches seen through ``accumulate`` since the
dataloader last ended: rescaled by ``saved // new``. ``AcceleratedScheduler.step`` steps the
wrapped scheduler ``num_processes`` times per optimizer step (unless ``split_batches``), so
``last_epoch`` counts per-rank batches over all ranks, ``optimizer_steps x saved``: after the
rescale it is ``(optimizer_steps x saved // new) x new``, unchanged when exact. A rank
without its file loads no ``step`` (stays 0, so ranks would disagree on when gradient
accumulation syncs): new ranks get a copy of rank 0's file.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.errors import LayoutError
from ckpttool.frameworks.accelerate.files import ACCELERATE, RANDOM_STATES
from ckpttool.frameworks.base import list_files
from ckpttool.frameworks.rescale import moved_scheduler, ranks_of, saved_world_size, top_level
from ckpttool.model.rescaling import (
    COPY,
    DROP,
    REWRITE,
    DirectoryPlan,
    FileAction,
    RescaleRequest,
    ValueChange,
    counter_plan,
)


def plan_accelerate(path: Path, request: RescaleRequest) -> DirectoryPlan:
    """What ``rescale-step`` does to each file of a ``save_state`` folder (the module
    docstring gives the rules)."""
    files = list_files(str(path))
    world_size, from_world_size, strict = (
        request.world_size,
        request.from_world_size,
        request.strict,
    )
    rng_ranks = ranks_of(files, RANDOM_STATES)
    saved = saved_world_size(rng_ranks, from_world_size, "random_states_*.pkl")
    if 0 not in rng_ranks:
        raise LayoutError(f"{path}: no random_states_0.pkl; accelerate's step is not known")
    step = top_level(path / rng_ranks[0]).get("step")
    plan = counter_plan("step", step if step is not None else -1, saved, world_size, strict)
    changes: list[ValueChange] = []
    actions: list[FileAction] = []
    notes: list[str] = []
    schedulers = [n for n in files if n == "scheduler.bin" or _is_numbered(n, "scheduler_")]
    for name in schedulers:
        state = top_level(path / name)
        last_epoch = state.get("last_epoch")
        if not isinstance(last_epoch, int) or last_epoch % saved:
            raise LayoutError(
                f"{path / name}: last_epoch {last_epoch!r} is not a multiple of {saved} "
                "processes; accelerate's AcceleratedScheduler steps the scheduler once per "
                "process per optimizer step unless split_batches, which this rescale assumes"
            )
        optimizer_steps = last_epoch // saved
        new_last = optimizer_steps * saved // world_size * world_size
        new, found = moved_scheduler(path / name, name, last_epoch, new_last,
                                      expected_last_epoch=last_epoch)  # fmt: skip
        changes += found
        actions.append(FileAction(name, name, REWRITE, new, "num_processes steps per "
                                  "optimizer step") if new else FileAction(name, name, COPY))  # fmt: skip
        if not new:
            notes.append(
                f"{name}: last_epoch {last_epoch} = {optimizer_steps} optimizer steps x {saved} "
                f"processes = {last_epoch // world_size} x {world_size}: unchanged, as "
                "AcceleratedScheduler steps it num_processes times per optimizer step"
            )
    rng_names = set(rng_ranks.values())
    for name in files:
        if name not in rng_names and name not in schedulers:
            actions.append(FileAction(name, name, COPY))
    for rank, source in rng_ranks.items():
        if rank >= world_size:
            actions.append(FileAction(source, source, DROP, why=f"no rank {rank} any more"))
    for rank in range(world_size):
        name = f"random_states_{rank}.pkl"
        source = rng_ranks.get(rank, rng_ranks[0])
        rank_step = top_level(path / source).get("step")
        new_step = rank_step * saved // world_size if isinstance(rank_step, int) else rank_step
        why = "" if source == name else (
            "a copy of rank 0's: without one, load_state leaves this rank's step at 0"
        )  # fmt: skip
        if new_step != rank_step:
            changes.append(ValueChange(name, "step", rank_step, new_step))
            actions.append(FileAction(name, source, REWRITE, {"step": new_step}, why))
        else:
            actions.append(FileAction(name, source, COPY, why=why))
    if world_size > len(rng_ranks):
        notes.append(
            "new ranks start from rank 0's random states: their random streams repeat rank 0's"
        )
    return DirectoryPlan(ACCELERATE, plan, actions, changes, notes)


def _is_numbered(name: str, prefix: str) -> bool:
    stem = name[len(prefix) : -len(".bin")] if name.endswith(".bin") else ""
    return name.startswith(prefix) and stem.isdigit()
