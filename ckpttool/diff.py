"""``diff``: compare two checkpoints' structure, training-state fields and tensor values.

Both files are opened through :func:`ckpttool.reader.open_checkpoint` and compared tensor by
tensor; values are streamed (:mod:`ckpttool.diff_values`), so memory does not grow with the file.
The work is split in two so that a caller can size a progress bar before any byte is read:
:func:`plan_diff` matches tensors and compares fields from metadata alone, :func:`run_diff`
compares values. :func:`diff` does both for library users.

Which part of each file is compared: ``section_a``/``section_b`` for one side, ``section`` for
both (a side named by neither is compared whole). With no section named, two files of the same
kind are compared whole; when the kinds differ (a resume file against a plain state dict, a
Lightning checkpoint against a resume file) each side's weights (``model``, ``state_dict``) are
compared, and a note says so. Then, if the two sides share no tensor key but one side's keys
under one extra prefix are exactly the other's (``{"model": ...}`` against the bare state dict,
``module.`` keys against plain ones), they are aligned there, with a note: by taking that
subtree as the side's section when it is one, else by removing the prefix. How keys are matched
(prefixes, aliases, tied tensors) is :mod:`ckpttool.diff_match`'s job.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from ckpttool.diff_match import (
    ALIASES_KEY,
    TYPE_CHANGED,
    Alias,
    FieldDiff,
    TensorPair,
    alias_note,
    compare_fields,
    described_metadata,
    extra_prefixes,
    match_tensors,
    merge_type_changes,
    metadata_aliases,
)
from ckpttool.diff_values import (
    ValueDiff,
    compare_dtype,
    compare_values,
    narrower_dtype,
    scalar_value,
)
from ckpttool.errors import CkptError, InputError
from ckpttool.keys import WRAPPER_PREFIXES, Selection, select
from ckpttool.layout import LAYOUT_TITLES, detect_layout, model_section
from ckpttool.reader import Checkpoint, open_checkpoint
from ckpttool.records import TensorRecord, tensors

IDENTICAL = "identical"
WITHIN_TOLERANCE = "within_tolerance"
DIFFER = "differ"
ONLY_A = "only_a"
ONLY_B = "only_b"
EQUAL_AFTER_ROUNDING = "equal_after_rounding"  # rounded: the narrower side is the wider rounded
STATUSES = (IDENTICAL, WITHIN_TOLERANCE, DIFFER, ONLY_A, ONLY_B, EQUAL_AFTER_ROUNDING)

DEFAULT_RTOL = 1e-5  # torch.allclose's defaults
DEFAULT_ATOL = 1e-8


@dataclass(frozen=True)
class Side:
    """One input file and the part of it that was compared."""

    path: str
    format: str
    layout: str
    section: str | None  # subtree compared (None: the whole file)
    auto_section: bool  # chosen, not named: the files are of different kinds, or keys aligned
    num_tensors: int  # tensors compared on this side
    prefix: str | None = None  # removed from this side's keys to align them with the other's


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
    rounded: bool = False  # floats of different precision compared in the narrower dtype

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
        rounded = f"{c[EQUAL_AFTER_ROUNDING]} equal after rounding, " if self.rounded else ""
        return (
            f"{c[IDENTICAL]} identical, {rounded}{c[WITHIN_TOLERANCE]} differ within tolerance, "
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
    section_a: str | None = None,
    section_b: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    quick: bool = False,
    rounded: bool = False,
    progress: Callable[[int], None] | None = None,
) -> DiffReport:
    """Compare checkpoint ``a`` with ``b`` (paths or open checkpoints). Never prints.

    ``section`` names the subtree compared in both, ``section_a``/``section_b`` in one side.
    ``rounded``: compare floats of different precision after rounding the wider to the
    narrower dtype (is one exactly the other saved in its dtype?). ``progress`` is called with
    the number of bytes read after each chunk of values.
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
            ckpt_a, ckpt_b, section=section, section_a=section_a, section_b=section_b,
            strip=strip, ignore_wrappers=ignore_wrappers,
        )  # fmt: skip
        return run_diff(
            ckpt_a, ckpt_b, plan, rtol=rtol, atol=atol, quick=quick, rounded=rounded,
            progress=progress,
        )  # fmt: skip


def plan_diff(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    *,
    section: str | None = None,
    section_a: str | None = None,
    section_b: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
) -> DiffPlan:
    """Match tensors and compare fields, from metadata alone (no tensor bytes are read)."""
    layout_a = detect_layout(ckpt_a.root, ckpt_a.format)
    layout_b = detect_layout(ckpt_b.root, ckpt_b.format)
    notes: list[str] = []
    auto = False
    named_a = section_a if section_a is not None else section
    named_b = section_b if section_b is not None else section
    if named_a is not None or named_b is not None:
        _check_sections(ckpt_a, named_a, ckpt_b, named_b, shared=section)
        section_a, section_b = named_a or None, named_b or None
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
                "(use --section-a/--section-b to choose)"
            )
    options: dict[str, Any] = {"strip": strip, "ignore_wrappers": ignore_wrappers}
    sel_a = select(ckpt_a, section=section_a, auto_section=False, **options)
    sel_b = select(ckpt_b, section=section_b, auto_section=False, **options)
    prefixes = [*strip, *(WRAPPER_PREFIXES if ignore_wrappers else ())]
    aliases_a = metadata_aliases(ckpt_a, sel_a, prefixes, "A", [])
    aliases_b = metadata_aliases(ckpt_b, sel_b, prefixes, "B", [])
    aligned = _align(ckpt_a, sel_a, aliases_a, ckpt_b, sel_b, aliases_b, options, notes)
    sel_a, sel_b, prefix_a, prefix_b = aligned
    aliases_a = metadata_aliases(ckpt_a, sel_a, [*prefixes, *prefix_a], "A", notes)
    aliases_b = metadata_aliases(ckpt_b, sel_b, [*prefixes, *prefix_b], "B", notes)
    pairs = match_tensors(sel_a.tensors, sel_b.tensors, aliases_a, aliases_b)
    for pair in pairs:
        if pair.alias is not None:
            notes.append(alias_note(pair))
    fields = compare_fields(
        ckpt_a.section(sel_a.section) if sel_a.section else ckpt_a.root,
        ckpt_b.section(sel_b.section) if sel_b.section else ckpt_b.root,
    )
    fields, pairs = merge_type_changes(
        fields, pairs, [*prefixes, *prefix_a], [*prefixes, *prefix_b]
    )
    if ckpt_a.format == ckpt_b.format == "safetensors":
        fields += compare_fields(described_metadata(ckpt_a), described_metadata(ckpt_b))
    return DiffPlan(
        a=_side(ckpt_a, layout_a, auto or sel_a.auto, sel_a, prefix_a),
        b=_side(ckpt_b, layout_b, auto or sel_b.auto, sel_b, prefix_b),
        pairs=pairs,
        fields=fields,
        notes=notes,
    )


def _check_sections(
    ckpt_a: Checkpoint,
    section_a: str | None,
    ckpt_b: Checkpoint,
    section_b: str | None,
    *,
    shared: str | None,
) -> None:
    """Each named section exists; when ``--section`` named one only the other side has, say how
    to name one side's."""
    for ckpt, name, label in ((ckpt_a, section_a, "a"), (ckpt_b, section_b, "b")):
        if not name:
            continue
        try:
            ckpt.section(name)
        except InputError as error:
            other = ckpt_b if label == "a" else ckpt_a
            if name != shared or not _has_section(other, name):
                raise
            having = "B" if label == "a" else "A"
            hint = (
                f" (--section applies to both files; to compare {having}'s {name!r} with all of "
                f"{label.upper()}, use --section-{having.lower()} {name})"
            )
            raise InputError(f"{error}{hint}") from None


def _has_section(ckpt: Checkpoint, name: str) -> bool:
    try:
        ckpt.section(name)
    except InputError:
        return False
    return True


def _align(
    ckpt_a: Checkpoint,
    sel_a: Selection,
    aliases_a: dict[str, str],
    ckpt_b: Checkpoint,
    sel_b: Selection,
    aliases_b: dict[str, str],
    options: dict[str, Any],
    notes: list[str],
) -> tuple[Selection, Selection, list[str], list[str]]:
    """Align two selections that share no key when one side's keys are the other's under one
    extra prefix (see the module docstring). Returns both selections and each side's removed
    prefix (an empty list, or the prefix)."""
    found_a = extra_prefixes(sel_a.tensors, sel_b.tensors, aliases_a, aliases_b)
    found_b = extra_prefixes(sel_b.tensors, sel_a.tensors, aliases_b, aliases_a)
    found = [("A", prefix) for prefix in found_a] + [("B", prefix) for prefix in found_b]
    if not found:
        return sel_a, sel_b, [], []
    if len(found) > 1:
        where = ", ".join(f"{label}'s {prefix!r}" for label, prefix in found)
        notes.append(
            f"the keys of one side are the other's under more than one prefix ({where}): "
            "not aligned (use --section-a/--section-b to choose)"
        )
        return sel_a, sel_b, [], []
    label, prefix = found[0]
    ckpt, own = (ckpt_a, sel_a) if label == "A" else (ckpt_b, sel_b)
    other_label = "B" if label == "A" else "A"
    subtree = _subtree(ckpt, own, prefix)
    if subtree is not None:
        chosen = select(ckpt, section=subtree, auto_section=False, **options)
        chosen = Selection(chosen.layout, chosen.section, True, chosen.tensors)
        sections = {"A": sel_a.section, "B": sel_b.section, label: subtree}
        notes.append(
            f"{other_label}'s tensor keys are {label}'s under {prefix!r}: comparing "
            f"{_part('A', sections['A'])} with {_part('B', sections['B'])} "
            "(use --section-a/--section-b to choose)"
        )
        removed: list[str] = []
    elif all(key.startswith(prefix) for key in own.tensors):
        rekeyed = {key[len(prefix) :]: record for key, record in own.tensors.items()}
        chosen = Selection(own.layout, own.section, own.auto, rekeyed)
        notes.append(
            f"{label}'s tensor keys are {other_label}'s with the prefix {prefix!r}: "
            "compared without it"
        )
        removed = [prefix]
    else:  # the other's keys are a part of this side that is not one subtree: not aligned
        return sel_a, sel_b, [], []
    if label == "A":
        return chosen, sel_b, removed, []
    return sel_a, chosen, [], removed


def _subtree(ckpt: Checkpoint, selection: Selection, prefix: str) -> str | None:
    """The section path of the subtree that holds exactly ``selection``'s keys under ``prefix``
    (None: they are not one subtree, e.g. flat keys that merely share ``module.``)."""
    path = (f"{selection.section}." if selection.section else "") + prefix[:-1]
    try:
        node = ckpt.section(path)
    except InputError:
        return None
    below = {record.key for record in tensors(node, path)}
    under = {r.key for key, r in selection.tensors.items() if key.startswith(prefix)}
    return path if below and below == under else None


def run_diff(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    plan: DiffPlan,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    quick: bool = False,
    rounded: bool = False,
    progress: Callable[[int], None] | None = None,
) -> DiffReport:
    """Compare the planned pairs' values, one pair at a time (``quick``: structure only;
    ``rounded``: floats of different precision in the narrower dtype)."""
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ValueError("rtol and atol must be non-negative numbers")
    tensors: list[TensorDiff] = []
    for pair in plan.pairs:
        if pair.a is None or pair.b is None:
            status = ONLY_A if pair.b is None else ONLY_B
            tensors.append(TensorDiff(pair.key, status, pair.a, pair.b, pair.alias))
            continue
        tensors.append(
            _compare_pair(
                ckpt_a, ckpt_b, pair, rtol, atol, quick=quick, rounded=rounded, progress=progress
            )
        )
    notes = list(plan.notes)
    if quick:
        notes.append("--quick: values not read; 'identical' means the same dtype and shape")
    elif not rounded:
        notes.extend(_dtype_note(tensors))
    fields = list(plan.fields)
    if not quick:
        fields = [_read_tensor_field(ckpt_a, ckpt_b, entry) for entry in fields]
    return DiffReport(plan.a, plan.b, rtol, atol, quick, notes, fields, tensors, rounded=rounded)


def _dtype_note(tensors: list[TensorDiff]) -> list[str]:
    """Say when floats of different precision were compared by widening, and how to ask
    whether one side is exactly the other rounded to its dtype."""
    casts: dict[tuple[str, str], int] = {}
    for entry in tensors:
        a, b = entry.a, entry.b
        if a is None or b is None or a.shape != b.shape:
            continue  # values not compared: rounding would not change the verdict
        if narrower_dtype(a.dtype, b.dtype) is not None:
            casts[(a.dtype, b.dtype)] = casts.get((a.dtype, b.dtype), 0) + 1
    if not casts:
        return []
    which = "; ".join(
        f"{n} {'tensor is' if n == 1 else 'tensors are'} {a} in A and {b} in B"
        for (a, b), n in casts.items()
    )
    return [
        f"the dtypes differ: {which}, compared in the wider dtype. To check whether one side "
        "is exactly the other rounded to its dtype, use --rounded"
    ]


def _read_tensor_field(ckpt_a: Checkpoint, ckpt_b: Checkpoint, entry: FieldDiff) -> FieldDiff:
    """A type-changed field with its tensor side's value (when that tensor has one element)."""
    if entry.status != TYPE_CHANGED:
        return entry
    if entry.a_tensor is not None:
        return replace(entry, a=scalar_value(ckpt_a, entry.a_tensor))
    if entry.b_tensor is not None:
        return replace(entry, b=scalar_value(ckpt_b, entry.b_tensor))
    return entry


def _compare_pair(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    pair: TensorPair,
    rtol: float,
    atol: float,
    *,
    quick: bool,
    rounded: bool,
    progress: Callable[[int], None] | None,
) -> TensorDiff:
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    changes: list[str] = []
    if a.shape != b.shape:
        changes.append(f"shape {list(a.shape)} -> {list(b.shape)}")
    if a.dtype != b.dtype:
        changes.append(f"dtype {a.dtype} -> {b.dtype}" + _how(a, b, quick=quick, rounded=rounded))
    if quick or a.shape != b.shape:
        status = IDENTICAL if not changes else DIFFER
        return TensorDiff(pair.key, status, a, b, pair.alias, tuple(changes))
    values = compare_values(
        ckpt_a, a, ckpt_b, b, rtol=rtol, atol=atol, rounded=rounded, progress=progress
    )
    if values is None:
        changes.append(f"values not compared: {a.dtype} and {b.dtype} have no common dtype")
        return TensorDiff(pair.key, DIFFER, a, b, pair.alias, tuple(changes))
    if values.equal_after_rounding:
        status = EQUAL_AFTER_ROUNDING
    elif values.bitwise_equal:
        status = IDENTICAL
    else:
        status = WITHIN_TOLERANCE if values.within_tolerance else DIFFER
    if values.nan_positions_differ:
        changes.append("NaN positions differ")
    if values.inf_positions_differ:
        changes.append("Inf positions differ")
    return TensorDiff(pair.key, status, a, b, pair.alias, tuple(changes), values)


def _how(a: TensorRecord, b: TensorRecord, *, quick: bool, rounded: bool) -> str:
    """How a pair of different dtypes is compared, for its row's notes."""
    if quick or a.shape != b.shape:
        return ""  # values are not compared (and compare_dtype would import NumPy)
    narrow = narrower_dtype(a.dtype, b.dtype) if rounded else None
    if narrow is not None:
        return f", compared after rounding to {narrow}"
    common = compare_dtype(a.dtype, b.dtype)
    if common is None:
        return ""
    if rounded and common not in (a.dtype, b.dtype):
        return f", compared as {common} (neither rounds to the other)"
    return f", compared as {common}"


def _part(label: str, section: str | None) -> str:
    return f"{label}'s {section!r} section" if section else f"all of {label}"


def _side(
    ckpt: Checkpoint, layout: str, auto: bool, selection: Selection, prefix: list[str]
) -> Side:
    section = selection.section
    return Side(
        ckpt.name, ckpt.format, layout, section, auto and section is not None,
        len(selection.tensors), prefix[0] if prefix else None,
    )  # fmt: skip


__all__ = [
    "ALIASES_KEY",
    "EQUAL_AFTER_ROUNDING",
    "TYPE_CHANGED",
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
