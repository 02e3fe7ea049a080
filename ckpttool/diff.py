"""``diff``: compare two checkpoints' structure, training-state fields and tensor values.

Both files are opened through :func:`ckpttool.reader.open_checkpoint` and compared tensor by
tensor; values are streamed (:mod:`ckpttool.diff_values`), so memory does not grow with the file.
The work is split in two so that a caller can size a progress bar before any byte is read:
:func:`plan_diff` matches tensors and compares fields from metadata alone, :func:`run_diff`
compares values. :func:`diff` does both for library users.

Which part of each file is compared: ``section`` if given, on both sides. Otherwise two files
of the same kind are compared whole; when the kinds differ (a resume file against a plain state
dict, a Lightning checkpoint against a resume file) each side's weights (``model``,
``state_dict``) are compared, and a note says so. How keys are matched (prefixes, aliases, tied
tensors) is :mod:`ckpttool.diff_match`'s job.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from ckpttool.diff_match import (
    ALIASES_KEY,
    Alias,
    FieldDiff,
    TensorPair,
    alias_note,
    compare_fields,
    described_metadata,
    match_tensors,
    metadata_aliases,
)
from ckpttool.diff_values import ValueDiff, compare_dtype, compare_values
from ckpttool.errors import CkptError
from ckpttool.keys import WRAPPER_PREFIXES, Selection, select
from ckpttool.layout import LAYOUT_TITLES, detect_layout, model_section
from ckpttool.reader import Checkpoint, open_checkpoint
from ckpttool.records import TensorRecord

IDENTICAL = "identical"
WITHIN_TOLERANCE = "within_tolerance"
DIFFER = "differ"
ONLY_A = "only_a"
ONLY_B = "only_b"
STATUSES = (IDENTICAL, WITHIN_TOLERANCE, DIFFER, ONLY_A, ONLY_B)

DEFAULT_RTOL = 1e-5  # torch.allclose's defaults
DEFAULT_ATOL = 1e-8


@dataclass(frozen=True)
class Side:
    """One input file and the part of it that was compared."""

    path: str
    format: str
    layout: str
    section: str | None  # subtree compared (None: the whole file)
    auto_section: bool  # chosen because the two files are of different kinds
    num_tensors: int  # tensors compared on this side


@dataclass(frozen=True)
class TensorDiff:
    """The verdict on one key."""

    key: str  # normalised key (relative to the section, prefixes removed)
    status: str  # one of STATUSES
    a: TensorRecord | None  # record.key is the key in file A
    b: TensorRecord | None
    alias: Alias | None = None
    changes: tuple[str, ...] = ()  # "dtype float16 -> float32", "shape [2] -> [3]", ...
    values: ValueDiff | None = None  # None: not compared (--quick, shape change, only one side)


@dataclass
class DiffPlan:
    """What :func:`run_diff` will compare: matched tensors and field differences."""

    a: Side
    b: Side
    pairs: list[TensorPair]
    fields: list[FieldDiff]
    notes: list[str]

    @property
    def value_bytes(self) -> int:
        """Bytes read from both files when values are compared (for a progress bar)."""
        return sum(
            p.a.nbytes + p.b.nbytes
            for p in self.pairs
            if p.a is not None and p.b is not None and p.a.shape == p.b.shape
        )


@dataclass
class DiffReport:
    a: Side
    b: Side
    rtol: float
    atol: float
    quick: bool  # values were not read: "identical" means same dtype and shape
    notes: list[str]
    fields: list[FieldDiff]
    tensors: list[TensorDiff]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for entry in self.tensors:
            out[entry.status] += 1
        return out

    @property
    def equal(self) -> bool:
        """True when nothing differs beyond tolerance (diff's exit status 0)."""
        counts = self.counts()
        return not self.fields and counts[DIFFER] + counts[ONLY_A] + counts[ONLY_B] == 0

    def summary(self) -> str:
        c = self.counts()
        return (
            f"{c[IDENTICAL]} identical, {c[WITHIN_TOLERANCE]} differ within tolerance, "
            f"{c[DIFFER]} differ, {c[ONLY_A]} only in A, {c[ONLY_B]} only in B"
        )


def open_side(path: str | os.PathLike[str]) -> Checkpoint:
    """Open one input; errors name the file, since a diff has two."""
    try:
        return open_checkpoint(path)
    except CkptError as error:
        if str(path) in str(error):
            raise
        raise type(error)(f"{path}: {error}") from None


def diff(
    a: str | os.PathLike[str] | Checkpoint,
    b: str | os.PathLike[str] | Checkpoint,
    *,
    section: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
) -> DiffReport:
    """Compare checkpoint ``a`` with ``b`` (paths or open checkpoints). Never prints.

    ``progress`` is called with the number of bytes read after each chunk of values.
    """
    with ExitStack() as stack:
        ckpts = []
        for item in (a, b):
            if isinstance(item, Checkpoint):
                ckpts.append(item)
            else:
                ckpts.append(stack.enter_context(open_side(item)))
        ckpt_a, ckpt_b = ckpts
        plan = plan_diff(
            ckpt_a, ckpt_b, section=section, strip=strip, ignore_wrappers=ignore_wrappers
        )
        return run_diff(ckpt_a, ckpt_b, plan, rtol=rtol, atol=atol, quick=quick, progress=progress)


def plan_diff(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    *,
    section: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
) -> DiffPlan:
    """Match tensors and compare fields, from metadata alone (no tensor bytes are read)."""
    layout_a = detect_layout(ckpt_a.root, ckpt_a.format)
    layout_b = detect_layout(ckpt_b.root, ckpt_b.format)
    notes: list[str] = []
    auto = False
    section_a: str | None
    section_b: str | None
    if section is not None:
        section_a = section_b = section
    else:
        section_a, section_b = model_section(layout_a), model_section(layout_b)
        if section_a == section_b:
            section_a = section_b = None  # same kind of file: compare all of it
        else:
            auto = True
            notes.append(
                f"A ({LAYOUT_TITLES.get(layout_a, layout_a)}) and B "
                f"({LAYOUT_TITLES.get(layout_b, layout_b)}) are different kinds: comparing "
                f"{_part('A', section_a)} with {_part('B', section_b)} "
                "(use --section to choose)"
            )
    options: dict[str, Any] = {"strip": strip, "ignore_wrappers": ignore_wrappers}
    sel_a = select(ckpt_a, section=section_a, auto_section=False, **options)
    sel_b = select(ckpt_b, section=section_b, auto_section=False, **options)
    prefixes = [*strip, *(WRAPPER_PREFIXES if ignore_wrappers else ())]
    aliases_a = metadata_aliases(ckpt_a, sel_a, prefixes, "A", notes)
    aliases_b = metadata_aliases(ckpt_b, sel_b, prefixes, "B", notes)
    pairs = match_tensors(sel_a.tensors, sel_b.tensors, aliases_a, aliases_b)
    for pair in pairs:
        if pair.alias is not None:
            notes.append(alias_note(pair))
    fields = compare_fields(
        ckpt_a.section(section_a) if section_a else ckpt_a.root,
        ckpt_b.section(section_b) if section_b else ckpt_b.root,
    )
    if ckpt_a.format == ckpt_b.format == "safetensors":
        fields += compare_fields(described_metadata(ckpt_a), described_metadata(ckpt_b))
    return DiffPlan(
        a=_side(ckpt_a, layout_a, section_a, auto, sel_a),
        b=_side(ckpt_b, layout_b, section_b, auto, sel_b),
        pairs=pairs,
        fields=fields,
        notes=notes,
    )


def run_diff(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    plan: DiffPlan,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
) -> DiffReport:
    """Compare the planned pairs' values, one pair at a time (``quick``: structure only)."""
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ValueError("rtol and atol must be non-negative numbers")
    tensors: list[TensorDiff] = []
    for pair in plan.pairs:
        if pair.a is None or pair.b is None:
            status = ONLY_A if pair.b is None else ONLY_B
            tensors.append(TensorDiff(pair.key, status, pair.a, pair.b, pair.alias))
            continue
        tensors.append(
            _compare_pair(ckpt_a, ckpt_b, pair, rtol, atol, quick=quick, progress=progress)
        )
    notes = list(plan.notes)
    if quick:
        notes.append("--quick: values not read; 'identical' means the same dtype and shape")
    return DiffReport(plan.a, plan.b, rtol, atol, quick, notes, list(plan.fields), tensors)


def _compare_pair(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    pair: TensorPair,
    rtol: float,
    atol: float,
    *,
    quick: bool,
    progress: Callable[[int], None] | None,
) -> TensorDiff:
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    changes: list[str] = []
    if a.shape != b.shape:
        changes.append(f"shape {list(a.shape)} -> {list(b.shape)}")
    if a.dtype != b.dtype:
        compared = not quick and a.shape == b.shape  # (compare_dtype imports NumPy)
        common = compare_dtype(a.dtype, b.dtype) if compared else None
        cast = f", compared as {common}" if common else ""
        changes.append(f"dtype {a.dtype} -> {b.dtype}{cast}")
    if quick or a.shape != b.shape:
        status = IDENTICAL if not changes else DIFFER
        return TensorDiff(pair.key, status, a, b, pair.alias, tuple(changes))
    values = compare_values(ckpt_a, a, ckpt_b, b, rtol=rtol, atol=atol, progress=progress)
    if values is None:
        changes.append(f"values not compared: {a.dtype} and {b.dtype} have no common dtype")
        return TensorDiff(pair.key, DIFFER, a, b, pair.alias, tuple(changes))
    if values.bitwise_equal:
        status = IDENTICAL
    else:
        status = WITHIN_TOLERANCE if values.within_tolerance else DIFFER
    if values.nan_positions_differ:
        changes.append("NaN positions differ")
    if values.inf_positions_differ:
        changes.append("Inf positions differ")
    return TensorDiff(pair.key, status, a, b, pair.alias, tuple(changes), values)


def _part(label: str, section: str | None) -> str:
    return f"{label}'s {section!r} section" if section else f"all of {label}"


def _side(
    ckpt: Checkpoint, layout: str, section: str | None, auto: bool, selection: Selection
) -> Side:
    return Side(
        ckpt.name, ckpt.format, layout, section, auto and section is not None,
        len(selection.tensors),
    )  # fmt: skip


__all__ = [
    "ALIASES_KEY",
    "Alias",
    "DiffPlan",
    "DiffReport",
    "FieldDiff",
    "Side",
    "TensorDiff",
    "ValueDiff",
    "diff",
    "plan_diff",
    "run_diff",
]
