"""The pipeline ``average`` and ``merge`` share: open N checkpoints through the one door, plan
each one's weights as ``convert`` plans them (``--filter``, ``--map``), match them tensor by
tensor, then produce every output tensor from one tensor of each input at a time and write it
by ``convert``'s writer (atomic, read back), or in one input's own layout
(``--like-input``: :mod:`ckpttool.commands.combine_like`).

``--jobs N`` (N > 1): the next N - 1 output tensors are computed on N - 1 threads while this one
is written; each input is read by one thread at a time (a lock per input, unless its format
reads concurrently). The bytes written are the same for every N: each tensor's arithmetic is
the same, only when it runs changes. Memory grows N-fold.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.convert.output import PTH_SUFFIXES, OutFile, check_targets, plan_outputs
from ckpttool.commands.convert.plan import Plan, Planned, build_plan
from ckpttool.commands.convert.run import tensor_bytes, write_outputs
from ckpttool.commands.diff.run import open_side
from ckpttool.commands.mapped import DerivedCheckpoint, with_derived
from ckpttool.commands.selection import Selection, refuse_incomplete
from ckpttool.errors import InputError, OverflowRefusedError
from ckpttool.io.parallel import AheadMap
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.values import dense_record, read_array
from ckpttool.model.cast import CASTABLE, cast_array, widen
from ckpttool.model.records import TensorRecord

#: Dtypes taken as they are, never averaged: equal in every input, or the last one's.
EXACT_PREFIXES = ("int", "uint", "bool")
Data = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Source:
    """One input of a combination."""

    path: str
    name: str  # as reported in errors: the run directory's entry, or the path given
    mapped: bool = True  # --map applies to it (merge: the MODELs, whose names become BASE's)


class Inputs:
    """The opened inputs and the reading of one tensor of one of them: by one thread at a time
    per input (a lock), unless its format reads concurrently (a DCP directory)."""

    def __init__(self, opened: list[Checkpoint]) -> None:
        self.opened = opened
        # a map's computed tensors are made through one cache per checkpoint: one thread
        self._locks = [
            nullcontext()
            if c.concurrent_reads and not isinstance(c, DerivedCheckpoint)
            else threading.Lock()
            for c in opened
        ]

    def raw(self, index: int, record: TensorRecord) -> Data:
        """The tensor's bytes as stored (an integer tensor is taken as it is)."""
        with self._locks[index]:
            return tensor_bytes(self.opened[index], Planned(record.key, record, record.dtype))[0]

    def values(self, index: int, record: TensorRecord) -> np.ndarray:
        """One input's tensor as a flat array numpy widens to float64 exactly (float16, float32,
        float64; bfloat16 widened to float32 here): no float64 copy is made."""
        with self._locks[index]:
            ckpt = self.opened[index]
            values = np.ascontiguousarray(read_array(ckpt, dense_record(ckpt, record)))
            values = values.reshape(-1)
            if values.dtype.byteorder == ">":
                values = values.astype(values.dtype.newbyteorder("<"))
        return widen(values, "bfloat16") if record.dtype == "bfloat16" else values


#: Makes one output tensor's producer from the inputs, each input's record of it, and the
#: output tensor planned.
Computer = Callable[[Inputs, list[TensorRecord], Planned], Callable[[], Data]]


@dataclass
class Written:
    """What :func:`write_combined` wrote."""

    plan: Plan  # the first input's weights: the output's tensors
    format: str  # "safetensors" or "pth"; --like-input: also "directory" (a model directory)
    ints: list[str]  # integer and bool tensors (taken as they are, not combined)
    notes: list[str]
    output: Path


def output_path(output: str | os.PathLike[str], inputs: Sequence[str]) -> Path:
    """``output`` as a weights file that is none of ``inputs`` (else :class:`InputError`)."""
    target = Path(output)
    if target.is_dir() or target.suffix.lower() not in (".safetensors", *PTH_SUFFIXES):
        raise InputError(f"{target}: name OUT .safetensors or .pth (.pt, .bin)")
    _not_an_input(target, inputs)
    return target


def _not_an_input(target: Path, inputs: Sequence[str]) -> None:
    for path in inputs:
        if Path(path).resolve() == target.resolve():
            raise InputError(f"{target}: the output would overwrite an input; name another OUT")


def write_combined(
    inputs: Sequence[Source],
    output: str | os.PathLike[str],
    *,
    choice: Selection,
    dtype: str,
    ints: str,
    computer: Computer,
    provenance: tuple[str, dict[str, object]],
    rounded_to: str,
    force: bool,
    verify: bool,
    like_input: bool,
    jobs: int,
    progress: ProgressCallback | None,
    on_total: ProgressCallback | None,
    layout: int = 0,
) -> Written:
    """Write ``output`` from ``inputs``, tensor by tensor: each input opened through the door,
    its weights planned as ``convert`` plans them with ``choice`` (``--filter``, and ``--map``
    for the inputs it applies to), matched with the first's (:func:`sources`), integer tensors
    checked (:func:`check_ints`) before anything is written; then every
    tensor produced by ``computer`` (``jobs`` > 1: ahead, on ``jobs`` - 1 threads) and written
    by ``convert``'s writer (atomic, read back), or in one input's layout
    (``like_input``: input number ``layout``'s, its other entries kept), with ``provenance``
    (metadata key, facts) in a safetensors output's metadata. ``rounded_to``: whose dtype a float tensor of mixed dtypes takes ("the base's")."""
    paths = [item.path for item in inputs]
    if like_input and (choice.pattern is not None or choice.map is not None):
        raise InputError(
            "--like-input writes the first input with all its weights combined, under their own "
            "names: not with --filter or --map"
        )
    target = Path(output) if like_input else output_path(output, paths)
    _not_an_input(target, paths)
    notes: list[str] = []
    with ExitStack() as stack:
        opened = [stack.enter_context(open_side(item.path)) for item in inputs]
        for ckpt in opened:  # a lost shard's tensors would be combined from the others alone
            refuse_incomplete(ckpt)
        plans, opened = _plans(inputs, opened, choice, ConversionOptions(dtype=dtype), notes)
        plan = plans[0]
        found, mixed = sources(inputs, plans, extra_ok=choice.pattern is not None)
        if mixed:
            notes.append(
                f"{len(mixed)} tensor(s) have other float dtypes in other inputs, rounded to "
                f"{rounded_to} (or --dtype): {_some(mixed)}"
            )
        reading = Inputs(opened)
        int_names = [p.name for p in plan.stored if p.dtype not in CASTABLE]
        check_ints(reading, found, int_names, inputs, ints)

        def producers(
            stored: list[Planned], renamed: dict[str, str]
        ) -> dict[str, Callable[[], Data]]:
            """Each tensor's producer, run ahead on ``jobs - 1`` threads with ``jobs`` > 1."""
            made = {
                p.name: computer(reading, found[renamed.get(p.name, p.name)], p) for p in stored
            }
            if jobs < 2 or len(stored) < 2:
                return made
            ahead = AheadMap(lambda p: made[p.name](), stored, jobs - 1, jobs)
            stack.callback(ahead.close)
            return {p.name: (lambda p=p: ahead.take(p)) for p in stored}  # type: ignore[misc]

        if like_input:
            from ckpttool.commands import combine_like

            plan = plans[layout]  # the same names as the first's (no --map, no --filter)
            kind = combine_like.write_like(
                opened[layout], Path(paths[layout]), plan, target, producers,
                provenance=provenance, force=force, verify=verify, progress=progress,
                on_total=on_total, notes=notes,
            )  # fmt: skip
            return Written(plan, kind, int_names, [*plan.notes, *notes], target)
        plan.fields, plan.carried, plan.left_out = {}, {}, []  # the first input's, not the output's
        files = plan_outputs(Path(paths[0]), target, None, None, plan)
        check_targets(Path(paths[0]), files, force)
        if files[0].kind == "safetensors":
            key, facts = provenance
            files[0].metadata[key] = json.dumps(facts, sort_keys=True)
        else:
            notes.append("a .pth state dict holds tensors only: the provenance is not written")
        if on_total is not None:
            on_total(plan.tensor_bytes * (2 if verify else 1))
        replaced = producers(_write_order(files), {})
        write_outputs(opened[0], plan, files, allow_overflow=False, verify=verify,
                      progress=progress or (lambda n: None), replaced=replaced)  # fmt: skip
    return Written(plan, files[0].kind, int_names, [*plan.notes, *notes], target)


def _write_order(files: list[OutFile]) -> list[Planned]:
    """The planned tensors in the order the writer asks for them."""
    return [p for f in files if f.kind != "index" for p in f.tensors if not p.kept]


def _plans(
    inputs: Sequence[Source],
    opened: list[Checkpoint],
    choice: Selection,
    options: ConversionOptions,
    notes: list[str],
) -> tuple[list[Plan], list[Checkpoint]]:
    """Each input's weights as ``convert`` plans them, ``--filter`` included. An input ``--map``
    applies to is mapped (read through a :class:`~ckpttool.commands.mapped.DerivedCheckpoint`),
    unless it is not the first and already holds the first's names, which are the output's
    (merge: a MODEL already named as BASE is taken as it is); a mapped input is not filtered
    (its names before the map are not the output's): what it holds beyond the first's
    tensors is then ignored (:func:`sources`)."""
    plans: list[Plan] = []
    out: list[Checkpoint] = []
    unmapped = replace(choice, map=None)
    for index, (item, ckpt) in enumerate(zip(inputs, opened)):
        mapping = choice.map is not None and item.mapped
        if mapping and index > 0:
            names = build_plan(ckpt, replace(unmapped, pattern=None), options).names
            if set(plans[0].names) <= set(names):
                notes.append(f"{item.name} holds {inputs[0].name}'s names: --map not applied")
                mapping = False
        if mapping:
            ckpt = with_derived(ckpt)
            own = choice if index == 0 else replace(choice, pattern=None)
        else:
            own = unmapped
        plans.append(build_plan(ckpt, own, options))
        out.append(ckpt)
    return plans, out


def rounded(values: np.ndarray, planned: Planned, what: str) -> Data:
    """Float64 ``values`` as ``planned``'s dtype, rounded once; a value past its range is
    refused (nothing written), naming the tensor. ``what``: "average", "merge"."""
    if planned.dtype == "float64":
        return values.view(np.uint8).data
    narrow, counts = cast_array(values, "float64", planned.dtype)
    if counts.overflow:
        raise OverflowRefusedError(
            f"{planned.name}: the {what} overflows {planned.dtype} in {counts.overflow:,} "
            "value(s); nothing was written. Choose --dtype fp32 (or bf16)"
        )
    return narrow.view(np.uint8).data


def sources(
    inputs: Sequence[Source], plans: list[Plan], *, extra_ok: bool = False
) -> tuple[dict[str, list[TensorRecord]], list[str]]:
    """Each stored tensor of the first input, with its record in every input, and the float
    tensors whose dtype differs between inputs; a tensor an input lacks (or, unless
    ``extra_ok``: ``--filter`` chose the first's, holds beyond the first's) or holds in another
    shape or kind, or of a dtype that cannot be combined exactly (float8, complex), is refused."""
    first = plans[0]
    wanted = set(first.names)
    problems = [
        f"{p.name} is {p.record.dtype}, which is not averaged (float16, bfloat16, float32 and "
        "float64 are; integer and bool tensors are taken as they are)"
        for p in first.stored
        if p.record.dtype not in CASTABLE and not p.record.dtype.startswith(EXACT_PREFIXES)
    ]
    mixed: set[str] = set()
    found: dict[str, list[TensorRecord]] = {p.name: [] for p in first.stored}
    for item, plan in zip(inputs, plans):
        records = {p.name: p.record for p in plan.stored}
        records.update({a: records[s] for a, s in plan.aliases.items() if s in records})
        missing = sorted(wanted - set(records))
        extra = [] if extra_ok else sorted(set(records) - wanted)
        if missing:
            problems.append(f"{item.name} lacks {_some(missing)}")
        if extra:
            problems.append(f"{item.name} holds {_some(extra)} that {inputs[0].name} does not")
        for planned in first.stored:
            record = records.get(planned.name)
            if record is None:
                continue
            if record.shape != planned.record.shape:
                problems.append(
                    f"{planned.name} is {list(record.shape)} in {item.name}, "
                    f"{list(planned.record.shape)} in {inputs[0].name}"
                )
            elif (record.dtype in CASTABLE) != (planned.record.dtype in CASTABLE) or (
                planned.record.dtype not in CASTABLE and record.dtype != planned.record.dtype
            ):
                problems.append(
                    f"{planned.name} is {record.dtype} in {item.name}, "
                    f"{planned.record.dtype} in {inputs[0].name}"
                )
            elif record.dtype != planned.record.dtype:
                mixed.add(planned.name)
            found[planned.name].append(record)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InputError(
            f"the checkpoints do not hold the same tensors: {'; '.join(problems[:3])}{more}"
        )
    return found, sorted(mixed)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def check_ints(
    reading: Inputs,
    found: dict[str, list[TensorRecord]],
    names: list[str],
    inputs: Sequence[Source],
    ints: str,
) -> None:
    """Integer and bool tensors are not averaged: refused unless equal everywhere (read before
    anything is written; they are small) or ``ints="last"``."""
    if ints == "last":
        return
    unequal = []
    for name in names:
        records = found[name]
        first = bytes(reading.raw(0, records[0]))
        if any(bytes(reading.raw(i, r)) != first for i, r in enumerate(records) if i):
            unequal.append(name)
    if unequal:
        raise InputError(
            f"integer/bool tensors differ between the checkpoints, so they cannot be averaged: "
            f"{_some(unequal)}; pass --ints last to take {inputs[-1].name}'s"
        )


def jobs_for(jobs: int | None) -> int:
    """The threads computing tensors ahead: ``jobs``, else what ``--jobs`` set
    (:func:`ckpttool.io.parallel.using`), else 1: each thread holds a tensor's arithmetic
    (several float64 copies of it), so more are used only when asked for."""
    from ckpttool.io import parallel

    if jobs is None:
        jobs = parallel.chosen() or 1
    if jobs < 1:
        raise InputError(f"--jobs must be at least 1; got {jobs}")
    return jobs
