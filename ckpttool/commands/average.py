"""``average``: the element-wise mean of the weights of N checkpoints, one tensor at a time.

Each input is opened through the one door (:func:`ckpttool.checkpoint.open_checkpoint`, its
default view) and its weights chosen as ``convert`` chooses them
(:func:`ckpttool.commands.convert.plan.build_plan`). For each floating tensor,
``avg = (x_1 + ... + x_n) / n`` (``--weights``: ``w_1 x_1 + ... + w_n x_n`` with the weights
normalised to sum to 1; ``--ema d``: the weights ``d^(n-1)`` for the oldest and
``(1 - d) d^(n-k)`` for the k-th, in step order) is accumulated in float64, one input's tensor
at a time, and rounded once to the tensor's dtype (or ``dtype``). Integer and bool tensors
must be equal in every input (else refused, naming them, or ``ints="last"``: the newest's).
A tensor some inputs lack, or whose shape or dtype kind differs, is refused by name.

The output is written by ``convert``'s writer (:func:`ckpttool.commands.convert.run.write_outputs`):
every tensor is a computed one, written atomically and read back against the CRC-32 of the
bytes computed. Its ``__metadata__`` (safetensors) says what it was averaged from
(:data:`PROVENANCE_KEY`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.convert.output import PTH_SUFFIXES, check_targets, plan_outputs
from ckpttool.commands.convert.plan import Plan, Planned, build_plan
from ckpttool.commands.convert.run import tensor_bytes, write_outputs
from ckpttool.commands.diff.run import open_side
from ckpttool.commands.selection import Selection
from ckpttool.commands.trend import list_run, ordered_points
from ckpttool.commands.verify import verify_file
from ckpttool.errors import CkptError, InputError, OverflowRefusedError
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.values import dense_record, read_array
from ckpttool.model.cast import CASTABLE, cast_array, widen
from ckpttool.model.records import TensorRecord

#: ``__metadata__`` key of the output holding its provenance as a JSON object.
PROVENANCE_KEY = "ckpttool.average"
INTS = ("equal", "last")
#: Dtypes taken as they are, never averaged: equal in every input, or the last one's.
EXACT_PREFIXES = ("int", "uint", "bool")


@dataclass(frozen=True)
class AverageInput:
    """One checkpoint averaged."""

    path: str
    name: str  # as listed: the run directory's entry, or the path given
    step: int | None  # from its own counters (None: none found)
    weight: float  # normalised: the weights sum to 1


@dataclass
class AverageReport:
    """What ``average`` wrote."""

    inputs: list[AverageInput]  # in the order accumulated (step order with ema)
    method: str  # "mean", "weighted" or "ema"
    decay: float | None
    output: Path
    format: str  # "safetensors" or "pth"
    tensors: int  # tensors written (aliases not counted)
    averaged: int  # floating tensors averaged
    ints: list[str]  # integer and bool tensors, taken as they are (equal, or the newest's)
    dtype: str  # "keep", "fp16", "bf16", "fp32"
    skipped: list[str] = field(default_factory=list)  # --last: "NAME: problem", newest first
    verified: bool = True
    notes: list[str] = field(default_factory=list)


def average(
    checkpoints: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    weights: Sequence[float] | None = None,
    last: int | None = None,
    ema: float | None = None,
    dtype: str = "keep",
    ints: str = "equal",
    force: bool = False,
    verify: bool = True,
    progress: ProgressCallback | None = None,
    on_total: ProgressCallback | None = None,
) -> AverageReport:
    """Average the weights of ``checkpoints`` (see the module doc) into ``output`` (.safetensors,
    or .pth/.pt/.bin). ``last``: ``checkpoints`` is one run directory, and its ``last`` newest
    complete checkpoints are averaged (broken ones skipped and named). Raises
    :class:`InputError` (exit 2, nothing written) for inputs that do not match."""
    if ints not in INTS:
        raise InputError(f"--ints must be one of {', '.join(INTS)}; got {ints!r}")
    if weights is not None and ema is not None:
        raise InputError("--weights and --ema are two ways to weigh the inputs: give one")
    if ema is not None and not 0.0 < ema < 1.0:
        raise InputError(f"--ema is a decay between 0 and 1 (0.999 for instance); got {ema}")
    paths, names, skipped = _inputs(checkpoints, last)
    points, order = ordered_points(paths, names)
    notes: list[str] = []
    if ema is None:  # the order given (the run's with --last): --weights follow it
        by_path = {p.path: p for p in points}
        points = [by_path[path] for path in paths]
    elif order == "given" and len(points) > 1:
        notes.append(
            "the checkpoints have no step counters and no distinct numbers in their names: "
            "the EMA follows the order given"
        )
    normalised = _weights(len(points), weights, ema)
    method = "ema" if ema is not None else "mean" if weights is None else "weighted"
    inputs = [AverageInput(p.path, p.name, p.step, w) for p, w in zip(points, normalised)]
    target = output_path(output, [item.path for item in inputs])
    written = write_combined(
        inputs, target, dtype=dtype, ints=ints, force=force, verify=verify, progress=progress,
        on_total=on_total, rounded_to=f"{inputs[0].name}'s",
        computer=lambda opened, records, planned: _computer(
            opened, records, planned, normalised, method == "mean", ints
        ),
        provenance=(PROVENANCE_KEY, {"method": method, "decay": ema, "inputs": [
            {"path": i.path, "step": i.step, "weight": i.weight} for i in inputs
        ]}),
    )  # fmt: skip
    plan, int_names = written.plan, written.ints
    return AverageReport(
        inputs=inputs,
        method=method,
        decay=ema,
        output=target,
        format=written.format,
        tensors=len(plan.stored),
        averaged=len(plan.stored) - len(int_names),
        ints=int_names,
        dtype=dtype,
        skipped=skipped,
        verified=verify,
        notes=[*notes, *written.notes],
    )


def output_path(output: str | os.PathLike[str], inputs: Sequence[str]) -> Path:
    """``output`` as a weights file that is none of ``inputs`` (else :class:`InputError`)."""
    target = Path(output)
    if target.is_dir() or target.suffix.lower() not in (".safetensors", *PTH_SUFFIXES):
        raise InputError(f"{target}: name OUT .safetensors or .pth (.pt, .bin)")
    for path in inputs:
        if Path(path).resolve() == target.resolve():
            raise InputError(f"{target}: the output would overwrite an input; name another OUT")
    return target


#: Makes one output tensor's producer from every input's checkpoint and record of it.
Computer = Callable[
    [list[Checkpoint], list[TensorRecord], Planned], Callable[[], bytes | bytearray | memoryview]
]


@dataclass
class Written:
    """What :func:`write_combined` wrote."""

    plan: Plan  # the first input's weights: the output's tensors
    format: str  # "safetensors" or "pth"
    ints: list[str]  # integer and bool tensors (taken as they are, not combined)
    notes: list[str]


def write_combined(
    inputs: list[AverageInput],
    target: Path,
    *,
    dtype: str,
    ints: str,
    computer: Computer,
    provenance: tuple[str, dict[str, object]],
    rounded_to: str,
    force: bool,
    verify: bool,
    progress: ProgressCallback | None,
    on_total: ProgressCallback | None,
    check: Callable[[list[Planned], list[str]], None] | None = None,
) -> Written:
    """Write ``target`` from ``inputs``, tensor by tensor: each input opened through the door,
    its weights planned as ``convert`` plans them, matched with the first's (:func:`sources`),
    integer tensors checked (:func:`check_ints`) and ``check`` run before anything is written;
    then every tensor produced by ``computer`` and written by ``convert``'s writer (atomic, read
    back), with ``provenance`` (metadata key, facts) in a safetensors output's metadata. ``rounded_to``: whose dtype
    a float tensor of mixed dtypes takes ("the base's")."""
    notes: list[str] = []
    with ExitStack() as stack:
        opened = [stack.enter_context(open_side(item.path)) for item in inputs]
        options = ConversionOptions(dtype=dtype)
        plans = [build_plan(ckpt, Selection(), options) for ckpt in opened]
        plan = plans[0]
        plan.fields, plan.carried, plan.left_out = {}, {}, []  # the first input's, not the output's
        found, mixed = sources(inputs, plans)
        if mixed:
            notes.append(
                f"{len(mixed)} tensor(s) have other float dtypes in other inputs, rounded to "
                f"{rounded_to} (or --dtype): {_some(mixed)}"
            )
        int_names = [p.name for p in plan.stored if p.dtype not in CASTABLE]
        check_ints(opened, found, int_names, inputs, ints)
        if check is not None:
            check(plan.stored, int_names)
        replaced = {p.name: computer(opened, found[p.name], p) for p in plan.stored}
        files = plan_outputs(Path(inputs[0].path), target, None, None, plan)
        check_targets(Path(inputs[0].path), files, force)
        if files[0].kind == "safetensors":
            key, facts = provenance
            files[0].metadata[key] = json.dumps(facts, sort_keys=True)
        else:
            notes.append("a .pth state dict holds tensors only: the provenance is not written")
        if on_total is not None:
            on_total(plan.tensor_bytes * (2 if verify else 1))
        write_outputs(opened[0], plan, files, allow_overflow=False, verify=verify,
                      progress=progress or (lambda n: None), replaced=replaced)  # fmt: skip
    return Written(plan, files[0].kind, int_names, [*plan.notes, *notes])


def rounded(values: np.ndarray, planned: Planned, what: str) -> bytes | bytearray | memoryview:
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


def _inputs(
    checkpoints: Sequence[str | os.PathLike[str]], last: int | None
) -> tuple[list[str], list[str], list[str]]:
    """The paths to average and their names; with ``last``, the run directory's newest
    complete checkpoints (oldest first) and the broken ones skipped on the way."""
    if not checkpoints:
        raise InputError("average: no checkpoint given")
    if last is None:
        paths, names = list_run(checkpoints)
        return paths, names, []
    if last < 1:
        raise InputError(f"--last takes a number of checkpoints, at least 1; got {last}")
    if len(checkpoints) != 1 or not os.path.isdir(checkpoints[0]):
        raise InputError("--last N takes one run directory: ckpttool average --last 5 RUN_DIR")
    paths, names = list_run(checkpoints)
    taken: list[int] = []
    skipped: list[str] = []
    for index in reversed(range(len(paths))):
        if len(taken) == last:
            break
        problems = _problems(paths[index])
        if problems:
            skipped.append(f"{names[index]}: {problems[0]}")
        else:
            taken.append(index)
    if len(taken) < last:
        raise InputError(
            f"{checkpoints[0]}: {len(taken)} complete checkpoint(s) of {len(paths)}, "
            f"--last {last} asked for {last}"
            + (f" (skipped {'; '.join(skipped)})" if skipped else "")
        )
    taken.reverse()
    return [paths[i] for i in taken], [names[i] for i in taken], skipped


def _problems(path: str) -> list[str]:
    """``verify``'s problems with one checkpoint (none: complete)."""
    try:
        return list(verify_file(path).problems)
    except CkptError as error:
        return [str(error).removeprefix(f"{path}: ")]


def _weights(count: int, weights: Sequence[float] | None, ema: float | None) -> list[float]:
    """Each input's weight, normalised to sum to 1."""
    if ema is not None:
        return [ema ** (count - 1)] + [(1 - ema) * ema ** (count - k) for k in range(2, count + 1)]
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count:
        raise InputError(f"--weights gives {len(weights)} weight(s) for {count} checkpoint(s)")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise InputError("--weights must be finite, not negative, and not all 0")
    total = math.fsum(weights)
    return [w / total for w in weights]


def sources(
    inputs: list[AverageInput], plans: list[Plan]
) -> tuple[dict[str, list[TensorRecord]], list[str]]:
    """Each stored tensor of the first input, with its record in every input, and the float
    tensors whose dtype differs between inputs; a tensor an input lacks or holds in another
    shape or kind, or of a dtype that cannot be averaged exactly (float8, complex), is refused."""
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
        extra = sorted(set(records) - wanted)
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
    opened: list[Checkpoint],
    sources: dict[str, list[TensorRecord]],
    names: list[str],
    inputs: list[AverageInput],
    ints: str,
) -> None:
    """Integer and bool tensors are not averaged: refused unless equal everywhere (read before
    anything is written; they are small) or ``ints="last"``."""
    if ints == "last":
        return
    unequal = []
    for name in names:
        records = sources[name]
        first = bytes(raw(opened[0], records[0]))
        if any(bytes(raw(c, r)) != first for c, r in zip(opened[1:], records[1:])):
            unequal.append(name)
    if unequal:
        raise InputError(
            f"integer/bool tensors differ between the checkpoints, so they cannot be averaged: "
            f"{_some(unequal)}; pass --ints last to take {inputs[-1].name}'s"
        )


def raw(ckpt: Checkpoint, record: TensorRecord) -> bytes | bytearray | memoryview:
    return tensor_bytes(ckpt, Planned(record.key, record, record.dtype))[0]


def float64(ckpt: Checkpoint, record: TensorRecord) -> np.ndarray:
    """One input's tensor as flat float64 values (exact: every castable dtype widens exactly)."""
    values = np.ascontiguousarray(read_array(ckpt, dense_record(ckpt, record))).reshape(-1)
    if values.dtype.byteorder == ">":
        values = values.astype(values.dtype.newbyteorder("<"))
    return widen(values, record.dtype).astype(np.float64)  # a copy of its own, to add into


def _computer(
    opened: list[Checkpoint],
    records: list[TensorRecord],
    planned: Planned,
    weights: list[float],
    equal_mean: bool,
    ints: str,
) -> Callable[[], bytes | bytearray | memoryview]:
    """The bytes of ``planned`` in the output, computed when the writer asks for them."""

    def compute() -> bytes | bytearray | memoryview:
        if planned.dtype not in CASTABLE:  # equal everywhere (checked), or the newest's
            return raw(opened[-1], records[-1])
        total: np.ndarray | None = None
        for ckpt, record, weight in zip(opened, records, weights):
            values = float64(ckpt, record)  # one input's tensor at a time
            if not equal_mean:
                values *= weight
            if total is None:
                total = values
            else:
                total += values
        assert total is not None
        if equal_mean:  # summed in input order, divided once: torch's mean(0) in float64
            total /= len(records)
        return rounded(total, planned, "average")

    return compute
