"""``average``: the element-wise mean of the weights of N checkpoints, one tensor at a time.

Each input is opened through the one door (:func:`ckpttool.checkpoint.open_checkpoint`, its
default view) and its weights chosen as ``convert`` chooses them
(:func:`ckpttool.commands.convert.plan.build_plan`, with ``--filter`` and ``--map``). For each
floating tensor, ``avg = (x_1 + ... + x_n) / n`` (``--weights``: ``w_1 x_1 + ... + w_n x_n``
with the weights normalised to sum to 1; ``--ema d``: the weights ``d^(n-1)`` for the oldest
and ``(1 - d) d^(n-k)`` for the k-th, in step order) is accumulated in float64, one input's
tensor at a time, and rounded once to the tensor's dtype (or ``dtype``). Integer and bool
tensors must be equal in every input (else refused, naming them, or ``ints="last"``: the
newest's). A tensor some inputs lack, or whose shape or dtype kind differs, is refused by name.

The output is written by the pipeline ``merge`` shares (:mod:`ckpttool.commands.combine`):
by ``convert``'s writer, atomically, read back against the CRC-32 of the bytes computed, its
``__metadata__`` (safetensors) saying what it was averaged from (:data:`PROVENANCE_KEY`); or,
``like_input``, in the newest input's own layout (:mod:`ckpttool.commands.combine_like`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckpttool.commands.combine import Inputs, Source, jobs_for, rounded, write_combined
from ckpttool.commands.convert.plan import Planned
from ckpttool.commands.lora import combine as lora_combine
from ckpttool.commands.selection import Selection
from ckpttool.commands.trend import list_run, ordered_points
from ckpttool.commands.verify import verify_file
from ckpttool.errors import CkptError, InputError
from ckpttool.io.progress import ProgressCallback
from ckpttool.model.cast import CASTABLE
from ckpttool.model.merge_methods import add_scaled
from ckpttool.model.records import TensorRecord

#: ``__metadata__`` key of the output holding its provenance as a JSON object.
PROVENANCE_KEY = "ckpttool.average"
INTS = ("equal", "last")


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
    format: str  # "safetensors" or "pth"; --like-input: the first input's format
    tensors: int  # tensors written (aliases not counted)
    averaged: int  # floating tensors averaged
    ints: list[str]  # integer and bool tensors, taken as they are (equal, or the newest's)
    dtype: str  # "keep", "fp16", "bf16", "fp32"
    like_input: bool = False  # written in an input's layout: ``layout``'s
    layout: str | None = None  # --like-input: the newest input's name (the run goes on from it)
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
    pattern: str | None = None,
    map_name: str | None = None,
    map_params: Mapping[str, int] | None = None,
    like_input: bool = False,
    force: bool = False,
    verify: bool = True,
    jobs: int | None = None,
    progress: ProgressCallback | None = None,
    on_total: ProgressCallback | None = None,
) -> AverageReport:
    """Average the weights of ``checkpoints`` (see the module doc) into ``output`` (.safetensors,
    or .pth/.pt/.bin; ``like_input``: in the first checkpoint's own layout). ``pattern`` and
    ``map_name`` are ``convert``'s ``--filter`` and ``--map``, applied to every checkpoint;
    ``jobs``: tensors computed ahead on ``jobs - 1`` threads (default: ``--jobs``, else 1).
    ``last``: ``checkpoints`` is one run directory, and its ``last`` newest complete
    checkpoints are averaged (broken ones skipped and named; fewer than ``last``: those, with a
    note). ``like_input``: OUT is the newest input (by step, else by the numbers in the names,
    else the last given) written again in its own layout with the averaged weights. Raises
    :class:`InputError` (exit 2, nothing written) for inputs that do not match."""
    if ints not in INTS:
        raise InputError(f"--ints must be one of {', '.join(INTS)}; got {ints!r}")
    if weights is not None and ema is not None:
        raise InputError("--weights and --ema are two ways to weigh the inputs: give one")
    if ema is not None and not 0.0 < ema < 1.0:
        raise InputError(f"--ema is a decay between 0 and 1 (0.999 for instance); got {ema}")
    paths, names, skipped, notes = _inputs(checkpoints, last)
    points, order = ordered_points(paths, names)
    # the run goes on from its newest checkpoint: --like-input writes that one's layout
    newest = points[-1].path if order != "given" else paths[-1]
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
    layout = next(i for i, item in enumerate(inputs) if item.path == newest)
    choice = Selection(pattern=pattern, map=map_name,
                       map_params=tuple((map_params or {}).items()))  # fmt: skip
    provenance: tuple[str, dict[str, object]] = (PROVENANCE_KEY, {"method": method, "decay": ema, "inputs": [
        {"path": i.path, "step": i.step, "weight": i.weight} for i in inputs
    ]})  # fmt: skip
    if lora_combine.all_adapters([i.path for i in inputs]):  # one adapter of summed rank
        lora_combine.refuse_options(dtype=dtype, pattern=pattern, map_name=map_name,
                                    like_input=like_input)  # fmt: skip
        made = lora_combine.combine_adapters(
            [i.path for i in inputs], [i.name for i in inputs], normalised, output,
            provenance=provenance, force=force,
        )  # fmt: skip
        return AverageReport(inputs, method, ema, made.output, "adapter", made.tensors,
                             made.tensors, [], dtype, skipped=skipped,
                             notes=[*notes, *made.notes])  # fmt: skip
    written = write_combined(
        [Source(i.path, i.name) for i in inputs], output, choice=choice, dtype=dtype, ints=ints,
        force=force, verify=verify, like_input=like_input, jobs=jobs_for(jobs),
        progress=progress, on_total=on_total, layout=layout if like_input else 0,
        rounded_to=f"{inputs[layout if like_input else 0].name}'s",
        computer=lambda reading, records, planned: _computer(
            reading, records, planned, normalised, method == "mean"
        ),
        provenance=provenance,
    )  # fmt: skip
    plan, int_names = written.plan, written.ints
    return AverageReport(
        inputs=inputs,
        method=method,
        decay=ema,
        output=written.output,
        format=written.format,
        tensors=len(plan.stored),
        averaged=len(plan.stored) - len(int_names),
        ints=int_names,
        dtype=dtype,
        like_input=like_input,
        layout=inputs[layout].name if like_input else None,
        skipped=skipped,
        verified=verify,
        notes=[*notes, *written.notes],
    )


def _inputs(
    checkpoints: Sequence[str | os.PathLike[str]], last: int | None
) -> tuple[list[str], list[str], list[str], list[str]]:
    """The paths to average and their names; with ``last``, the run directory's newest
    complete checkpoints (oldest first), the broken ones skipped on the way, and a note when
    fewer than ``last`` are complete (those are averaged; none: :class:`InputError`)."""
    if not checkpoints:
        raise InputError("average: no checkpoint given")
    if last is None:
        paths, names = list_run(checkpoints)
        return paths, names, [], []
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
    broken = f" (skipped {'; '.join(skipped)})" if skipped else ""
    if not taken:
        raise InputError(
            f"{checkpoints[0]}: no complete checkpoint of {len(paths)} to average{broken}"
        )
    notes = []
    if len(taken) < last:
        notes.append(
            f"--last {last}: {checkpoints[0]} holds {len(taken)} complete checkpoint(s) of "
            f"{len(paths)}; averaged those {len(taken)}"
        )
    taken.reverse()
    return [paths[i] for i in taken], [names[i] for i in taken], skipped, notes


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


def _computer(
    reading: Inputs,
    records: list[TensorRecord],
    planned: Planned,
    weights: list[float],
    equal_mean: bool,
) -> Callable[[], bytes | bytearray | memoryview]:
    """The bytes of ``planned`` in the output, computed when the writer asks for them: the
    float64 sum (one copy of the tensor) and one input's tensor as read at a time."""

    def compute() -> bytes | bytearray | memoryview:
        if planned.dtype not in CASTABLE:  # equal everywhere (checked), or the newest's
            return reading.raw(len(records) - 1, records[-1])
        total: np.ndarray | None = None
        for index, (record, weight) in enumerate(zip(records, weights)):
            values = reading.values(index, record)  # one input's tensor at a time
            if total is None:
                total = values.astype(np.float64)  # the sum starts as the first input
                if not equal_mean:
                    total *= weight
            else:
                add_scaled(total, values, None if equal_mean else weight)
            del values
        assert total is not None
        if equal_mean:  # summed in input order, divided once: torch's mean(0) in float64
            total /= len(records)
        return rounded(total, planned, "average")

    return compute
