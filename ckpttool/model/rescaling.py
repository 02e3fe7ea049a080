"""Rescaling step counters for a new number of processes: the pure pieces every rescale shares.

:class:`RescalePlan` is the arithmetic (old step x saved world size = global batches; the new
step is their floor over the new world size, and the floor's cost in repeated batches).
:func:`counter_plan` makes one for a counter found in a framework's file; :class:`FileAction`,
:class:`ValueChange` and :class:`DirectoryPlan` say what a rescale of a directory does to each
file, and :class:`DirectoryRescaleReport` what it did. Frameworks plan (their folders), the
``rescale-step`` command writes (:mod:`ckpttool.commands.rescale.directory`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from ckpttool.errors import InexactRescaleError, LayoutError

COPY, REWRITE, DROP = "copy", "rewrite", "drop"


@dataclass(frozen=True)
class RescalePlan:
    """What a rescale does: old and new step and world size, and the cost of the floor."""

    step_key: str
    old_step: int
    new_step: int
    from_world_size: int  # the world size the old step was counted under
    file_world_size: Any  # what the file's world_size field holds (None when absent)
    world_size: int  # the new one
    history: tuple[dict[str, Any], ...]  # rescaled_from after the change
    # the LR scheduler saved under SCHEDULER_KEY: what moved, (key, old, new), or why it did not
    scheduler_changes: tuple[tuple[str, Any, Any], ...] = ()
    scheduler_note: str = ""

    @property
    def global_batches(self) -> int:
        """Batches the saved run had consumed over all its ranks."""
        return self.old_step * self.from_world_size

    @property
    def repeated_batches(self) -> int:
        """Global batches the resumed run trains again because of the floor (< world_size)."""
        return self.global_batches - self.new_step * self.world_size

    @property
    def exact(self) -> bool:
        return self.repeated_batches == 0

    @property
    def repeated_per_rank(self) -> Fraction:
        """Repeated batches per rank on average: always below one."""
        return Fraction(self.repeated_batches, self.world_size)

    def repeated_samples(self, batch_size: int) -> int:
        """Samples trained twice over all ranks, with ``batch_size`` samples per rank-batch."""
        return self.repeated_batches * batch_size

    def max_repeated_samples_per_rank(self, batch_size: int) -> int:
        return math.ceil(self.repeated_samples(batch_size) / self.world_size)

    @property
    def world_size_from_option(self) -> bool:
        return self.file_world_size != self.from_world_size

    @property
    def changed(self) -> bool:
        return self.new_step != self.old_step or self.file_world_size != self.world_size


def describe_repeats(plan: RescalePlan, batch_size: int | None = None) -> str:
    text = (
        f"{plan.repeated_batches} global batch{'es' if plan.repeated_batches != 1 else ''} "
        f"({plan.repeated_per_rank} of a batch per rank) will be trained twice"
    )
    if batch_size:
        samples = plan.repeated_samples(batch_size)
        text += (
            f": {samples} sample{'s' * (samples != 1)} at batch size {batch_size}, at most "
            f"{plan.max_repeated_samples_per_rank(batch_size)} on any rank"
        )
    return text


@dataclass(frozen=True)
class ValueChange:
    """One value the rescale changes: ``file`` (its name in the output), ``key``, old, new."""

    file: str
    key: str
    old: Any
    new: Any


@dataclass(frozen=True)
class FileAction:
    """What happens to one file: ``name`` in the output (the source name for ``drop``)."""

    name: str
    source: str  # the file of the original directory it comes from
    action: str  # copy | rewrite | drop
    changes: dict[str, Any] = field(default_factory=dict)  # rewrite: top-level key -> new value
    why: str = ""


@dataclass(frozen=True)
class DirectoryRescaleReport:
    path: Path
    output: Path
    layout: str
    plan: RescalePlan  # the main counter (global_step, or accelerate's step)
    changes: tuple[ValueChange, ...]
    files: tuple[FileAction, ...]
    notes: tuple[str, ...]
    batch_size: int | None
    dry_run: bool
    written: bool
    in_place: bool
    resume_from_checkpoint: str | None = None  # Trainer: the path to pass to trainer.train


def counter_plan(key: str, old: int, saved: int, new_world: int, strict: bool) -> RescalePlan:
    if isinstance(old, bool) or not isinstance(old, int) or old < 0:
        raise LayoutError(f"{key!r} holds {old!r}, not a count of steps; nothing was changed")
    plan = RescalePlan(key, old, old * saved // new_world, saved, None, new_world, ())
    if strict and not plan.exact:
        raise InexactRescaleError(
            f"{old} x {saved} = {plan.global_batches} is not a multiple of {new_world}: "
            f"{describe_repeats(plan)}; refused (--strict)"
        )
    return plan


@dataclass(frozen=True)
class RescaleTarget:
    """What ``rescale-step`` rescales for: the new number of ranks and how the step counts.

    Built once, by the command line from its flags or by :func:`~ckpttool.commands.rescale.run.rescale_step` (and
    :func:`~ckpttool.commands.rescale.directory.rescale_directory`) from a library call's
    keywords, and handed down whole to a file's and a directory's rescale.
    """

    world_size: int  # the number of ranks the run resumes on
    from_world_size: int | None = None  # the saved one, for files without (or with a wrong) one
    batch_size: int | None = None  # per-rank batch size: repeated samples reported in samples
    strict: bool = False  # refuse when the new step cannot be exact
    step_key: str | None = None  # the top-level field rescaled instead of "step" (one file)
    keep_global_batch: bool = False  # DeepSpeed: keep the global batch and its counters


@dataclass(frozen=True)
class RescaleRequest:
    """What the user asked of ``rescale-step`` on a directory."""

    world_size: int
    from_world_size: int | None = None
    strict: bool = False
    output: Any = None  # str | os.PathLike | None
    in_place: bool = False
    overwrite: bool = False
    dry_run: bool = False
    batch_size: int | None = None
    keep_global_batch: bool = False
    step_key: str | None = None  # --step-key: a counter the framework rescales only when named


@dataclass
class DirectoryPlan:
    """What a framework's rescale does to each file of a directory (nothing written yet)."""

    layout: str
    plan: RescalePlan
    actions: list[FileAction]
    changes: list[ValueChange]
    notes: list[str]
    default_output: Path | None = None  # where the output goes without -o (None: PATH.ws<N>)
    check_output: Callable[[Path], None] | None = None  # refuses a new output the framework
    # would not resume from (raises), before anything is written
    resume_note: Callable[[Path], str] | None = None  # the output is what to resume from: the
    # report names it (resume_from_checkpoint) with this note
