"""``merge``: one model from a base and its fine-tunes (linear, task arithmetic, TIES, SLERP),
one tensor at a time, with mergekit's formulas (:mod:`ckpttool.model.merge_methods`).

Built on the pipeline ``average`` uses (:mod:`ckpttool.commands.combine`): the inputs are
opened and matched as ``average`` matches them (the same tensors, shapes and dtype kinds in
every input, else refused by name; integer and bool tensors equal everywhere, taken as they
are; ``--map`` maps each MODEL's names into BASE's), each floating tensor read from one input
at a time as the method asks for it, combined in float64, rounded once to the base's dtype (or
``dtype``), and written by ``convert``'s writer, atomically and read back. A safetensors OUT
records the method and its parameters in its ``__metadata__`` (:data:`PROVENANCE_KEY`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool.commands.combine import Inputs, Source, jobs_for, rounded, write_combined
from ckpttool.commands.convert.plan import Planned
from ckpttool.commands.lora import combine as lora_combine
from ckpttool.commands.selection import Selection
from ckpttool.errors import InputError
from ckpttool.io.progress import ProgressCallback
from ckpttool.model import merge_methods
from ckpttool.model.cast import CASTABLE
from ckpttool.model.records import TensorRecord

PROVENANCE_KEY = "ckpttool.merge"
METHODS = ("linear", "task-arithmetic", "ties", "slerp")


@dataclass(frozen=True)
class MergeInput:
    """One model merged: the base (``role`` "base") or a fine-tune ("model")."""

    path: str
    role: str
    weight: float | None  # as given (not normalised); None: slerp (t weighs them)


@dataclass
class MergeReport:
    """What ``merge`` wrote."""

    method: str
    inputs: list[MergeInput]
    output: Path
    format: str  # "safetensors" or "pth"; --like-input: also "directory" (a model directory)
    tensors: int
    merged: int  # floating tensors merged
    ints: list[str]  # integer and bool tensors, equal everywhere, taken as they are
    dtype: str
    lam: float | None  # task-arithmetic, ties
    density: float | None  # ties
    t: float | None  # slerp
    like_input: bool = False  # written in BASE's own layout
    verified: bool = True
    notes: list[str] = field(default_factory=list)


def merge(
    base: str | os.PathLike[str],
    models: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    method: str,
    weights: Sequence[float] | None = None,
    lam: float = 1.0,
    density: float = 1.0,
    t: float | None = None,
    dtype: str = "keep",
    pattern: str | None = None,
    map_name: str | None = None,
    map_params: Mapping[str, int] | None = None,
    like_input: bool = False,
    force: bool = False,
    verify: bool = True,
    jobs: int | None = None,
    progress: ProgressCallback | None = None,
    on_total: ProgressCallback | None = None,
) -> MergeReport:
    """Merge ``models`` with ``base`` by ``method`` into ``output`` (.safetensors or .pth);
    :class:`InputError` (exit 2, nothing written) for bad parameters or unmatched inputs.
    ``pattern`` (``--filter``) picks BASE's tensors, the output's; ``map_name`` (``--map``)
    maps each MODEL's names (and layout) into BASE's, unless the MODEL already holds BASE's
    names. ``like_input``: OUT in BASE's own layout (a resume file's other entries, a model
    directory; :mod:`ckpttool.commands.combine_like`). ``jobs``: tensors computed ahead on ``jobs - 1`` threads (default: ``--jobs``,
    else 1)."""
    if method not in METHODS:
        raise InputError(f"--method must be one of {', '.join(METHODS)}; got {method!r}")
    if not models:
        raise InputError("merge: give the BASE and at least one MODEL")
    paths = [str(base), *(str(m) for m in models)]
    roles = ["base"] + ["model"] * len(models)
    given = _weights(method, len(models), weights, lam, density, t)
    inputs = [MergeInput(p, r, w) for p, r, w in zip(paths, roles, given)]
    combine = _combiner(method, given, lam, density, t)
    choice = Selection(pattern=pattern, map=map_name,
                       map_params=tuple((map_params or {}).items()))  # fmt: skip
    provenance: tuple[str, dict[str, object]] = (PROVENANCE_KEY, {"method": method, "lambda": lam, "density": density, "t": t,
                                   "base": paths[0], "models": [
        {"path": i.path, "weight": i.weight} for i in inputs[1:]
    ]})  # fmt: skip
    if lora_combine.all_adapters(paths):  # one adapter of summed rank
        made = _merge_adapters(paths, method, given, lam, output, provenance, force,
                               dtype=dtype, pattern=pattern, map_name=map_name,
                               like_input=like_input)  # fmt: skip
        return MergeReport(method, inputs, made.output, "adapter", made.tensors, made.tensors,
                           [], dtype, lam if method == "task-arithmetic" else None, None, None,
                           notes=made.notes)  # fmt: skip
    written = write_combined(
        [Source(p, p, mapped=index > 0) for index, p in enumerate(paths)], output,
        choice=choice, dtype=dtype, ints="equal", force=force, verify=verify, like_input=like_input,
        jobs=jobs_for(jobs), progress=progress, on_total=on_total, rounded_to="the base's",
        computer=lambda reading, records, planned: _computer(reading, records, planned, combine),
        provenance=provenance,
    )  # fmt: skip
    plan, int_names = written.plan, written.ints
    return MergeReport(
        method=method,
        inputs=inputs,
        output=written.output,
        format=written.format,
        tensors=len(plan.stored),
        merged=len(plan.stored) - len(int_names),
        ints=int_names,
        dtype=dtype,
        lam=lam if method in ("task-arithmetic", "ties") else None,
        density=density if method == "ties" else None,
        t=t if method == "slerp" else None,
        like_input=like_input,
        verified=verify,
        notes=written.notes,
    )


def _merge_adapters(
    paths: list[str],
    method: str,
    given: list[float | None],
    lam: float,
    output: str | os.PathLike[str],
    provenance: tuple[str, dict[str, object]],
    force: bool,
    **options: Any,
) -> lora_combine.CombinedAdapter:
    """BASE and MODELS that are LoRA adapters: a linear or task-arithmetic merge of their
    deltas is one adapter (:mod:`ckpttool.commands.lora.combine`); TIES and SLERP are not."""
    if method not in ("linear", "task-arithmetic"):
        raise InputError(
            f"--method {method} of LoRA adapters would act on lora_A and lora_B, not on the "
            f"deltas they make, and no adapter holds the {method} of the deltas; "
            f"{lora_combine.MERGE_FIRST}, or use --method linear or task-arithmetic"
        )
    lora_combine.refuse_options(**options)
    numbers = [w for w in given if w is not None]
    if method == "linear":  # sum_i w_i x_i / sum_i w_i
        total = math.fsum(numbers)
        coefficients = [w / total for w in numbers]
    else:  # base + lambda * sum_i w_i (x_i - base)
        coefficients = [1.0 - lam * math.fsum(numbers), *(lam * w for w in numbers)]
    return lora_combine.combine_adapters(paths, paths, coefficients, output,
                                         provenance=provenance, force=force)  # fmt: skip


def _weights(
    method: str,
    models: int,
    weights: Sequence[float] | None,
    lam: float,
    density: float,
    t: float | None,
) -> list[float | None]:
    """Each input's weight as given (the base's: linear only), after checking the parameters."""
    if method == "slerp":
        if models != 1:
            raise InputError(f"--method slerp merges two models: BASE and one MODEL; got {models}")
        if t is None:
            raise InputError("--method slerp needs --t, between 0 and 1")
        if not 0.0 <= t <= 1.0:
            raise InputError(f"--method slerp needs --t between 0 and 1; got {t}")
        if weights is not None:
            raise InputError("--method slerp takes --t, not --weights")
        return [None, None]
    if t is not None:
        raise InputError("--t is for --method slerp")
    count = models + 1 if method == "linear" else models
    if weights is None:
        weights = [1.0] * count
    if len(weights) != count:
        whose = "BASE and each MODEL" if method == "linear" else "each MODEL (not BASE)"
        raise InputError(
            f"--weights gives {len(weights)} weight(s); {method} takes one for {whose}: {count}"
        )
    if any(not math.isfinite(w) for w in weights):
        raise InputError("--weights must be finite numbers")
    if method == "linear" and math.fsum(weights) == 0:
        raise InputError("--weights of a linear merge must not sum to 0")
    if not math.isfinite(lam):
        raise InputError(f"--lambda must be a finite number; got {lam}")
    if not 0.0 < density <= 1.0:
        raise InputError(
            f"--density is the fraction of each task vector kept, in (0, 1]; got {density}"
        )
    if density < 1.0 and method != "ties":
        raise InputError("--density is for --method ties")
    if lam != 1.0 and method == "linear":
        raise InputError("--lambda is for --method task-arithmetic and ties")
    return ([] if method == "linear" else [None]) + list(weights)


def _combiner(
    method: str, weights: list[float | None], lam: float, density: float, t: float | None
) -> Callable[[Iterator[np.ndarray]], np.ndarray]:
    """The per-tensor arithmetic: base's then each model's values, read one at a time as the
    method asks for them, in; the merged float64 values out."""
    numbers = [w for w in weights if w is not None]
    if method == "linear":
        return lambda xs: merge_methods.linear(xs, numbers)
    if method == "slerp":
        assert t is not None
        return lambda xs: merge_methods.slerp(t, next(xs), next(xs))
    ties = method == "ties"
    return lambda xs: merge_methods.task_arithmetic(  # TIES keeps the base as read
        next(xs) if ties else merge_methods.as_float64(next(xs)),
        xs,
        numbers,
        lam,
        density=density,
        consensus=ties,
        normalize=ties,
    )


def _computer(
    reading: Inputs,
    records: list[TensorRecord],
    planned: Planned,
    combine: Callable[[Iterator[np.ndarray]], np.ndarray],
) -> Callable[[], bytes | bytearray | memoryview]:
    """The bytes of ``planned`` in the output, computed when the writer asks for them; each
    input's tensor read when the method asks for it (:mod:`ckpttool.model.merge_methods`)."""

    def compute() -> bytes | bytearray | memoryview:
        if planned.dtype not in CASTABLE:  # equal everywhere (checked)
            return reading.raw(0, records[0])
        values = (reading.values(i, r) for i, r in enumerate(records))
        return rounded(combine(values), planned, "merge")

    return compute
