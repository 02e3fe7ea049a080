"""``lora merge``: a LoRA adapter merged into its base, one tensor at a time, in the base's layout.

For each adapted module the base's weight ``W`` becomes ``W + scaling * (B @ A)`` (transposed
when the adapter says ``fan_in_fan_out``, GPT-2's Conv1D stores ``[in, out]``; ``(B @ A).T`` for
an embedding), computed in float32 (float64 for a float64 base) and rounded back to ``W``'s
dtype once. DoRA then rescales each output row to its magnitude: ``m / ||W + dW||_row``, as
PEFT's ``merge`` does. A full copy the adapter saved (``modules_to_save``, a ``base_layer``)
takes its base tensor's place, cast to its dtype. Everything else is copied as it is stored.

Nothing loads a model: the adapter (small) is read whole; the base is written by ``convert``'s
writer (:func:`ckpttool.commands.convert.run.write_outputs`), every untouched tensor streamed
as its bytes, every merged one computed when it is written, so memory holds a few tensors at a
time. The output is verified on write as ``convert``'s is: read back, untouched tensors compared
with the base bit for bit, merged ones with the CRC-32 of the bytes computed.

The adapter's tensor names are PEFT's (``base_model.model.<module>.lora_A.weight``); the base's
name for ``<module>.weight`` is that name if the base stores it, else the one stored name that
ends with it or that it ends with (a bare state dict saved without the ``model.`` prefix, a file
with an extra one). A name found nowhere, or in more than one way, is refused. A base tensor
shared with another name (tied embeddings) is refused: merging changes both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.convert import model_dir
from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.convert.output import check_targets, parse_size, plan_outputs
from ckpttool.commands.convert.plan import Plan, build_plan
from ckpttool.commands.convert.run import write_outputs
from ckpttool.commands.selection import Selection
from ckpttool.commands.show import weights_section
from ckpttool.errors import InputError, OverflowRefusedError
from ckpttool.frameworks.base import DEFAULT_VIEW, ModelDirectoryOutput
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.values import dense_record, read_array
from ckpttool.model.cast import cast_array, stored_dtype, widen
from ckpttool.model.records import TensorRecord

#: Where an adapter directory's plug-in puts what it read (``details["adapter"]``).
ADAPTER = "adapter"
FLOATS = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Merged:
    """One base tensor the merge changed."""

    name: str  # the base's (and the output's) name
    module: str  # the adapter's module name
    how: str  # "lora", "dora", "replaced", "replaced+lora", "replaced+dora"
    rank: int | None
    scaling: float | None
    dtype: str


@dataclass
class MergeReport:
    """What ``lora merge`` wrote."""

    base: str
    adapter: str
    output: Path
    outputs: list[Path]
    format: str  # "safetensors" or "pth"
    layout: str  # the base's
    directory: bool  # written as a model directory (config.json etc. copied)
    merged: list[Merged]
    tensors: int  # tensors written
    copied: list[str] = field(default_factory=list)
    verified: bool = True
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Factors:
    """One adapted module, read from the adapter (float32 or float64)."""

    module: str
    kind: str  # "linear" or "embedding"
    a: np.ndarray
    b: np.ndarray
    scaling: float
    rank: int
    magnitude: np.ndarray | None


def merge_adapter(
    base: str | os.PathLike[str],
    adapter: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    force: bool = False,
    verify: bool = True,
    max_shard_size: str | int | None = None,
    progress: ProgressCallback | None = None,
    on_total: ProgressCallback | None = None,
) -> MergeReport:
    """Merge the LoRA ``adapter`` (a PEFT adapter directory) into ``base`` and write the result
    to ``output`` in ``base``'s layout (see the module doc); ``max_shard_size``: shards of at
    most that size plus an index, as ``convert`` writes them. ``progress`` is called with the
    bytes each tensor adds (written, then verified), ``on_total`` once with their total.
    Raises :class:`InputError` (exit 2, nothing written) for an adapter it cannot merge or whose
    targets ``base`` does not hold, :class:`~ckpttool.errors.VerificationError` (exit 1) if the
    output does not read back."""
    base_name, adapter_name = os.fspath(base), os.fspath(adapter)
    shard_size = parse_size(max_shard_size) if max_shard_size is not None else None
    read = read_adapter(adapter_name)
    factors, copies, notes = read.factors, read.copies, read.notes
    with open_checkpoint(base, view=DEFAULT_VIEW) as ckpt:
        if isinstance(ckpt.details.get(ADAPTER), dict):
            raise InputError(
                f"{base_name}: is an adapter, not a base model; give the base first: "
                "ckpttool lora merge BASE ADAPTER -o OUT"
            )
        plan = build_plan(ckpt, Selection(None, (), False, None), ConversionOptions())
        directory = model_dir.model_directory(ckpt)
        as_directory = directory is not None
        if directory is not None:
            plan = model_dir.for_transformers(plan, directory)
        stored = {p.name: p.record for p in plan.stored}
        untied: tuple[str, ...] = ()
        tied_inputs: tuple[str, ...] = ()
        if directory is not None and not any(
            name in stored or name in plan.aliases for name in directory.tied_output_names
        ):  # the loader ties the output embedding to the input one, which alone is stored
            untied, tied_inputs = directory.tied_output_names, directory.tied_input_endings
        resolve = _Resolver(base_name, adapter_name, stored, plan.aliases, untied, tied_inputs)
        replaced, merged = _plan_merge(ckpt, resolve, factors, copies)
        if on_total is not None:
            on_total(plan.tensor_bytes * (2 if verify else 1))
        report = _write(ckpt, plan, base_name, Path(output), directory, replaced, shard_size,
                        force=force, verify=verify, progress=progress)  # fmt: skip
    report.adapter, report.merged, report.directory = adapter_name, merged, as_directory
    report.notes = notes + report.notes
    return report


# --- the adapter --------------------------------------------------------------------------------


@dataclass
class Adapter:
    """A LoRA adapter read whole (it is small)."""

    factors: list[Factors]  # the adapted modules, factors as floats
    copies: dict[str, np.ndarray]  # full copies (modules_to_save), by the base tensor's name
    notes: list[str]
    summary: dict[str, Any]  # details["adapter"]
    config: dict[str, Any]  # adapter_config.json as parsed


def read_adapter(adapter: str) -> Adapter:
    """The adapter's modules (factors read as floats) and full copies (by module name), or a
    refusal naming the adapter."""
    with open_checkpoint(adapter) as ckpt:
        config = ckpt.root.get("adapter_config") if isinstance(ckpt.root, dict) else None
        summary = ckpt.details.get(ADAPTER)
        if not isinstance(summary, dict) or not summary:
            raise InputError(
                f"{adapter}: not an adapter directory (adapter_config.json with "
                "adapter_model.safetensors or adapter_model.bin)"
            )
        if summary.get("peft_type") != "LORA":
            raise InputError(
                f"{adapter}: the adapter's peft_type is {summary.get('peft_type')}; only LoRA merges"
            )
        if summary.get("unrecognised"):
            raise InputError(
                f"{adapter}: holds tensors a LoRA merge does not know how to apply "
                f"({summary['unrecognised'][0]}: lora_bias is not supported); nothing was written"
            )
        section = weights_section(ckpt)
        records = {r.key: r for r in ckpt.tensors()}

        def values(key: str) -> np.ndarray:
            record = records.get(f"{section}.{key}" if section else key)
            if record is None:
                raise InputError(f"{adapter}: {key} is not in the adapter's weights")
            return _floats(ckpt, record, adapter)

        fan_in_fan_out = bool(summary.get("fan_in_fan_out"))
        factors = []
        for module in summary.get("modules", []):
            if module["lora_A"] is None or module["lora_B"] is None:
                raise InputError(f"{adapter}: {module['module']} has no lora_A or no lora_B")
            a, b = values(module["lora_A"]), values(module["lora_B"])
            if a.ndim != 2 or b.ndim != 2:
                raise InputError(
                    f"{adapter}: {module['module']}: factors {list(a.shape)}, {list(b.shape)} are "
                    "not matrices (convolution LoRA is not supported)"
                )
            if a.shape[0] != b.shape[1] or module["scaling"] is None:
                raise InputError(
                    f"{adapter}: {module['module']}: lora_A {list(a.shape)} and lora_B "
                    f"{list(b.shape)} do not fit (rank mismatch); run ckpttool verify on it"
                )
            magnitude = values(module["magnitude"]) if module.get("magnitude") else None
            if summary.get("use_dora") and magnitude is None:
                raise InputError(f"{adapter}: {module['module']}: use_dora without a magnitude")
            kind = module["kind"] if not fan_in_fan_out else f"{module['kind']}+fan_in_fan_out"
            factors.append(
                Factors(module["module"], kind, a, b, float(module["scaling"]), a.shape[0],
                         magnitude.reshape(-1) if magnitude is not None else None)
            )  # fmt: skip
        copies = {saved["module"]: values(saved["key"]) for saved in summary.get("saved", [])}
    notes = []
    if summary.get("base_model"):
        notes.append(f"the adapter names its base model {summary['base_model']!r}")
    return Adapter(factors, copies, notes, summary, config if isinstance(config, dict) else {})


def _floats(ckpt: Checkpoint, record: TensorRecord, path: str) -> np.ndarray:
    """A floating tensor's values, float32 (float64 kept), in its shape."""
    if record.dtype not in FLOATS:
        raise InputError(f"{path}: {record.key} is {record.dtype}; a merge needs float tensors")
    dense = dense_record(ckpt, record)
    values = np.ascontiguousarray(read_array(ckpt, dense))
    if values.dtype.byteorder == ">":
        values = values.astype(values.dtype.newbyteorder("<"))
    wide = widen(values.view(stored_dtype(record.dtype)), record.dtype)
    return wide.reshape(record.shape)


# --- matching names -----------------------------------------------------------------------------


@dataclass
class _Resolver:
    """The base's stored name for an adapter's module name, or a refusal."""

    base: str
    adapter: str
    stored: dict[str, TensorRecord]
    aliases: dict[str, str]  # alias -> stored name
    untied: tuple[str, ...]  # names a model directory leaves out, tied to the input embedding
    tied_inputs: tuple[str, ...]  # endings of that input embedding's name

    def __call__(self, name: str) -> str:
        names = [*self.stored, *self.aliases]
        found = [name] if name in names else [n for n in names if _same_tail(n, name)]
        if len(found) > 1:
            raise InputError(
                f"{self.base}: the adapter's {name} matches {len(found)} tensors of the base "
                f"({', '.join(sorted(found)[:3])}); nothing was written"
            )
        if not found:
            if any(_same_tail(tied, name) or tied == name for tied in self.untied):
                raise InputError(
                    f"{self.base}: the adapter changes {name}, which the base does not store: it "
                    "is tied to the input embedding (tie_word_embeddings), so merging would change "
                    "both; untie them first (store the output embedding and set "
                    "tie_word_embeddings to false in config.json), then merge"
                )
            raise InputError(
                f"{self.base}: the adapter's target {name} is not in the base (is it the "
                f"adapter's base model?); nothing was written"
            )
        match = found[0]
        if any(match == ending or match.endswith("." + ending) for ending in self.tied_inputs):
            raise InputError(
                f"{self.base}: the adapter changes {match}, the input embedding, which the "
                f"model directory ties {', '.join(self.untied)} to (tie_word_embeddings; it is "
                "not stored): merging would change the output layer too; untie them first "
                "(store the output embedding and set tie_word_embeddings to false in "
                "config.json), then merge"
            )
        tied = self._tied_with(match)
        if tied:
            raise InputError(
                f"{self.base}: {match} is tied to {', '.join(tied)} (one tensor under two names, "
                "e.g. tie_word_embeddings): merging the adapter into it would change both; untie "
                "them first (store a copy under each name), then merge"
            )
        return match

    def _tied_with(self, name: str) -> list[str]:
        kept = self.aliases.get(name, name)
        group = {kept} | {alias for alias, target in self.aliases.items() if target == kept}
        return sorted(group - {name})


def _same_tail(stored: str, wanted: str) -> bool:
    """One name is the other with a prefix of whole components (``model.`` added or dropped)."""
    return stored.endswith("." + wanted) or wanted.endswith("." + stored)


# --- computing ----------------------------------------------------------------------------------


def _plan_merge(
    ckpt: Checkpoint,
    resolve: _Resolver,
    factors: list[Factors],
    copies: dict[str, np.ndarray],
) -> tuple[dict[str, Callable[[], bytes | bytearray | memoryview]], list[Merged]]:
    """For each base tensor the adapter changes, the function that computes its bytes (called
    when it is written), after every name and shape was checked: nothing is written before."""
    by_name: dict[str, tuple[Factors | None, np.ndarray | None, str]] = {}
    for module, copy in copies.items():
        name = resolve(module)
        by_name[name] = (None, copy, module)
    for item in factors:
        name = resolve(item.module + ".weight")
        previous = by_name.get(name)
        by_name[name] = (item, previous[1] if previous else None, item.module)
    replaced: dict[str, Callable[[], bytes | bytearray | memoryview]] = {}
    merged = []
    for name, (change, saved_copy, module) in by_name.items():
        record = resolve.stored.get(name) or resolve.stored[resolve.aliases[name]]
        _check_shape(resolve.base, name, record, change, saved_copy)
        steps = ["replaced"] if saved_copy is not None else []
        if change is not None:
            steps.append("dora" if change.magnitude is not None else "lora")
        merged.append(Merged(name, module, "+".join(steps), change.rank if change else None,
                             change.scaling if change else None, record.dtype))  # fmt: skip
        replaced[name] = _computer(ckpt, record, change, saved_copy, resolve.base)
    return replaced, merged


def _check_shape(
    base: str, name: str, record: TensorRecord, item: Factors | None, copy: np.ndarray | None
) -> None:
    if record.dtype not in FLOATS:
        raise InputError(f"{base}: {name} is {record.dtype}; only float weights are merged")
    shape = tuple(record.shape)
    if copy is not None and tuple(copy.shape) != shape:
        raise InputError(
            f"{base}: {name} is {list(shape)}, the adapter's copy of it {list(copy.shape)}"
        )
    if item is not None:
        expected = _delta_shape(item)
        if shape != expected:
            raise InputError(
                f"{base}: {name} is {list(shape)}, but the adapter's {item.module} "
                f"(lora_A {list(item.a.shape)}, lora_B {list(item.b.shape)}, {item.kind}) "
                f"changes a {list(expected)} weight; nothing was written"
            )


def _delta_shape(item: Factors) -> tuple[int, ...]:
    out, inputs = item.b.shape[0], item.a.shape[1]
    transposed = item.kind.startswith("embedding") != item.kind.endswith("fan_in_fan_out")
    return (inputs, out) if transposed else (out, inputs)


def _computer(
    ckpt: Checkpoint,
    record: TensorRecord,
    item: Factors | None,
    copy: np.ndarray | None,
    base: str,
) -> Callable[[], bytes | bytearray | memoryview]:
    def compute() -> bytes | bytearray | memoryview:
        weight = copy if copy is not None else _floats(ckpt, record, base)
        wide = np.float64 if record.dtype == "float64" else np.float32
        weight = np.array(weight, dtype=wide)  # writable: the update is added in place
        if item is not None:
            weight = merged_weight(weight, item)
        narrow, counts = cast_array(np.ascontiguousarray(weight), str(np.dtype(wide)),
                                    record.dtype)  # fmt: skip
        if counts.overflow:
            raise OverflowRefusedError(
                f"{base}: {record.key}: {counts.overflow:,} merged value(s) overflow "
                f"{record.dtype}; nothing was written"
            )
        return narrow.view(np.uint8).data

    return compute


def merged_weight(weight: np.ndarray, item: Factors) -> np.ndarray:
    """``weight`` (the base's layout, float32 or float64) with the module's update applied."""
    dtype = weight.dtype
    delta = (item.b.astype(dtype) @ item.a.astype(dtype)) * dtype.type(item.scaling)
    if item.kind.startswith("embedding") != item.kind.endswith("fan_in_fan_out"):
        delta = delta.T
    weight += delta
    if item.magnitude is None:
        return weight
    # DoRA: each output row rescaled to its magnitude (PEFT's dora merge; rows are outputs
    # once a [in, out] Conv1D weight is transposed)
    rows = weight.T if item.kind.endswith("fan_in_fan_out") else weight
    norm = np.sqrt(np.sum(rows * rows, axis=1, dtype=dtype))
    factor = item.magnitude.astype(dtype) / norm
    rows *= factor[:, None]
    return weight


def _write(
    ckpt: Checkpoint,
    plan: Plan,
    base: str,
    target: Path,
    directory: ModelDirectoryOutput | None,
    replaced: dict[str, Callable[[], bytes | bytearray | memoryview]],
    shard_size: int | None,
    *,
    force: bool,
    verify: bool,
    progress: ProgressCallback | None,
) -> MergeReport:
    """The merged base in its own layout: a model directory stays one (its config files
    copied), a file stays a file of its format."""
    source = Path(base)
    counted = progress or (lambda n: None)

    def write(files: list[Any]) -> None:
        write_outputs(ckpt, plan, files, allow_overflow=False, verify=verify,
                      progress=counted, replaced=replaced)  # fmt: skip

    copied: list[str] = []
    if directory is not None:
        model_dir.check_target(directory, target, force)
        with model_dir.staged_directory(target) as staging:
            weights = staging / directory.weights_name if shard_size is None else staging
            files = plan_outputs(source, weights, None, shard_size, plan)
            write(files)
            copied = model_dir.copy_files(directory, staging)
        files = model_dir.moved(files, target)
    else:
        # a file keeps its format; another directory (DCP, DeepSpeed) goes by OUT's suffix
        to = None if ckpt.format == "directory" else _kind_of_format(ckpt.format)
        if to is not None and target.suffix and _kind_of(target) not in (None, to):
            suffix = "safetensors" if to == "safetensors" else "pth"
            raise InputError(
                f"{target}: the base is a .{suffix} file and the merged output keeps its "
                f"format: name a .{suffix} file"
            )
        files = plan_outputs(source, target, to, shard_size, plan)
        check_targets(source, files, force)
        write(files)
    return MergeReport(
        base=base,
        adapter="",
        output=target,
        outputs=[f.target for f in files],
        format=files[0].kind,
        layout=plan.layout,
        directory=directory is not None,
        merged=[],
        tensors=len(plan.stored),
        copied=copied,
        verified=verify,
        notes=list(plan.notes),
    )


def _kind_of_format(file_format: str) -> str:
    """The output kind that keeps a file's format (every torch format is written as a .pth)."""
    return "safetensors" if file_format == "safetensors" else "pth"


def _kind_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in (".pth", ".pt", ".bin", ".ckpt"):
        return "pth"
    return None
