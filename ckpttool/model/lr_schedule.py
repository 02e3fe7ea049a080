"""Where a saved LR scheduler stands when its run moves to another number of processes.

One rule for every rescale (a resume file, a Trainer or accelerate folder, DeepSpeed): a torch
LR scheduler's state dict counts the steps it was stepped in ``last_epoch``, and torch's own
count of ``step()`` calls, ``_step_count``, moves by the same amount (:func:`moved_counters`).

A resume file's scheduler (ckpttool's ``save_checkpoint``, MiniMind-style loops) is stepped
once per optimizer step, and ckpttool does not record gradient accumulation: with the per-rank
batch and the accumulation unchanged, the optimizer steps a run takes for the samples it has
seen scale like ``step``, so :func:`rescale_scheduler` takes ``last_epoch`` to
``last_epoch x saved // new`` (the floor, as for ``step``). The schedule's lengths that torch
stores in the state dict, and that ``load_state_dict`` restores over the resumed scheduler's own,
count the same steps and scale by the same factor (``T_max`` of ``CosineAnnealingLR``,
``total_iters`` of ``LinearLR``/``ConstantLR``/``PolynomialLR``, ``step_size`` of ``StepLR``,
``total_steps`` and the phase ends of ``OneCycleLR``): the schedule then stands at the same
fraction of the run, so the rate kept in ``_last_lr`` and in the optimizer is the new position's
rate when the division is exact. ``LambdaLR`` keeps its lambda in code, not in the file: it must
be written in the new run's steps (as a MiniMind-style ``len(loader)``-based one is). States
whose other counters cannot be moved by a factor (cycles of ``CosineAnnealingWarmRestarts``
and ``CyclicLR``, ``MultiStepLR``'s milestones, nested schedulers, ``ReduceLROnPlateau``'s
patience counters) are left as they are and the reason is returned, never silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "STEP_COUNTERS",
    "SchedulerRescale",
    "is_scheduler_state",
    "moved_counters",
    "rescale_scheduler",
]

#: What a torch LR scheduler's state dict counts its steps in.
STEP_COUNTERS = ("last_epoch", "_step_count")
#: Schedule lengths, in steps, that torch keeps in the state dict (and load_state_dict restores).
SCHEDULE_LENGTHS = ("T_max", "total_iters", "step_size", "total_steps")
#: Keys of states this rescale does not move, and the scheduler they come from.
NOT_MOVED = {
    "T_cur": "CosineAnnealingWarmRestarts (its cycle position and lengths)",
    "total_size": "CyclicLR (its cycle length)",
    "milestones": "MultiStepLR (its milestones)",
    "_schedulers": "SequentialLR or ChainedScheduler (its nested schedulers)",
    "num_bad_epochs": "ReduceLROnPlateau (it counts evaluations, not steps)",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_scheduler_state(state: Any) -> bool:
    """Whether ``state`` looks like a torch LR scheduler's ``state_dict()``."""
    return isinstance(state, Mapping) and _is_int(state.get("last_epoch"))


def moved_counters(
    state: Mapping[str, Any], delta: int, keys: tuple[str, ...] = STEP_COUNTERS
) -> dict[str, int]:
    """The integer step counters of ``state`` among ``keys``, each moved by ``delta``."""
    return {key: state[key] + delta for key in keys if _is_int(state.get(key))}


@dataclass(frozen=True)
class SchedulerRescale:
    """A scheduler state's rescale: the new state (None: left as it was), what changed, why."""

    state: dict[str, Any] | None
    changes: tuple[tuple[str, Any, Any], ...]  # (key, old, new); nested keys dotted
    note: str  # why the state was left as it was ("" when it moved or needs nothing)


def rescale_scheduler(state: Any, saved: int, world_size: int) -> SchedulerRescale:
    """``state`` (a scheduler stepped once per optimizer step) moved from ``saved`` to
    ``world_size`` processes: counters and schedule lengths times ``saved / world_size``."""
    if not is_scheduler_state(state):
        return SchedulerRescale(None, (), "no integer last_epoch: not a torch LR scheduler state")
    blocking = [what for key, what in NOT_MOVED.items() if key in state]
    if blocking:
        return SchedulerRescale(
            None,
            (),
            f"the scheduler is a {blocking[0]}, which cannot be moved by a factor: left at "
            f"last_epoch {state['last_epoch']}; rebuild it for the new number of processes",
        )
    old = state["last_epoch"]
    new = dict(state)
    new.update(moved_counters(state, old * saved // world_size - old))
    for key in SCHEDULE_LENGTHS:
        if _is_int(state.get(key)) and state[key] > 0:
            new[key] = max(1, state[key] * saved // world_size)
    phases = state.get("_schedule_phases")
    if isinstance(phases, list) and _is_int(state.get("total_steps")):
        new["_schedule_phases"] = _one_cycle_phases(
            phases, state["total_steps"], new["total_steps"]
        )
    changes = tuple(
        (key, state[key], new[key]) for key in (*STEP_COUNTERS, *SCHEDULE_LENGTHS)
        if key in state and new[key] != state[key]
    )  # fmt: skip
    if new.get("_schedule_phases") != phases:
        changes += tuple(
            (f"_schedule_phases[{i}].end_step", before.get("end_step"), after["end_step"])
            for i, (before, after) in enumerate(zip(phases, new["_schedule_phases"]))
            if after.get("end_step") != before.get("end_step")
        )
    return SchedulerRescale(new if changes else None, changes, "")


def _one_cycle_phases(phases: list[Any], total: int, new_total: int) -> list[Any]:
    """``OneCycleLR``'s phase ends for ``new_total`` steps: torch sets phase ``i`` (all but the
    last) to end at ``(i + 1) x pct_start x total - (i + 1)`` and the last at ``total - 1``."""
    moved = []
    for index, phase in enumerate(phases):
        if not isinstance(phase, dict) or not isinstance(phase.get("end_step"), (int, float)):
            return phases
        phase = dict(phase)
        if index == len(phases) - 1:
            end = new_total - 1  # torch writes an int here
            phase["end_step"] = end if _is_int(phase["end_step"]) else float(end)
        else:
            ahead = index + 1
            phase["end_step"] = (phase["end_step"] + ahead) * new_total / total - ahead
        moved.append(phase)
    return moved
