"""``diff --by-module`` and ``--top N``: where a checkpoint changed, along its module hierarchy.

Tensors are grouped by :func:`module_groups` (their module, runs of blocks of the same structure
on both sides folded: ``layers.#.mlp.up_proj``; any other numbered module its own group). A group's relative change is parameter-weighted:
``sqrt(sum ‖B - A‖²) / sqrt(sum ‖A‖²)`` over its measured tensors, so a large matrix weighs
more than a bias, and a group's value is what one would get by flattening all of its tensors
into one vector. The sums need ‖A‖ of identical tensors too, which ``diff`` measures only when
asked (``norms=True``, which ``--by-module`` sets). A step counter (an optimizer's per-parameter
``step``) is not weighed in: its one element, 4 -> 8, would be the group's whole change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpttool.commands.diff.run import IDENTICAL, DiffReport, TensorDiff
from ckpttool.model.edits import COUNTER_NAMES
from ckpttool.model.modules import ModuleGroups
from ckpttool.model.records import TensorRecord


@dataclass
class ModuleChange:
    """How one module group changed (sums over its tensors)."""

    group: str  # "layers.#.mlp.up_proj"
    tensors: int = 0  # tensors in the group (both sides, or one)
    changed: int = 0  # tensors whose values, dtype, shape or presence differ
    unmeasured: int = 0  # tensors with no measure (one side only, a shape change, no numbers)
    counters: int = 0  # step counters, not weighed into the change (``COUNTER_NAMES``)
    parameters: int = 0  # elements of the measured tensors
    sum_sq_a: float = 0.0
    sum_sq_diff: float = 0.0

    @property
    def relative_change(self) -> float | None:
        """sqrt(sum ‖B - A‖²) / sqrt(sum ‖A‖²); None when no tensor was measured."""
        if self.parameters == 0:
            return None
        if self.sum_sq_diff == 0:
            return 0.0
        return math.sqrt(self.sum_sq_diff / self.sum_sq_a) if self.sum_sq_a > 0 else math.inf


def module_groups(report: DiffReport) -> ModuleGroups:
    """The report's module groups: a block folds with its neighbours only when its tensors
    match theirs in dtype and shape on both sides (a layer resized, added or removed in B
    stands alone)."""

    def side(record: TensorRecord | None) -> tuple[str, tuple[int, ...]] | None:
        return None if record is None else (record.dtype, tuple(record.shape))

    return ModuleGroups((entry.key, (side(entry.a), side(entry.b))) for entry in report.tensors)


def by_module(report: DiffReport) -> list[ModuleChange]:
    """The report's tensors rolled up by module group, in the order groups first appear."""
    groups: dict[str, ModuleChange] = {}
    names = module_groups(report)
    for entry in report.tensors:
        name = names.group(entry.key)
        group = groups.get(name)
        if group is None:
            group = groups[name] = ModuleChange(name)
        group.tensors += 1
        if entry.status != IDENTICAL:
            group.changed += 1
        values = entry.values
        if entry.key.rpartition(".")[2] in COUNTER_NAMES:
            group.counters += 1
            continue
        if values is None or not values.measured:  # (identical ones: measured with norms)
            group.unmeasured += 1
            continue
        group.parameters += values.numel
        group.sum_sq_a += values.sum_sq_a
        group.sum_sq_diff += values.sum_sq_diff
    return list(groups.values())


def top_changed(report: DiffReport, count: int) -> list[TensorDiff]:
    """The ``count`` tensors with the largest relative change (unmeasured ones left out;
    ties in key order)."""

    def change(entry: TensorDiff) -> float:
        values = entry.values
        value = values.relative_change if values is not None else None
        return -1.0 if value is None else value

    measured = [entry for entry in report.tensors if change(entry) > 0]
    return sorted(measured, key=lambda entry: -change(entry))[:count]
