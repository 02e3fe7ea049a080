"""``rescale-step`` for DeepSpeed ZeRO: write DeepSpeed's *universal checkpoint* without DeepSpeed.

DeepSpeed refuses to resume a ZeRO checkpoint on another data-parallel size ("The checkpoint
being loaded used a DP world size of 2 but the current world size is 1") unless it is first
converted by ``ds_to_universal`` and loaded with ``"checkpoint": {"load_universal": true}``.
This module writes what ``ds_to_universal`` (DeepSpeed 0.19.8) writes, one parameter at a time
from the rank files' byte ranges (:mod:`ckpttool.frameworks.deepspeed.consolidate` finds them), so memory is
bounded by the largest parameter and neither torch nor DeepSpeed is imported::

    OUT/latest_universal                     the tag's name (what load_universal reads)
    OUT/<tag>_universal/*_model_states.pt    the source's, counters rescaled (below)
    OUT/<tag>_universal/zero/optimizer_state.pt
    OUT/<tag>_universal/zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt (+ step.pt, ZeRO-1/2)

ZeRO-1/2 files hold ``{"param": full tensor, "cat_dim": 0}``; ZeRO-3 files hold the flat
tensor, as ``ds_to_universal`` writes each. ZeRO-1/2 also gets ``zero/<name>/fp32.pt`` for every
entry of the saved ``module`` without an optimizer fragment (buffers, frozen and shared
parameters: ``{"param": value.float()}``). ``optimizer_state.pt`` holds what the loaders read:
ZeRO-1/2 the optimizer state dict without its partitioned tensors (as ``ds_to_universal``),
ZeRO-3 its scalars, ``param_groups`` and each group's Adam ``step`` (``ds_to_universal`` also
keeps rank 0's own partition of the moments there, which no loader reads; they are left out).

Counters. DeepSpeed's ``global_steps`` counts optimizer steps, each of ``micro batch x
gradient accumulation x data-parallel size`` samples. When the per-GPU batch stays the same
(the default), a run moved from M to N processes has done ``global_steps x M / N`` of its new
steps: ``global_steps`` is rescaled by MiniMind's rule (floor, the remainder reported) and the
LR scheduler (``last_batch_iteration``, or a torch scheduler's ``last_epoch``/``_step_count``)
moves by the same amount, so the schedule continues at the sample count it had reached.
``global_samples`` counts samples, which the move does not change: it is kept. With
``keep_global_batch`` (the new run keeps the global batch by more accumulation or a larger
per-GPU batch) nothing is rescaled. The Adam ``step`` (bias correction) counts updates applied
to the moments and is never rescaled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import (
    CkptError,
    InputError,
    LayoutError,
    OutputExistsError,
    VerificationError,
)
from ckpttool.formats.base import OutTensor
from ckpttool.formats.torch_zip.writer import StoredTensor, write_torch_object
from ckpttool.frameworks.base import FrameworkDirectory, open_member
from ckpttool.frameworks.deepspeed.consolidate import (
    ZeroWeights,
    find_tag,
    open_zero_weights,
    pieced_record,
    slice_piece,
    span_pieces,
)
from ckpttool.io.atomic import staged_directory
from ckpttool.model.lr_schedule import STEP_COUNTERS, moved_counters
from ckpttool.model.records import OpaqueObject, TensorRecord
from ckpttool.model.rescaling import (
    COPY,
    REWRITE,
    DirectoryRescaleReport,
    FileAction,
    RescalePlan,
    ValueChange,
    counter_plan,
)
from ckpttool.model.roles import DEEPSPEED

ZERO_LAYOUT = DEEPSPEED  # the name show gives the directory (ckpttool/model/vocabulary.py)
LATEST_UNIVERSAL = "latest_universal"
MOMENTS = ("exp_avg", "exp_avg_sq")
#: optimizer_state_dict entries ds_to_universal leaves out of ZeRO-1/2's optimizer_state.pt
SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")

Produce = Callable[[], bytearray]


@dataclass
class OutFile:
    """One file of the universal tag: its object tree and how to produce its storages."""

    name: str  # relative to the tag directory
    value: Any
    storages: list[tuple[str, Produce]]


def rescale_zero(
    path: str | os.PathLike[str],
    world_size: int,
    *,
    from_world_size: int | None = None,
    keep_global_batch: bool = False,
    strict: bool = False,
    output: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    batch_size: int | None = None,
    layout: FrameworkDirectory | None = None,
) -> DirectoryRescaleReport:
    """Write the ZeRO checkpoint at ``path`` as a universal checkpoint for ``world_size``
    processes into the new save directory ``output`` (default ``PATH.ws<N>``), built beside it
    and renamed into place; every tensor is read back and compared before it appears.
    ``layout``: the directory as detection found it (not probed again)."""
    source = Path(path)
    target = Path(output or f"{source}.ws{world_size}")
    if target.resolve() == source.resolve():
        raise InputError(f"{target} is the checkpoint itself; name a new directory with -o")
    if os.path.lexists(target) and not overwrite:
        raise OutputExistsError(f"{target} already exists (pass --force to replace it)")
    zero_tag = find_tag(source, layout.found if layout is not None else None)
    with open_zero_weights(source, zero_tag) as ckpt:
        weights: ZeroWeights = ckpt.details["zero"]
        saved = weights.dp_world_size
        if from_world_size is not None and from_world_size != saved:
            raise InputError(
                f"{source}: the optimizer states were saved by {saved} data-parallel ranks, "
                f"not {from_world_size} (--from-world-size)"
            )
        model = weights.model_state
        old_steps = model.get("global_steps")
        if not isinstance(old_steps, int):
            raise LayoutError(f"{source}: the model states hold no integer global_steps")
        # With the global batch kept, a saved step is one of the new run's steps: count it as
        # taken on world_size ranks (the plan's file_world_size keeps the saved dp size).
        counted_on = world_size if keep_global_batch else saved
        plan = counter_plan("global_steps", old_steps, counted_on, world_size, strict)
        plan = RescalePlan("global_steps", plan.old_step, plan.new_step, counted_on, saved,
                           world_size, ())  # fmt: skip
        changes, model_changes = _counter_changes(model, plan.new_step - plan.old_step)
        tag = f"{weights.tag.name}_universal"
        lr = _resumed_lr(model, model_changes)
        files = plan_files(weights, _producer(ckpt), lr=lr)
        action = REWRITE if model_changes else COPY
        what = ", ".join(model_changes) + " rescaled" if model_changes else "copied byte for byte"
        actions = [
            FileAction(f"{tag}/{f.name}", f.name, action, dict(model_changes), why=what)
            for f in map(Path, weights.tag.model_files)
        ]
        why = (
            f"{len(files) - 1} files: every parameter's fp32 weights and Adam moments, whole "
            "(DeepSpeed's universal layout)"
        )
        actions.append(FileAction(f"{tag}/zero/", "*_optim_states.pt", REWRITE, why=why))
        notes = _notes(weights, keep_global_batch, world_size)
        changes = [  # every model-states file carries the counters
            ValueChange(a.name, c.key, c.old, c.new) for a in actions[:-1] for c in changes
        ]
        if lr is not None:
            changes.append(ValueChange(f"{tag}/zero/optimizer_state.pt", "param_groups[*].lr",
                                       _saved_lr(weights), lr))  # fmt: skip
        elif model_changes:
            notes.append(
                "the scheduler is not DeepSpeed's WarmupLR/WarmupDecayLR: the first resumed "
                "step uses the learning rate saved with the optimizer, the schedule's rate at "
                "the rescaled step from the second on"
            )
        report = DirectoryRescaleReport(
            source, target, ZERO_LAYOUT, plan, tuple(changes), tuple(actions), tuple(notes), batch_size, dry_run, False, False,
        )  # fmt: skip
        if dry_run:
            return report
        _write(ckpt, weights, files, tag, model_changes, target, overwrite)
    return DirectoryRescaleReport(**{**report.__dict__, "written": True})


def _producer(ckpt: Any) -> Callable[[TensorRecord], Produce]:
    """How to produce the bytes of a consolidated record (read when the file is written)."""

    def producer(record: TensorRecord) -> Produce:
        return lambda: ckpt.read_storage(record.storage, 0, record.nbytes)

    return producer


def _counter_changes(model: dict[str, Any], delta: int) -> tuple[list[ValueChange], dict[str, Any]]:
    """``global_steps`` and the LR scheduler's counters moved by ``delta``."""
    if delta == 0:
        return [], {}
    old_steps = model["global_steps"]
    changes = [ValueChange("", "global_steps", old_steps, old_steps + delta)]
    new: dict[str, Any] = {"global_steps": old_steps + delta}
    scheduler = model.get("lr_scheduler")
    if isinstance(scheduler, dict) and scheduler:
        keys = [k for k in ("last_batch_iteration", *STEP_COUNTERS) if k in scheduler]
        if not keys or not all(isinstance(scheduler[k], int) for k in keys):
            raise LayoutError(
                "the saved lr_scheduler has no integer last_batch_iteration or last_epoch; "
                "its position cannot be moved with global_steps, so nothing was written "
                "(--keep-global-batch keeps every counter)"
            )
        moved = {**scheduler, **moved_counters(scheduler, delta, tuple(keys))}
        for key in keys:
            changes.append(ValueChange("", f"lr_scheduler.{key}", scheduler[key], moved[key]))
        new["lr_scheduler"] = moved
    return changes, new


def _resumed_lr(model: dict[str, Any], model_changes: dict[str, Any]) -> float | None:
    """The rate the first resumed step must use when the scheduler moved (None: keep it)."""
    from ckpttool.frameworks.deepspeed.schedule import scheduled_lr

    scheduler = model_changes.get("lr_scheduler")
    if not isinstance(scheduler, dict) or "last_batch_iteration" not in scheduler:
        return None
    return scheduled_lr(model.get("ds_config"), scheduler["last_batch_iteration"])


def _saved_lr(weights: ZeroWeights) -> Any:
    groups = _param_groups(weights.optimizer_states[0], weights.stage)
    return groups[0].get("lr") if groups and isinstance(groups[0], dict) else None


def _param_groups(state: dict[str, Any], stage: int) -> Any:
    inner = state.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict")
    return inner.get("param_groups") if isinstance(inner, dict) else None


def _notes(weights: ZeroWeights, keep_global_batch: bool, world_size: int) -> list[str]:
    notes = [
        f"DeepSpeed ZeRO-{weights.stage}, {weights.dp_world_size} data-parallel rank(s) -> a "
        f"universal checkpoint; resume on {world_size} with "
        '"checkpoint": {"load_universal": true} and load_checkpoint(OUT)'
    ]
    if keep_global_batch:
        notes.append(
            f"--keep-global-batch: the {world_size} new ranks train the saved run's global "
            "batch (more accumulation or a larger per-GPU batch), so global_steps and the "
            "scheduler are kept as saved"
        )
    else:
        notes.append(
            "global_samples is kept (samples seen do not depend on the number of GPUs); the "
            "Adam step (bias correction) is kept"
        )
    return notes


def plan_files(
    weights: ZeroWeights, produce: Callable[[TensorRecord], Produce], *, lr: float | None = None
) -> list[OutFile]:
    """The files of ``zero/``: optimizer_state.pt (its groups' rate set to ``lr`` if given),
    then each parameter's state files."""
    files = [OutFile("zero/optimizer_state.pt", *_optimizer_state(weights, produce, lr))]
    flat = weights.stage == 3
    for name, spans in weights.spans.items():
        _check_name(name)
        shape = weights.tensors[name].shape
        for key in ("fp32", *MOMENTS):
            record = pieced_record(name, "float32", shape, span_pieces(weights, spans, key))
            files.append(_tensor_file(f"zero/{name}/{key}.pt", record, produce, flat=flat))
        if not flat:
            step = _group_state(weights, 0, spans[0].group).get("step")
            files.append(OutFile(f"zero/{name}/step.pt", *_value(step, produce)))
    if not flat:  # ds_to_universal: module entries without optimizer fragments, .float()
        module = weights.model_state["module"]
        member = len(weights.tag.optim_files)
        for name, value in module.items():
            if name in weights.spans or not isinstance(value, TensorRecord):
                continue
            _check_name(name)
            pieces = [slice_piece(member, value, 0, value.numel)] if value.numel else []
            record = pieced_record(name, "float32", value.shape, pieces)
            files.append(_tensor_file(f"zero/{name}/fp32.pt", record, produce, flat=False,
                                      cat_dim=False))  # fmt: skip
    return files


def _check_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise LayoutError(f"parameter name {name!r} cannot be a directory of the universal layout")


def _tensor_file(
    name: str,
    record: TensorRecord,
    produce: Callable[[TensorRecord], Produce],
    *,
    flat: bool,
    cat_dim: bool = True,
) -> OutFile:
    """ZeRO-3: the flat tensor; ZeRO-1/2: ``{"cat_dim": 0, "param": tensor}`` (ds_to_universal's
    key order), ``{"param": tensor}`` for a module entry without optimizer state."""
    shape = (record.numel,) if flat else record.shape
    tensor = StoredTensor("0", OutTensor("", "float32", shape))
    value: Any = tensor
    if not flat:
        value = {"cat_dim": 0, "param": tensor} if cat_dim else {"param": tensor}
    return OutFile(name, value, [("0", produce(record))])


def _group_state(weights: ZeroWeights, rank: int, group: int) -> dict[str, Any]:
    state = weights.optimizer_states[rank]
    inner = state.get("base_optimizer_state" if weights.stage <= 2 else "optimizer_state_dict")
    try:
        found = inner["state"][group]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        found = None
    if not isinstance(found, dict):
        raise LayoutError(f"{weights.tag.optim_files[rank]}: no optimizer state of group {group}")
    return found


def _value(value: Any, produce: Callable[[TensorRecord], Produce]) -> tuple[Any, list[Any]]:
    """A small value (Adam's step) as written: a tensor keeps its dtype and bytes."""
    if isinstance(value, TensorRecord):
        if value.numel != 1 or value.storage is None:
            raise LayoutError("an Adam step is not a one-element tensor")
        record = pieced_record("step", value.dtype, value.shape, [slice_piece(0, value, 0, 1)])
        return StoredTensor("0", OutTensor("", value.dtype, value.shape)), [("0", produce(record))]
    return value, []


def _optimizer_state(
    weights: ZeroWeights, produce: Callable[[TensorRecord], Produce], lr: float | None
) -> tuple[Any, list[Any]]:
    first = weights.optimizer_states[0]
    groups = _plain(_param_groups(first, weights.stage), "param_groups")
    if not isinstance(groups, list):
        raise LayoutError(f"{weights.tag.optim_files[0]}: the optimizer state has no param_groups")
    if lr is not None:
        groups = [{**group, "lr": lr} if isinstance(group, dict) else group for group in groups]
    if weights.stage <= 2:
        value = {k: v for k, v in first.items() if k not in SHARDED}
        value = _plain(value, "optimizer_state.pt")
        if isinstance(value.get("group_paddings"), list):
            # ds_to_universal strips the paddings off the partitions and zeroes their record
            value["group_paddings"] = [0] * len(value["group_paddings"])
        value["param_groups"] = groups
        return value, []
    inner = first["optimizer_state_dict"]
    storages: list[Any] = []
    steps: dict[Any, Any] = {}
    for group in inner["state"]:
        step, parts = _value(_group_state(weights, 0, group).get("step"), produce)
        if parts:
            key = str(len(storages))
            storages.append((key, parts[0][1]))
            step = StoredTensor(key, step.tensor)
        steps[group] = {"step": step}
    value = {
        k: v for k, v in first.items() if k not in ("optimizer_state_dict", "fp32_flat_groups")
    }
    value = _plain(value, "optimizer_state.pt")
    value["optimizer_state_dict"] = {"state": steps, "param_groups": groups}
    value["param_groups"] = groups
    return value, storages


def _plain(value: Any, where: str) -> Any:
    """``value`` with no tensors (they would need their bytes); objects are kept by name."""
    if isinstance(value, TensorRecord):
        raise LayoutError(f"{where}: an unexpected tensor in the optimizer's scalars")
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, where) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, OpaqueObject):
        return value
    return value


# --- writing ---------------------------------------------------------------------------------


def _write(
    ckpt: Any,
    weights: ZeroWeights,
    files: list[OutFile],
    tag: str,
    model_changes: dict[str, Any],
    target: Path,
    overwrite: bool,
) -> None:
    from ckpttool.formats.torch_zip.rewrite import FieldRewrite, verify_rewrite

    parent = target.resolve().parent
    try:
        with staged_directory(target, replace_existing=overwrite, parent=parent) as temp:
            tag_dir = temp / tag
            tag_dir.mkdir()
            for source in map(Path, weights.tag.model_files):
                destination = tag_dir / source.name
                with open(destination, "xb") as out:
                    if model_changes:
                        with (
                            open_member(source, track_spans=True) as member,
                            FieldRewrite(member, model_changes) as rewrite,
                        ):
                            rewrite.write(out)
                    else:
                        with open(source, "rb") as src:
                            shutil.copyfileobj(src, out, 8 << 20)
                    out.flush()
                    os.fsync(out.fileno())
                if model_changes:
                    with open_member(source) as member:
                        verify_rewrite(member, destination, model_changes)
            for out_file in files:
                path = tag_dir / out_file.name
                path.parent.mkdir(parents=True, exist_ok=True)
                digests = _write_file(path, out_file)
                _verify_file(path, out_file, digests)
            (temp / LATEST_UNIVERSAL).write_text(tag)
    except BaseException as error:
        if isinstance(error, OSError) and not isinstance(error, CkptError):
            raise InputError(f"writing {target} failed, nothing was written: {error}") from error
        raise


def _write_file(path: Path, out_file: OutFile) -> dict[str, bytes]:
    digests: dict[str, bytes] = {}

    def storages() -> Iterator[tuple[str, bytearray]]:
        for key, produce in out_file.storages:
            data = produce()
            digests[key] = hashlib.blake2b(data).digest()
            yield key, data

    with open(path, "xb") as handle:
        write_torch_object(handle, out_file.value, storages())
        handle.flush()
        os.fsync(handle.fileno())
    return digests


def _verify_file(path: Path, out_file: OutFile, digests: dict[str, bytes]) -> None:
    """Read the written file back through the reader: the same tensors, bit for bit."""
    with open_member(path) as written:
        found = {r.storage.key: r for r in written.tensors() if r.storage is not None}
        if sorted(found) != sorted(digests):
            raise VerificationError(f"{path.name} does not hold the tensors written; removed")
        for key, record in found.items():
            data, first = written.read_bytes(record)
            got = memoryview(data)[first * record.itemsize :][: record.nbytes]
            if hashlib.blake2b(got).digest() != digests[key]:
                raise VerificationError(
                    f"{path} did not read back bit for bit; nothing was written"
                )


__all__ = ["plan_files", "rescale_zero"]
