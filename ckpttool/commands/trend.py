"""``trend``: how a run's weights moved from checkpoint to checkpoint.

The checkpoints are files, or one run directory listed the way ``repair`` lists it (a Trainer
``output_dir``'s ``checkpoint-N/``, a DeepSpeed save directory's tags, a directory of checkpoint
files, a directory of DCP checkpoint directories), ordered by step: by the checkpoint's own counters when every one has them (DeepSpeed's
``global_steps``, the Trainer's ``trainer_state.global_step``, a resume file's ``epoch`` and
``step``...), else by the number in their names, else as given.

Each consecutive pair is compared by ``diff``'s streamed value reader with norms
(:func:`ckpttool.commands.diff.run.run_diff`, ``norms=True``): one tensor of two checkpoints in
memory at a time, a chunk at a time. Each checkpoint but the first and the last is therefore
read twice (as the newer side of one pair and the older of the next). From those measures,
per tensor and per module group (:class:`ckpttool.model.modules.ModuleGroups`: a run of blocks
folds only when they hold the same tensors, dtypes and shapes at every checkpoint), at each
checkpoint: its norm ‖W‖, its update ‖W_i - W_{i-1}‖ and relative update
‖W_i - W_{i-1}‖ / ‖W_{i-1}‖, and its NaN and Inf counts. And the findings:

* **first non-finite**: the first checkpoint where a tensor holds a NaN or an Inf, and which;
* **never changed**: tensors whose update is 0 at every checkpoint (frozen, by design or by
  mistake), and the modules all of whose tensors are (``layers.1``: the largest such key
  prefixes, not folded: a frozen layer is named as itself);
* **jumps**: a module group's relative update at checkpoint i is a jump when it is more than
  :data:`JUMP_FACTOR` times the median of that group's relative updates at the checkpoints
  before it (at least :data:`JUMP_HISTORY` of them, with a median above 0).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.diff.run import DiffReport, open_side, plan_diff, run_diff
from ckpttool.commands.repair_directory import STEP, checkpoint_files
from ckpttool.commands.selection import Selection
from ckpttool.errors import InputError
from ckpttool.formats.registry import directory_format_of
from ckpttool.frameworks.base import view_facts
from ckpttool.frameworks.registry import frameworks
from ckpttool.io.parallel import ordered_map, serialized
from ckpttool.io.progress import ProgressCallback
from ckpttool.model.modules import ModuleGroups
from ckpttool.model.roles import STEP_KEYS, WHOLE_FILE, layout_of, model_part

JUMP_FACTOR = 10.0  # an update this many times the median of the previous ones is a jump
JUMP_HISTORY = 2  # previous updates needed before a jump can be called


@dataclass(frozen=True)
class TrendPoint:
    """One checkpoint of the run."""

    path: str
    name: str  # as listed: the run directory's entry, or the path given
    step: int | None  # from its counters (None: none found)
    epoch: int | float | None  # a resume file's epoch, when it has one
    section: str | None  # the part compared: its model weights ("model"), None for all


@dataclass
class TensorTrend:
    """One tensor across the run; each list has one entry per checkpoint (None: the tensor
    is not in that checkpoint, or has no numeric values)."""

    key: str
    group: str  # its module group, set once the whole run is read
    norms: list[float | None]
    updates: list[float | None]  # ‖W_i - W_{i-1}‖; None at the first checkpoint
    nan: list[int | None]
    inf: list[int | None]
    sum_sq: list[float | None] = field(default_factory=list, repr=False)
    update_sq: list[float | None] = field(default_factory=list, repr=False)

    @property
    def relative_updates(self) -> list[float | None]:
        return [_ratio(u, n) for u, n in zip(self.updates, [None, *self.norms[:-1]])]

    @property
    def never_changed(self) -> bool:
        """Present and measured at every checkpoint, and its update always 0."""
        updates = self.updates[1:]
        return bool(updates) and all(u == 0.0 for u in updates)


@dataclass
class GroupTrend:
    """A module group across the run: norms and updates over its tensors (sqrt of sums)."""

    group: str
    tensors: int
    norms: list[float | None]
    updates: list[float | None]
    nonfinite: list[int]  # NaN and Inf elements of its tensors at each checkpoint

    @property
    def relative_updates(self) -> list[float | None]:
        return [_ratio(u, n) for u, n in zip(self.updates, [None, *self.norms[:-1]])]


@dataclass(frozen=True)
class Jump:
    """A module group whose relative update jumped at one checkpoint."""

    checkpoint: int  # index into TrendReport.checkpoints
    group: str
    relative_update: float
    median_before: float  # of the group's previous relative updates


@dataclass
class TrendReport:
    checkpoints: list[TrendPoint]
    order: str  # "step", "name" or "given": how the checkpoints were ordered
    tensors: list[TensorTrend]
    groups: list[GroupTrend]
    first_nonfinite: int | None  # index of the first checkpoint holding a NaN or an Inf
    nonfinite_tensors: list[str]  # the tensors holding them there
    never_changed: list[str]  # tensors equal at every checkpoint
    frozen_modules: list[str]  # largest key prefixes all of whose tensors never changed
    jumps: list[Jump]
    notes: list[str]

    @property
    def healthy(self) -> bool:
        """No NaN or Inf anywhere (``trend``'s exit status 0; 1 otherwise)."""
        return self.first_nonfinite is None


def _ratio(update: float | None, norm: float | None) -> float | None:
    if update is None or norm is None:
        return None
    if update == 0:
        return 0.0
    return update / norm if norm > 0 else math.inf


def list_run(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[str], list[str]]:
    """The checkpoints to follow: ``paths`` as given, or one run directory's checkpoints
    (oldest first, as ``repair`` lists them). Returns (paths, names)."""
    if len(paths) == 1 and os.path.isdir(paths[0]):
        directory = str(paths[0])
        run = next((r for f in frameworks() if (r := f.run_layout(directory)) is not None), None)
        if run is None:
            run = checkpoint_files(Path(directory))
        names = list(run.checkpoints) if run is not None else []
        if not names and directory_format_of(directory) is None:  # DCP checkpoint directories
            names = sorted(
                entry.name for entry in os.scandir(directory)
                if entry.is_dir() and directory_format_of(entry.path) is not None
            )  # fmt: skip
        if names:
            return [os.path.join(directory, name) for name in names], names
        # not a run directory: one checkpoint directory (DCP, a model directory...)
    return [str(p) for p in paths], [str(p) for p in paths]


def _step(ckpt: Checkpoint) -> tuple[int | None, int | float | None]:
    """The checkpoint's step and epoch from its own counters (None: not found)."""
    facts = view_facts(ckpt)
    places: list[Any] = [facts.counters if facts is not None else None, ckpt.root]
    if isinstance(ckpt.root, dict):
        # torchtitan's trainer_state/train_state; mmengine's meta (epoch, iter)
        places += [ckpt.root.get(key) for key in ("trainer_state", "train_state", "meta")]
    step = epoch = None
    for place in places:
        if not isinstance(place, dict):
            continue
        for key in STEP_KEYS:  # a view's counters first (DeepSpeed's global_steps), then the top
            value = place.get(key)
            if step is None and isinstance(value, int) and not isinstance(value, bool):
                step = value
        value = place.get("epoch")
        if epoch is None and isinstance(value, int) and not isinstance(value, bool):
            epoch = value  # (the Trainer's fractional epoch follows its global_step: unused)
    return step, epoch


def _section(ckpt: Checkpoint) -> str | None:
    part = model_part(ckpt.root, layout_of(ckpt))
    return None if part in (None, WHOLE_FILE) else part


def ordered_points(paths: list[str], names: list[str]) -> tuple[list[TrendPoint], str]:
    """Each checkpoint with its step, in step order (else by the numbers in their names, else
    as given), and which of "step", "name", "given" ordered them."""

    def point(listed: tuple[str, str]) -> TrendPoint:
        path, name = listed
        with open_side(path) as ckpt:
            step, epoch = _step(ckpt)
            return TrendPoint(path, name, step, epoch, _section(ckpt))

    points = ordered_map(point, list(zip(paths, names)))
    if all(p.step is not None for p in points):
        ordered = sorted(points, key=lambda p: (p.epoch if p.epoch is not None else -1, p.step))
        return ordered, "step"
    numbers = [STEP.search(Path(p.name.rstrip("/")).name) for p in points]
    if all(numbers) and len({int(m.group(1)) for m in numbers if m}) == len(points):
        keyed = sorted(zip((int(m.group(1)) for m in numbers if m), range(len(points))))
        return [points[i] for _, i in keyed], "name"
    return points, "given"


def trend(
    paths: Sequence[str | os.PathLike[str]],
    *,
    progress: ProgressCallback | None = None,
) -> TrendReport:
    """Follow the tensors of ``paths`` (checkpoints, or one run directory) across the run."""
    if not paths:
        raise InputError("trend: no checkpoint given")
    listed, names = list_run(paths)
    points, order = ordered_points(listed, names)
    count = len(points)
    tensors: dict[str, TensorTrend] = {}
    described: dict[str, list[Any]] = {}  # key -> its (dtype, shape) at each checkpoint
    notes: list[str] = []

    def trend_of(key: str) -> TensorTrend:
        entry = tensors.get(key)
        if entry is None:
            none: list[Any] = [None] * count
            described[key] = list(none)
            entry = tensors[key] = TensorTrend(
                key, key, list(none), list(none), list(none), list(none),
                list(none), list(none),
            )  # fmt: skip
        return entry

    pairs = [(0, 0)] if count == 1 else [(i - 1, i) for i in range(1, count)]
    advance = serialized(progress)

    def compared(pair: tuple[int, int]) -> DiffReport:
        before, after = pair
        with open_side(points[before].path) as ckpt_a, open_side(points[after].path) as ckpt_b:
            plan = plan_diff(
                ckpt_a, ckpt_b, Selection(),
                section_a=points[before].section, section_b=points[after].section,
                as_stored=False,  # the weights a run trains, as the view gives them
            )  # fmt: skip
            return run_diff(ckpt_a, ckpt_b, plan, norms=True, progress=advance)

    # --jobs: N pairs compared at once (each holds one tensor of its two checkpoints), their
    # measures folded in pair order, as a loop would
    for (before, after), report in zip(pairs, ordered_map(compared, pairs)):
        for entry in report.tensors:
            values = entry.values
            item = trend_of(entry.key)
            for index, record in ((before, entry.a), (after, entry.b)):
                if record is not None:
                    described[entry.key][index] = (record.dtype, tuple(record.shape))
            if values is None or not values.measured:
                continue
            if before == 0:
                item.norms[0], item.sum_sq[0] = values.norm_a, values.sum_sq_a
                item.nan[0], item.inf[0] = values.nan_a, values.inf_a
            if after != before:
                item.norms[after], item.sum_sq[after] = values.norm_b, values.sum_sq_b
                item.nan[after], item.inf[after] = values.nan_b, values.inf_b
                item.updates[after], item.update_sq[after] = values.diff_norm, values.sum_sq_diff
    grouping = ModuleGroups((key, tuple(shapes)) for key, shapes in described.items())
    for item in tensors.values():
        item.group = grouping.group(item.key)
    groups = _groups(list(tensors.values()), count)
    first, which = _first_nonfinite(list(tensors.values()), count)
    never = [t.key for t in tensors.values() if t.never_changed]
    frozen = _frozen_modules(list(tensors), set(never))
    if order == "given" and count > 1:
        notes.append(
            "the checkpoints have no step counters and no distinct numbers in their names: "
            "followed in the order given"
        )
    return TrendReport(
        points, order, list(tensors.values()), groups, first, which, never, frozen,
        _jumps(groups), notes,
    )  # fmt: skip


def _groups(tensors: list[TensorTrend], count: int) -> list[GroupTrend]:
    by_name: dict[str, list[TensorTrend]] = {}
    for item in tensors:
        by_name.setdefault(item.group, []).append(item)
    out = []
    for name, members in by_name.items():
        norms: list[float | None] = []
        updates: list[float | None] = []
        for i in range(count):
            squares = [m.sum_sq[i] for m in members if m.sum_sq[i] is not None]
            norms.append(math.sqrt(sum(s for s in squares if s is not None)) if squares else None)
            steps = [m.update_sq[i] for m in members if m.update_sq[i] is not None]
            updates.append(math.sqrt(sum(s for s in steps if s is not None)) if steps else None)
        nonfinite = [sum((m.nan[i] or 0) + (m.inf[i] or 0) for m in members) for i in range(count)]
        out.append(GroupTrend(name, len(members), norms, updates, nonfinite))
    return out


def _frozen_modules(keys: list[str], never: set[str]) -> list[str]:
    """The largest key prefixes (``layers.1``, or a whole key) all of whose tensors never
    changed, in key order."""
    total: dict[str, int] = {}
    frozen: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            total[prefix] = total.get(prefix, 0) + 1
            if key in never:
                frozen[prefix] = frozen.get(prefix, 0) + 1
    whole = {prefix for prefix, n in total.items() if frozen.get(prefix) == n}

    def inside_another(prefix: str) -> bool:
        parts = prefix.split(".")
        return any(".".join(parts[:end]) in whole for end in range(1, len(parts)))

    return [prefix for prefix in total if prefix in whole and not inside_another(prefix)]


def _first_nonfinite(tensors: list[TensorTrend], count: int) -> tuple[int | None, list[str]]:
    for i in range(count):
        keys = [t.key for t in tensors if (t.nan[i] or 0) + (t.inf[i] or 0) > 0]
        if keys:
            return i, keys
    return None, []


def _jumps(groups: list[GroupTrend]) -> list[Jump]:
    """Relative updates above JUMP_FACTOR x the median of the group's previous ones."""
    out = []
    for group in groups:
        history: list[float] = []
        for i, value in enumerate(group.relative_updates):
            if value is None or not math.isfinite(value):
                continue
            if len(history) >= JUMP_HISTORY:
                median = statistics.median(history)
                if median > 0 and value > JUMP_FACTOR * median:
                    out.append(Jump(i, group.group, value, median))
            history.append(value)
    return sorted(out, key=lambda jump: jump.checkpoint)
