"""``diff``: compare two checkpoints' structure, training-state fields and tensor values.

Both files are opened through :func:`ckpttool.checkpoint.open_checkpoint` and compared tensor by
tensor; values are streamed (:mod:`ckpttool.commands.diff.values`), so memory does not grow with the file.
The work is split in two so that a caller can size a progress bar before any byte is read:
:func:`plan_diff` matches tensors and compares fields from metadata alone, :func:`run_diff`
compares values. :func:`diff` does both for library users.

Which part of each file is compared (named sections, the layout's weights, alignment under one
extra key prefix) is :mod:`ckpttool.commands.diff.sections`'s job; how keys are matched (prefixes,
aliases, tied tensors) is :mod:`ckpttool.commands.diff.match`'s.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace

from ckpttool.checkpoint import Checkpoint, open_checkpoint, open_files_of
from ckpttool.commands.diff import values as diff_values
from ckpttool.commands.diff.match import (
    ALIASES_KEY,
    TYPE_CHANGED,
    Alias,
    FieldDiff,
    TensorPair,
    alias_note,
    compare_fields,
    described_metadata,
    match_tensors,
    merge_type_changes,
    metadata_aliases,
    wrapper_note,
)
from ckpttool.commands.diff.sections import Part, choose_parts, compare_rest
from ckpttool.commands.diff.values import (
    SameMeasures,
    ValueDiff,
    bitwise_equal_values,
    compare_dtype,
    compare_values,
    equal_values_measured,
    measurable,
    narrower_dtype,
    scalar_value,
)
from ckpttool.commands.mapped import (
    DerivedCheckpoint,
    config_dirs,
    declared_facts,
    map_named,
    step_counts,
    with_derived,
)
from ckpttool.commands.selection import (
    COMPONENT_OR_SECTION,
    Selection,
    refuse_placeholders,
    side_section,
)
from ckpttool.errors import CkptError, InputError
from ckpttool.formats.registry import carries_metadata
from ckpttool.frameworks.base import DEFAULT_VIEW, reported_layout, view_facts
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.read_batch import BLOCK, read_many
from ckpttool.io.values import dense_record
from ckpttool.model.mapping import load_map
from ckpttool.model.records import ELEMENTS_PER_BYTE, ITEMSIZE, TensorRecord, with_key

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
    # a framework directory: the section its weights files fill, when the part compared holds
    # its tensors; their records' keys (and, compared whole, their keys) are as the files
    # store them, without the section's name
    weights_section: str | None = None
    map: str | None = None  # --map: the map (file or preset) this side's names went through


@dataclass(frozen=True, slots=True)  # one per tensor: 100,000 in a large diff
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
    # both sides are a framework's view assembled from some of their files (DeepSpeed ZeRO's
    # fp32 weights): their files as stored, compared too (:func:`plan_stored`)
    stored: StoredPlan | None = None

    @property
    def value_bytes(self) -> int:
        """Bytes read from both files when values are compared (for a progress bar)."""
        own = sum(_value_bytes(pair) for pair in self.pairs)
        return own + (self.stored.plan.value_bytes if self.stored is not None else 0)


@dataclass
class StoredPlan:
    """The files as stored of two sides opened as a view, and the plan that compares them
    whole: what the view does not cover (a ZeRO directory's 16-bit module weights, buffers,
    client state, counters) is compared there. :func:`run_diff` closes both."""

    a: Checkpoint
    b: Checkpoint
    plan: DiffPlan

    def close(self) -> None:
        self.a.close()
        self.b.close()


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


def _counters(ckpt: Checkpoint) -> dict[str, object] | None:
    """The training counters a view compares (None: the files as stored have none)."""
    facts = view_facts(ckpt)
    return facts.counters if facts is not None else None


def open_side(path: str | os.PathLike[str]) -> Checkpoint:
    """Open one input; errors name the file, since a diff has two."""
    try:
        # the view the layout declares for its tensors (DeepSpeed ZeRO: the fp32 weights)
        return open_checkpoint(path, view=DEFAULT_VIEW)
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
    component: str | None = None,
    component_a: str | None = None,
    component_b: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    quick: bool = False,
    rounded: bool = False,
    norms: bool = False,
    map_name: str | None = None,
    map_params: dict[str, int] | None = None,
    progress: ProgressCallback | None = None,
) -> DiffReport:
    """Compare checkpoint ``a`` with ``b`` (paths or open checkpoints). Never prints.

    ``section`` names the subtree compared in both, ``section_a``/``section_b`` in one side;
    ``component`` (``component_a``/``component_b``) a named part of a multi-component folder
    (a diffusers pipeline's ``unet``) instead.
    ``map_name``: a map file or preset (``edit --map``'s) A's tensors go through before they
    are matched with B's (``map_params``: the numbers it needs, else from a ``config.json``
    or ``params.json`` beside A or B).
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
        selection = Selection(
            section, tuple(strip), ignore_wrappers, map=map_name,
            map_params=tuple((map_params or {}).items()), component=component,
        )  # fmt: skip
        if map_name is not None:
            ckpt_a = with_derived(ckpt_a)
        plan = plan_diff(
            ckpt_a, ckpt_b, selection, section_a=section_a, section_b=section_b,
            component_a=component_a, component_b=component_b,
        )  # fmt: skip
        return run_diff(
            ckpt_a, ckpt_b, plan, rtol=rtol, atol=atol, quick=quick, rounded=rounded,
            norms=norms, progress=progress,
        )  # fmt: skip


def plan_diff(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    selection: Selection | None = None,
    *,
    section_a: str | None = None,
    section_b: str | None = None,
    component_a: str | None = None,
    component_b: str | None = None,
) -> DiffPlan:
    """Match tensors and compare fields, from metadata alone (no tensor bytes are read).
    ``section_a``/``section_b`` override ``selection.section`` for one side, as
    ``component_a``/``component_b`` override ``selection.component`` (a named part's section:
    :func:`~ckpttool.commands.selection.component_section`). With
    ``selection.map``, A's tensors are mapped first; ``ckpt_a`` must then be a
    :class:`~ckpttool.commands.mapped.DerivedCheckpoint` (:func:`with_derived`), which reads
    the tensors the map computes. Two sides opened as a framework's view (the default view of
    :func:`open_side`) are also compared as their files store them (:func:`plan_stored`)."""
    selection = selection or Selection()
    if selection.component is not None and selection.section is not None:
        raise InputError(COMPONENT_OR_SECTION)
    section_a = side_section(ckpt_a, section_a, component_a or selection.component)
    section_b = side_section(ckpt_b, section_b, component_b or selection.component)
    notes: list[str] = []
    part_a, part_b = choose_parts(
        ckpt_a, ckpt_b, selection, section_a=section_a, section_b=section_b, notes=notes
    )
    sel_a, sel_b = part_a.selection, part_b.selection
    aliases_a = metadata_aliases(ckpt_a, sel_a, part_a.prefixes, "A", notes)
    aliases_b = metadata_aliases(ckpt_b, sel_b, part_b.prefixes, "B", notes)
    tensors_a = sel_a.tensors
    if selection.map is not None:
        tensors_a = _mapped_side(ckpt_a, ckpt_b, tensors_a, selection, notes)
        aliases_a = {}  # declared under A's own names
    pairs = match_tensors(tensors_a, sel_b.tensors, aliases_a, aliases_b)
    # a ZeRO-3 rank file's 0-element stand-ins would compare "identical": never as weights
    refuse_placeholders(ckpt_a, [pair.a.key for pair in pairs if pair.a is not None])
    refuse_placeholders(ckpt_b, [pair.b.key for pair in pairs if pair.b is not None])
    for pair in pairs:
        if pair.alias is not None:
            notes.append(alias_note(pair))
    if not selection.ignore_wrappers:
        notes.extend(wrapper_note(pairs))
    fields = compare_fields(
        ckpt_a.section(sel_a.section) if sel_a.section else ckpt_a.root,
        ckpt_b.section(sel_b.section) if sel_b.section else ckpt_b.root,
    )
    fields, pairs = merge_type_changes(fields, pairs, part_a.prefixes, part_b.prefixes)
    if part_a.stored is not None or part_b.stored is not None:
        pairs, fields = _as_stored(pairs, fields, part_a.stored, part_b.stored)
    # the layouts differ and only their weights were taken: the rest is compared too
    rest_pairs, rest_fields = compare_rest(
        ckpt_a, part_a, ckpt_b, part_b, {pair.key for pair in pairs}, notes
    )
    pairs += rest_pairs
    fields += rest_fields
    if carries_metadata(ckpt_a.format) and carries_metadata(ckpt_b.format):
        fields += compare_fields(described_metadata(ckpt_a), described_metadata(ckpt_b))
    named = (
        section_a, section_b, component_a, component_b, selection.section,
        selection.component, selection.map,
    )  # fmt: skip
    stored = None if any(name is not None for name in named) else plan_stored(ckpt_a, ckpt_b, notes)
    counters_a, counters_b = _counters(ckpt_a), _counters(ckpt_b)
    if stored is None and counters_a is not None and counters_b is not None:  # two DeepSpeed tags
        fields += compare_fields(counters_a, counters_b)  # (else the files' own fields have them)
    side_a, side_b = _side(ckpt_a, part_a), _side(ckpt_b, part_b)
    if selection.map is not None:
        side_a = replace(side_a, num_tensors=len(tensors_a), map=selection.map)
    if rest_pairs:
        side_a = replace(
            side_a, num_tensors=side_a.num_tensors + sum(p.a is not None for p in rest_pairs)
        )
        side_b = replace(
            side_b, num_tensors=side_b.num_tensors + sum(p.b is not None for p in rest_pairs)
        )
    return DiffPlan(
        a=side_a,
        b=side_b,
        pairs=pairs,
        fields=fields,
        notes=notes,
        stored=stored,
    )


def plan_stored(ckpt_a: Checkpoint, ckpt_b: Checkpoint, notes: list[str]) -> StoredPlan | None:
    """The plan that compares two sides' files as stored when either was opened as a
    framework's view (its tensors assembled from some of its files: DeepSpeed ZeRO's fp32
    weights, from the optimizer states), so that what the view leaves out is compared too; None
    when neither is a view. When only one is, or they are views of different layouts, nothing
    of the other side is like those files: a note names what was not compared."""
    facts_a, facts_b = view_facts(ckpt_a), view_facts(ckpt_b)
    if facts_a is None and facts_b is None:
        return None
    if facts_a is None or facts_b is None or facts_a.layout != facts_b.layout:
        for label, facts in (("A", facts_a), ("B", facts_b)):
            if facts is not None:
                notes.append(
                    f"not compared: {label}'s files beyond its {facts.name} view (the "
                    f"{facts.layout} checkpoint's other tensors and fields): the other side is "
                    "not of its kind"
                )
        return None
    files_a = open_files_of(ckpt_a)
    try:
        files_b = open_files_of(ckpt_b)
    except BaseException:
        files_a.close()
        raise
    try:
        plan = plan_diff(files_a, files_b)
    except BaseException:
        files_a.close()
        files_b.close()
        raise
    notes.append(
        f"also compared: both {facts_a.layout} checkpoints' files as stored ({len(plan.pairs)} "
        f"tensors and their fields, keyed as show lists them), beyond the {facts_a.name} view"
    )
    notes.extend(plan.notes)
    return StoredPlan(files_a, files_b, plan)


def _mapped_side(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    tensors: dict[str, TensorRecord],
    selection: Selection,
    notes: list[str],
) -> dict[str, TensorRecord]:
    """A's tensors under the names ``selection.map`` gives them; those no rule maps keep
    their own (and are reported as only in A unless B has them too)."""
    assert selection.map is not None
    if not isinstance(ckpt_a, DerivedCheckpoint):
        raise TypeError("with --map, A is opened as a DerivedCheckpoint (with_derived)")
    spec = load_map(
        selection.map, dict(selection.map_params), config_dirs([ckpt_a.name, ckpt_b.name]),
        declared_facts(ckpt_a, ckpt_b),
    )  # fmt: skip
    # quantized tensors compare by their values: those a map computes from too
    mapped, steps, unmatched = map_named(tensors, spec, ckpt_a, keep_unmatched=True, decode=True)
    note = f"A's tensors mapped by {selection.map}: {step_counts(steps)}"
    if unmatched:
        shown = ", ".join(unmatched[:5]) + (" ..." if len(unmatched) > 5 else "")
        note += f"; {len(unmatched)} no rule maps, compared under their own names: {shown}"
    notes.append(note)
    return mapped


def run_diff(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    plan: DiffPlan,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    quick: bool = False,
    rounded: bool = False,
    norms: bool = False,
    progress: ProgressCallback | None = None,
) -> DiffReport:
    """Compare the planned pairs' values, one pair at a time (``quick``: structure only;
    ``rounded``: floats of different precision in the narrower dtype)."""
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ValueError("rtol and atol must be non-negative numbers")
    tensors = _compare_all(
        ckpt_a, ckpt_b, plan.pairs,
        rtol=rtol, atol=atol, quick=quick, rounded=rounded, norms=norms, progress=progress,
    )  # fmt: skip
    notes = list(plan.notes)
    if quick:
        notes.append("--quick: values not read; 'identical' means the same dtype and shape")
    elif not rounded:
        notes.extend(_dtype_note(tensors))
    meta = sum(1 for t in tensors if t.a is not None and t.b is not None and t.a.is_meta
               and t.b.is_meta and t.a.dtensor is None and t.b.dtensor is None)  # fmt: skip
    if meta and not quick:
        notes.append(
            f"values not compared for {meta} meta tensor{'s' * (meta != 1)} (saved without data"
            " on both sides): 'identical' means the same dtype and shape"
        )
    fields = list(plan.fields)
    if not quick:
        fields = [_read_tensor_field(ckpt_a, ckpt_b, entry) for entry in fields]
    if plan.stored is not None:
        stored = plan.stored
        try:
            files = run_diff(
                stored.a, stored.b, stored.plan, rtol=rtol, atol=atol, quick=quick,
                rounded=rounded, norms=norms, progress=progress,
            )  # fmt: skip
        finally:
            stored.close()
        tensors += _stored_keys(files.tensors, {entry.key for entry in tensors})
        fields += files.fields
        notes += [note for note in files.notes if note not in notes]
    return DiffReport(plan.a, plan.b, rtol, atol, quick, notes, fields, tensors, rounded=rounded)


#: What the files as stored's verdicts are keyed under when a key equals one of the view's.
STORED_PREFIX = "files:"


def _stored_keys(entries: list[TensorDiff], view_keys: set[str]) -> list[TensorDiff]:
    """The files as stored's verdicts, keyed as ``show`` lists them, or all under
    :data:`STORED_PREFIX` when one of those keys is also a key of the view's."""
    if not any(entry.key in view_keys for entry in entries):
        return entries
    return [replace(entry, key=STORED_PREFIX + entry.key) for entry in entries]


WINDOW = 256  # pairs whose small tensors are read together (ckpttool.io.read_batch)
RUNS_PER_JOB = 4  # runs of pairs per thread: a thread that drew light ones takes another
PAIR_COST = 1 << 15  # bytes a pair weighs beyond its values (its Python), in balancing runs


class Stopped(Exception):
    """A run of pairs left early: the comparison as a whole has failed or was interrupted."""


def _compare_all(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    pairs: list[TensorPair],
    *,
    rtol: float,
    atol: float,
    quick: bool,
    rounded: bool,
    norms: bool,
    progress: ProgressCallback | None,
) -> list[TensorDiff]:
    """Every pair's verdict, in plan order. With ``--jobs N`` > 1 (:func:`~ckpttool.io.parallel.jobs`)
    and two checkpoints that threads may read at once (:attr:`Checkpoint.parallel_reads`: a
    local file, a directory whose members allow it), the pairs are cut into runs of neighbours
    of about equal bytes, compared on N threads (``pread``, ``memcmp`` and NumPy's loops let go
    of the GIL: bench/README.md), and their verdicts put back in order. A verdict depends on
    its pair alone, so the report is the same with any N; the first error in plan order is the
    one raised; memory is N times one run's (its blocks of small tensors, a large one's
    buffers or chunks). After an error or Ctrl-C every thread stops at its next tensor or
    chunk."""
    from ckpttool.io.parallel import jobs, ordered_map, serialized

    count = jobs()
    if (
        quick  # nothing is read
        or count < 2
        or len(pairs) < 2
        or not (ckpt_a.parallel_reads and ckpt_b.parallel_reads)
    ):
        return _compare_run(
            ckpt_a, ckpt_b, pairs, rtol=rtol, atol=atol, quick=quick, rounded=rounded,
            norms=norms, progress=progress,
        )  # fmt: skip
    stop = threading.Event()
    shared = serialized(progress)

    def advance(done: int) -> None:  # a thread's progress, and where it hears of a stop
        if stop.is_set():
            raise Stopped
        if shared is not None:
            shared(done)

    def compare(run: list[TensorPair]) -> list[TensorDiff]:
        return _compare_run(
            ckpt_a, ckpt_b, run, rtol=rtol, atol=atol, quick=quick, rounded=rounded,
            norms=norms, progress=advance, stop=stop,
        )  # fmt: skip

    runs = _runs(pairs, count * RUNS_PER_JOB)
    return [entry for part in ordered_map(compare, runs, stop=stop) for entry in part]


def _runs(pairs: list[TensorPair], pieces: int) -> list[list[TensorPair]]:
    """``pairs`` cut into at most ``pieces`` runs of neighbours of about equal weight (the
    bytes read to compare them, :data:`PAIR_COST` more each): :func:`ckpttool.io.units.runs`."""
    from ckpttool.io.units import runs

    weights = [PAIR_COST + _value_bytes(pair) for pair in pairs]
    return [pairs[first:stop] for first, stop in runs(weights, pieces)]


def _value_bytes(pair: TensorPair) -> int:
    """The bytes read to compare a pair's values (none where they are not compared)."""
    a, b = pair.a, pair.b
    return a.nbytes + b.nbytes if a is not None and b is not None and a.shape == b.shape else 0


def _compare_run(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    pairs: list[TensorPair],
    *,
    rtol: float,
    atol: float,
    quick: bool,
    rounded: bool,
    norms: bool,
    progress: ProgressCallback | None,
    stop: threading.Event | None = None,
) -> list[TensorDiff]:
    """The verdicts of consecutive ``pairs``, one pair at a time (a window of small ones read
    in blocks first); ``stop`` set: raise :class:`Stopped` before the next pair."""
    tensors: list[TensorDiff] = []
    for start in range(0, len(pairs), WINDOW):
        window = pairs[start : start + WINDOW]
        # pairs whose equal bytes settle the verdict: read in blocks, compared as bytes
        settled = [not quick and _bytes_settle(pair) for pair in window]
        plain = [pair for pair, flag in zip(window, settled) if flag and _small(pair)]
        records_a = [pair.a for pair in plain if pair.a is not None]
        records_b = [pair.b for pair in plain if pair.b is not None]
        bytes_a = _ahead(ckpt_a, read_many(ckpt_a, records_a))  # (on threads: _ahead)
        bytes_b = _ahead(ckpt_b, read_many(ckpt_b, records_b))
        for pair, flag in zip(window, settled):
            if stop is not None and stop.is_set():
                raise Stopped
            if pair.a is None or pair.b is None:
                status = ONLY_A if pair.b is None else ONLY_B
                tensors.append(TensorDiff(pair.key, status, pair.a, pair.b, pair.alias))
                continue
            if flag and not _small(pair):
                # --by-module: an identical tensor's norm from A's blocks as they are compared
                same = SameMeasures(pair.a) if norms and measurable(pair.a.dtype) else None
                if _equal_in_file(ckpt_a, ckpt_b, pair, progress, same):
                    values = (
                        same.verdict()
                        if same is not None
                        else bitwise_equal_values(pair.a.dtype, pair.a.numel)
                    )
                    entry = TensorDiff(pair.key, IDENTICAL, pair.a, pair.b, pair.alias, (), values)
                    tensors.append(entry)
                    continue
            elif flag:
                (data_a, first_a), data_b = next(bytes_a), next(bytes_b)[0]
                if data_a == data_b:
                    if progress is not None:
                        progress(len(data_a) + len(data_b))
                    values = (
                        equal_values_measured(pair.a, data_a, first_a)
                        if norms
                        else bitwise_equal_values(pair.a.dtype, pair.a.numel)
                    )
                    entry = TensorDiff(pair.key, IDENTICAL, pair.a, pair.b, pair.alias, (), values)
                    tensors.append(entry)
                    continue
            entry = _compare_pair(
                ckpt_a,
                ckpt_b,
                pair,
                rtol,
                atol,
                quick=quick,
                rounded=rounded,
                norms=norms,
                progress=progress,
            )
            tensors.append(entry)
    return tensors


def _ahead(
    ckpt: Checkpoint, reads: Iterator[tuple[bytes | bytearray, int]]
) -> Iterator[tuple[bytes | bytearray, int]]:
    """--jobs N > 1 on a directory whose members may be read at once, compared on one thread
    (the other side must be read in order: a URL, an assembled view): its tensors read on a
    thread of their own, up to N ahead, while the pairs are compared. In a run of
    :func:`_compare_all`'s threads N is 1: read on that thread."""
    from ckpttool.io.parallel import jobs, read_ahead

    count = jobs() if ckpt.concurrent_reads else 1
    return read_ahead(reads, count if count > 1 else 0)


def _bytes_settle(pair: TensorPair) -> bool:
    """Whether equal bytes make this pair bitwise equal, so that reading both as bytes and
    comparing them is the whole comparison when they are equal (the usual case): one
    contiguous, plain strided tensor of the same dtype, shape and byte order on both sides.
    Small ones are read in blocks of many (:func:`_small`), large ones compared range against
    range (:func:`_equal_in_file`). Anything else, or bytes that differ, goes through
    :func:`_compare_pair`: so the verdicts are the ones it gives (equal bytes are bitwise equal,
    NaN payloads included; ``-0.0`` against ``0.0`` differs in bytes and is decided by it)."""
    a, b = pair.a, pair.b
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.storage is None or b.storage is None or a.storage.byteorder != b.storage.byteorder:
        return False
    return (
        a.inline_data is None
        and b.inline_data is None
        and a.layout == b.layout == "strided"
        and a.quant is None
        and b.quant is None
        and a.dtype in ITEMSIZE
        and a.dtype not in ELEMENTS_PER_BYTE
        and a.nbytes > 0
        and a.dtensor is None
        and b.dtensor is None
        and a.is_contiguous
        and b.is_contiguous
    )


def _small(pair: TensorPair) -> bool:
    """A settled pair small enough to be read with its neighbours in one block."""
    assert pair.a is not None
    return pair.a.nbytes <= BLOCK and pair.a.numel <= diff_values.CHUNK


def _equal_in_file(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    pair: TensorPair,
    progress: ProgressCallback | None,
    same: SameMeasures | None = None,
) -> bool:
    """Whether a large settled pair's bytes are equal, compared block by block where each lies
    in one range of its local file (:func:`ckpttool.io.blocks.equal_ranges`, both files read in
    turn). False when they differ or a side is not one range: :func:`_compare_pair` decides.
    ``same`` is given every block of A found equal (its norms)."""
    from ckpttool.io.blocks import equal_ranges
    from ckpttool.io.urls import is_url

    assert pair.a is not None and pair.b is not None
    if is_url(ckpt_a.name) or is_url(ckpt_b.name):
        return False  # a URL's values are fetched once, in large runs, by the value path
    span_a, span_b = ckpt_a.file_span(pair.a), ckpt_b.file_span(pair.b)
    if span_a is None or span_b is None or span_a[1] != span_b[1]:
        return False
    read_a, read_b = ckpt_a.read_file_into, ckpt_b.read_file_into
    seen = same.add if same is not None else None
    if not equal_ranges(read_a, span_a[0], read_b, span_b[0], span_a[1], seen):
        return False
    if progress is not None:
        progress(2 * span_a[1])
    return True


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
    norms: bool,
    progress: ProgressCallback | None,
) -> TensorDiff:
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    changes: list[str] = []
    if a.shape != b.shape:
        changes.append(f"shape {list(a.shape)} -> {list(b.shape)}")
    if a.dtype != b.dtype:
        changes.append(f"dtype {a.dtype} -> {b.dtype}" + _how(a, b, quick=quick, rounded=rounded))
    if a.layout != b.layout:
        changes.append(f"layout {a.layout} -> {b.layout} (values compared dense)")
    quant_a, quant_b = (r.quant.describe() if r.quant else "none" for r in (a, b))
    if quant_a != quant_b:
        changes.append(f"quantization {quant_a} -> {quant_b} (values compared dequantized)")
    if quick or a.shape != b.shape:
        status = IDENTICAL if not changes else DIFFER
        return TensorDiff(pair.key, status, a, b, pair.alias, tuple(changes))
    value_a, value_b = a, b
    moved = False  # DTensor pieces of different parts of the tensor
    if a.dtensor is not None and b.dtensor is not None:
        # two ranks' files (or one rank's twice): what each file holds is its piece; the pieces
        # compare when they are the same part of the tensor (one side alone raises on reading)
        moved = a.dtensor.placements != b.dtensor.placements
        if moved:
            changes.append(f"placements {a.dtensor.placements} -> {b.dtensor.placements}")
        value_a, value_b = a.dtensor.local, b.dtensor.local
        if value_a.shape != value_b.shape:
            changes.append(f"local piece {list(value_a.shape)} -> {list(value_b.shape)}")
            return TensorDiff(pair.key, DIFFER, a, b, pair.alias, tuple(changes))
    lacking = [side for side, r in (("A", value_a), ("B", value_b)) if r.is_meta]
    if lacking:  # a meta tensor holds no values: its dtype and shape are all there is to compare
        if len(lacking) == 1:
            changes.append(f"values only in {'B' if lacking == ['A'] else 'A'} ({lacking[0]} is "
                           "a meta tensor, saved without data)")  # fmt: skip
        return TensorDiff(pair.key, DIFFER if changes else IDENTICAL, a, b, pair.alias,
                          tuple(changes))  # fmt: skip
    # sparse and quantized tensors compare by their dense meaning, as torch.equal on to_dense()
    dense_a, dense_b = dense_record(ckpt_a, value_a), dense_record(ckpt_b, value_b)
    if dense_a.shape != dense_b.shape:  # nested tensors: buffers of different sizes
        changes.append(f"values {list(dense_a.shape)} -> {list(dense_b.shape)}")
        return TensorDiff(pair.key, DIFFER, a, b, pair.alias, tuple(changes))
    values = compare_values(
        ckpt_a, dense_a, ckpt_b, dense_b,
        rtol=rtol, atol=atol, rounded=rounded, norms=norms, progress=progress,
    )  # fmt: skip
    if values is None:
        changes.append(f"values not compared: {a.dtype} and {b.dtype} have no common dtype")
        return TensorDiff(pair.key, DIFFER, a, b, pair.alias, tuple(changes))
    if values.equal_after_rounding:
        status = EQUAL_AFTER_ROUNDING
    elif values.bitwise_equal:
        status = IDENTICAL
    else:
        status = WITHIN_TOLERANCE if values.within_tolerance else DIFFER
    if moved:
        status = DIFFER  # the same bytes hold different parts of the tensor
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


def _as_stored(
    pairs: list[TensorPair],
    fields: list[FieldDiff],
    weights_a: str | None,
    weights_b: str | None,
) -> tuple[list[TensorPair], list[FieldDiff]]:
    """Records under a directory's weights section re-keyed as its files store them (each
    side's ``weights_*``, None: unchanged), so that a record's key is the key in its file."""

    def stored(record: TensorRecord | None, weights: str | None) -> TensorRecord | None:
        if record is None or weights is None or not record.key.startswith(weights + "."):
            return record
        return with_key(record, record.key[len(weights) + 1 :])

    pairs = [
        TensorPair(pair.key, stored(pair.a, weights_a), stored(pair.b, weights_b), pair.alias)
        for pair in pairs
    ]
    fields = [
        replace(
            entry,
            a_tensor=stored(entry.a_tensor, weights_a),
            b_tensor=stored(entry.b_tensor, weights_b),
        )
        if entry.a_tensor is not None or entry.b_tensor is not None
        else entry
        for entry in fields
    ]
    return pairs, fields


def _side(ckpt: Checkpoint, part: Part) -> Side:
    section = part.selection.section
    return Side(
        ckpt.name, ckpt.format, reported_layout(ckpt, part.layout), section, part.auto and section is not None,
        len(part.selection.tensors), part.aligned_prefix, part.stored,
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
    "with_derived",
]
