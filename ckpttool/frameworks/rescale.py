"""What the frameworks' rescale plans share: ranks from file names, the saved world size, a
member's top-level dict, and a torch LR scheduler's counters moved by a number of steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, LayoutError
from ckpttool.frameworks.base import open_member
from ckpttool.model.lr_schedule import moved_counters
from ckpttool.model.rescaling import ValueChange


def ranks_of(files: dict[str, int], pattern: Any) -> dict[int, str]:
    ranks = {}
    for name in files:
        match = pattern.match(name)
        if match:
            ranks[int(match.group(1))] = name
    return dict(sorted(ranks.items()))


def saved_world_size(ranks: dict[int, Any], from_world_size: int | None, what: str) -> int:
    if from_world_size is not None:
        return from_world_size
    if ranks and sorted(ranks) == list(range(len(ranks))):
        return len(ranks)
    raise InputError(
        f"cannot tell how many processes wrote the checkpoint ({what}: ranks "
        f"{sorted(ranks) or 'none'}); pass --from-world-size M"
    )


def top_level(path: Path) -> dict[str, Any]:
    with open_member(path) as ckpt:
        if not isinstance(ckpt.root, dict):
            raise LayoutError(f"{path}: not a dict; cannot rescale its counters")
        return dict(ckpt.root)


def moved_scheduler(
    path: Path, name: str, old_steps: int, new_steps: int, *, expected_last_epoch: int
) -> tuple[dict[str, Any], list[ValueChange]]:
    """``last_epoch`` and ``_step_count`` of a scheduler state dict moved by the same amount."""
    state = top_level(path)
    last_epoch, step_count = state.get("last_epoch"), state.get("_step_count")
    if not isinstance(last_epoch, int) or not isinstance(step_count, int):
        raise LayoutError(f"{path}: no integer last_epoch/_step_count; not a torch LR scheduler")
    if last_epoch != expected_last_epoch:
        raise LayoutError(
            f"{path}: last_epoch is {last_epoch}, expected {expected_last_epoch} from the step "
            "count; the scheduler is not stepped the way this rescale assumes, so it is refused"
        )
    delta = new_steps - old_steps
    if delta == 0:
        return {}, []
    new = moved_counters(state, delta)
    return new, [ValueChange(name, key, state[key], value) for key, value in new.items()]
