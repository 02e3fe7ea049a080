"""What a DeepSpeed checkpoint's merged tree says, and the problems between its files.

:func:`summarize` reads the tree :mod:`ckpttool.frameworks.tree` built from the members
:func:`ckpttool.frameworks.deepspeed.files.detect` listed: stage, dtype, world sizes, counters, the
scheduler, every parameter by name with its real shape (``param_shapes``; under ZeRO-3
``module`` holds 0-element placeholders), and the checks ``verify`` reports: rank files against
``dp_world_size``, ``partition_count`` and ``zero_stage``; the flat fp32 partitions' sizes against
the parameters (with DeepSpeed's padding rules); module shapes against ``param_shapes``.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ckpttool.frameworks.base import Placeholders
from ckpttool.frameworks.deepspeed.files import (
    DTYPE_PREFIXES,
    MODEL_STATES,
    OPTIM_STATES,
    OPTIM_STATES_FILE,
    record_value,
)
from ckpttool.io.source import is_dir, list_names
from ckpttool.model.records import TensorRecord


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in value
    ):
        return tuple(value)
    return None


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _ranks(root: dict[str, Any], part: str) -> dict[int, Any]:
    """``{rank: tree}`` of a per-rank section (``optimizer_states``, ZeRO-3 ``model_states``)."""
    node = root.get(part)
    if not isinstance(node, dict):
        return {}
    return {
        int(key[4:]): value
        for key, value in node.items()
        if isinstance(key, str) and key.startswith("rank") and key[4:].isdigit()
    }


def _get(node: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def summarize(root: dict[str, Any], details: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What a DeepSpeed directory's merged tree says (``details["deepspeed"]``), and the
    problems between its files (counts, stages, sizes), each naming the file concerned.

    Also adds the files the recorded data-parallel world size needs but that are not there to
    ``details["missing"]`` (and clears ``details["complete"]``)."""
    prefix = f"{details['tag']}/" if details.get("tags") else ""
    problems: list[str] = []
    model = root.get(MODEL_STATES)
    per_rank_model = _ranks(root, MODEL_STATES)
    first_model: Any = per_rank_model[min(per_rank_model)] if per_rank_model else model
    if not isinstance(first_model, dict):
        first_model = {}
    optim = {rank: record_value(_get(tree, "optimizer_state_dict")) or {}
             for rank, tree in _ranks(root, OPTIM_STATES).items()}  # fmt: skip
    ds_config = (
        first_model.get("ds_config") if isinstance(first_model.get("ds_config"), dict) else {}
    )
    members = details.get("members") or []
    optim_names = {m["rank"]: m["name"] for m in members if m.get("role") == OPTIM_STATES}
    model_names = {m["rank"]: m["name"] for m in members if m.get("role") == MODEL_STATES}

    stages = {rank: state.get("zero_stage") for rank, state in optim.items()}
    config_stage = _get(ds_config, "zero_optimization", "stage")
    stage: Any = next(iter(stages.values()), None)
    if stage is None:
        stage = config_stage if isinstance(config_stage, int) else (0 if first_model else None)
    for rank, value in stages.items():
        if value != stage:
            problems.append(
                f"{optim_names.get(rank, rank)}: zero_stage {value}, other ranks' {stage}"
            )
    dtype = _dtype(ds_config, members)
    dp_world = first_model.get("dp_world_size")
    mp_world = first_model.get("mp_world_size")
    summary: dict[str, Any] = {
        "stage": stage,
        "dtype": dtype,
        "dp_world_size": dp_world,
        "mp_world_size": mp_world,
        "tag": details.get("tag"),
        "latest": details.get("latest"),
        "tags": details.get("tags", [details.get("tag")]),
    }
    for key in ("global_steps", "global_samples", "skipped_steps"):
        summary[key] = first_model.get(key)
    summary["lr_scheduler"] = record_value(first_model.get("lr_scheduler"))
    summary["ds_version"] = first_model.get("ds_version")
    summary["optimizer"] = _optimizer_summary(ds_config, optim, first_model)
    params, num_parameters, param_problems = _parameters(first_model, stage, model_names)
    summary["parameters"] = params
    summary["num_parameters"] = num_parameters
    summary["buffers"] = _buffers(first_model)
    summary["placeholders"] = stage == 3
    problems += param_problems

    # how many rank files the recorded world size needs, and whether they agree
    missing: list[str] = details.setdefault("missing", [])
    if isinstance(dp_world, int) and not isinstance(dp_world, bool) and stage in (1, 2, 3):
        want = _optim_prefix(members) + "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
        missing += [prefix + want.format(r) for r in range(dp_world) if r not in optim_names]
        extra = sorted(r for r in optim_names if r >= dp_world)
        problems += [f"{optim_names[r]}: rank {r}, but dp_world_size is {dp_world}" for r in extra]
        for rank, state in optim.items():
            count = state.get("partition_count")
            counts = count if isinstance(count, list) else [count]
            if any(c != dp_world for c in counts):
                problems.append(
                    f"{optim_names.get(rank, rank)}: partition_count {count}, but dp_world_size "
                    f"is {dp_world} (the model-states file)"
                )
        if stage == 3:
            want = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
            missing += [prefix + want.format(r) for r in range(dp_world) if r not in model_names]
    elif stage in (1, 2, 3) and not optim_names and first_model:  # no world size recorded
        missing.append(
            prefix + _optim_prefix(members) + "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        )
    for rank, tree in per_rank_model.items():
        if isinstance(tree, dict) and tree.get("dp_world_size") != dp_world:
            problems.append(
                f"{model_names.get(rank, rank)}: dp_world_size {tree.get('dp_world_size')}, "
                f"rank 0's {dp_world}"
            )
    sizes, size_problems = _partition_sizes(stage, optim, params, optim_names, dp_world)
    summary["partitions"] = sizes
    problems += size_problems
    if missing or problems:
        details["complete"] = False
    return summary, problems


def _dtype(ds_config: dict[str, Any], members: list[dict[str, Any]]) -> str:
    for name in ("bf16", "bfloat16"):
        if _get(ds_config, name, "enabled") is True:
            return "bf16"
    if _get(ds_config, "fp16", "enabled") is True:
        return "fp16"
    prefix = _optim_prefix(members)
    return DTYPE_PREFIXES.get(prefix, "fp32")


def _optim_prefix(members: list[dict[str, Any]]) -> str:
    for member in members:
        match = OPTIM_STATES_FILE.match(os.path.basename(str(member.get("name"))))
        if match:
            return match.group(1) or ""
    return ""


def _optimizer_summary(
    ds_config: dict[str, Any], optim: dict[int, dict[str, Any]], model: dict[str, Any]
) -> dict[str, Any] | None:
    configured = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    first = optim[min(optim)] if optim else {}
    base = first.get("base_optimizer_state") or first.get("optimizer_state_dict") or {}
    if not optim and isinstance(model.get("optimizer"), dict):  # ZeRO-0: in the model file
        base = record_value(model["optimizer"])
        base = base.get("optimizer_state_dict", base) if isinstance(base, dict) else {}
        first = record_value(model["optimizer"]) or {}
    groups = base.get("param_groups") if isinstance(base, dict) else None
    hyper = [
        {str(k): v for k, v in group.items() if k != "params" and not isinstance(v, dict)}
        for group in groups or []
        if isinstance(group, dict)
    ]
    if configured is None and not hyper:
        return None
    return {
        "type": _get(configured, "type") if isinstance(configured, dict) else None,
        "param_groups": hyper,
        "loss_scaler": first.get("loss_scaler") if isinstance(first, dict) else None,
    }


def _parameters(
    model: dict[str, Any], stage: Any, model_names: dict[int, str]
) -> tuple[list[dict[str, Any]], int, list[str]]:
    """Every parameter by name with its real shape (``param_shapes``, ``frozen_param_shapes``,
    ``shared_params``), the elements stored once, and the shapes that disagree."""
    problems: list[str] = []
    module: dict[str, Any] = model["module"] if isinstance(model.get("module"), dict) else {}
    where = model_names.get(min(model_names)) if model_names else MODEL_STATES
    params: list[dict[str, Any]] = []
    total = 0
    groups = model.get("param_shapes")
    for group_index, group in enumerate(groups if isinstance(groups, list) else []):
        for name, value in group.items() if isinstance(group, dict) else ():
            shape = _shape(value)
            if shape is None:
                problems.append(f"{where}: param_shapes[{group_index}][{name!r}] is not a shape")
                continue
            params.append(_param(name, shape, "trained", group_index, module))
            total += _numel(shape)
    frozen = model.get("frozen_param_shapes")
    for name, value in frozen.items() if isinstance(frozen, dict) else ():
        shape = _shape(value)
        if shape is not None:
            params.append(_param(name, shape, "frozen", None, module))
            total += _numel(shape)
    known = {p["name"] for p in params}
    shared = model.get("shared_params")
    aliases = set(shared) if isinstance(shared, dict) else set()
    if stage != 3:
        # The module holds full weights. ZeRO-0 saves no param_shapes, ZeRO-1 no
        # frozen_param_shapes: what is neither named there nor a buffer is a parameter the
        # optimizer does not train (ZeRO-0: every parameter); a second name of one storage is
        # a tied parameter.
        buffers = set(model.get("buffer_names") or [])
        owners: dict[Any, str] = {p["name"]: p["name"] for p in params}
        by_storage: dict[Any, str] = {}
        for name, record in module.items():
            if not isinstance(record, TensorRecord) or record.storage is None:
                continue
            identity = (record.storage, record.storage_offset, record.shape)
            first = by_storage.setdefault(identity, str(name))
            if name in buffers or name in aliases:
                continue
            if first != name and shared is None:
                aliases.add(name)
                shared = {**(shared or {}), name: owners.get(first, first)}
            elif name not in known:
                kind = "parameter" if stage == 0 else "frozen"
                params.append(_param(str(name), record.shape, kind, None, module))
                known.add(str(name))
                total += record.numel
    for alias, owner in shared.items() if isinstance(shared, dict) else ():
        owner_entry = next((p for p in params if p["name"] == owner), None)
        shape = owner_entry["shape"] if owner_entry else None
        params.append({"name": alias, "shape": shape, "numel": _numel(tuple(shape)) if shape else None,
                       "kind": "shared", "owner": owner, "group": None,
                       "stored": _stored(module.get(alias))})  # fmt: skip
        if owner not in known:
            problems.append(f"{where}: shared_params names {alias!r} -> {owner!r}, not a parameter")
    for entry in params:
        stored = entry["stored"]
        if stage == 3 or stored is None or entry["shape"] is None:
            continue
        if list(stored["shape"]) != list(entry["shape"]):
            problems.append(
                f"{where}: module[{entry['name']!r}] has shape {stored['shape']}, "
                f"param_shapes says {entry['shape']}"
            )
    return params, total, problems


def _param(
    name: str, shape: tuple[int, ...], kind: str, group: int | None, module: dict[str, Any]
) -> dict[str, Any]:
    return {"name": str(name), "shape": list(shape), "numel": _numel(shape), "kind": kind,
            "owner": None, "group": group, "stored": _stored(module.get(name))}  # fmt: skip


def _stored(record: Any) -> dict[str, Any] | None:
    """The module entry the model-states file stores (under ZeRO-3 a 0-element placeholder)."""
    if not isinstance(record, TensorRecord):
        return None
    return {"dtype": record.dtype, "shape": list(record.shape)}


def _buffers(model: dict[str, Any]) -> list[dict[str, Any]]:
    module: dict[str, Any] = model["module"] if isinstance(model.get("module"), dict) else {}
    out: list[dict[str, Any]] = []
    for name in model.get("buffer_names") or []:
        record = module.get(name)
        if isinstance(record, TensorRecord):
            out.append({"name": str(name), "dtype": record.dtype, "shape": list(record.shape)})
        else:
            out.append({"name": str(name), "dtype": None, "shape": None})
    return out


def _group_padding(state: dict[str, Any], group: int) -> int:
    """The padding a ZeRO-1/2 rank dropped from its saved partition of ``group``."""
    paddings = state.get("group_paddings")
    if isinstance(paddings, list) and group < len(paddings) and isinstance(paddings[group], int):
        return int(paddings[group])
    return 0


def _flat_groups(state: dict[str, Any]) -> list[TensorRecord] | None:
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
        value = state.get(key)
        if isinstance(value, list) and all(isinstance(v, TensorRecord) for v in value):
            return value
    return None


def _partition_sizes(
    stage: Any,
    optim: dict[int, dict[str, Any]],
    params: list[dict[str, Any]],
    names: dict[int, str],
    dp_world: Any,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per rank and group: the flat fp32 partition's elements, against what the parameters
    need. ZeRO-1/2: the ranks' partitions of a group are equal, and together hold the group's
    parameters plus the padding the files record (``group_paddings``, the last rank's, and
    ``param_alignment_paddings``). ZeRO-3: each rank holds ``ceil(numel / world)`` elements of
    every trained parameter of the group."""
    if stage not in (1, 2, 3) or not optim:
        return [], []
    problems: list[str] = []
    out: list[dict[str, Any]] = []
    by_group: dict[int, int] = {}
    for entry in params:
        if entry["kind"] == "trained" and entry["group"] is not None:
            by_group[entry["group"]] = by_group.get(entry["group"], 0) + entry["numel"]
    flats = {rank: _flat_groups(state) for rank, state in optim.items()}
    for rank, groups in flats.items():
        if groups is None:
            problems.append(f"{names.get(rank, rank)}: no flat fp32 partition of the parameters")
            continue
        paddings = optim[rank].get("group_paddings")
        for index, record in enumerate(groups):
            padding = paddings[index] if isinstance(paddings, list) and index < len(paddings) else 0
            out.append({"rank": rank, "group": index, "numel": record.numel, "dtype": record.dtype,
                        "padding": padding})  # fmt: skip
    if problems or not isinstance(dp_world, int) or len(flats) != dp_world:
        return out, problems  # counts are reported as missing files; sizes need every rank
    group_count = {len(groups or []) for groups in flats.values()}
    if len(group_count) != 1 or group_count != {len(by_group) or next(iter(group_count))}:
        problems.append(
            f"{names.get(min(flats), '?')}: {sorted(group_count)} flat groups, param_shapes has "
            f"{len(by_group)}"
        )
        return out, problems
    for group, needed in sorted(by_group.items()):
        held = {rank: groups[group].numel for rank, groups in flats.items() if groups}
        if stage == 3:
            per_rank = sum(
                math.ceil(p["numel"] / dp_world)
                for p in params
                if p["kind"] == "trained" and p["group"] == group
            )
            for rank, numel in held.items():
                if numel != per_rank:
                    problems.append(
                        f"{names.get(rank, rank)}: group {group} holds {numel} elements, its "
                        f"parameters' partitions need {per_rank} (ceil(numel / {dp_world}) each)"
                    )
            continue
        paddings = {rank: _group_padding(optim[rank], group) for rank in held}
        padded = {rank: numel + paddings[rank] for rank, numel in held.items()}
        if len(set(padded.values())) != 1:
            problems.append(
                f"group {group}: the ranks' partitions plus their group_paddings differ in size "
                f"({padded}); ZeRO-1/2 partitions are equal"
            )
            continue
        # the padding between parameters is the whole group's layout: every rank records it
        alignment = optim[min(optim)].get("param_alignment_paddings")
        between = alignment[group] if isinstance(alignment, list) and group < len(alignment) else []
        needed += sum(p for p in between if isinstance(p, int)) if isinstance(between, list) else 0
        total = sum(held.values())
        # zero_to_fp32's own rule: equal once both are rounded up to 2 * world size
        align = 2 * dp_world
        if math.ceil(total / align) != math.ceil(needed / align):
            problems.append(
                f"group {group}: the {len(held)} partitions hold {total} elements, the group's "
                f"parameters need {needed}"
            )
    return out, problems


def placeholders(root: dict[str, Any], path: str) -> Placeholders | None:
    """The 0-element placeholders of one ZeRO-3 ``model_states.pt`` read alone: each entry of
    its ``module`` that holds no element where ``param_shapes`` (or ``frozen_param_shapes``, or
    its owner's, for a ``shared_params`` alias or a tensor viewing the owner's storage) records
    a real shape."""
    module = root.get("module")
    if not isinstance(module, dict):
        return None
    real: dict[str, tuple[int, ...]] = {}
    groups = root.get("param_shapes")
    for group in groups if isinstance(groups, list) else ():
        real.update({str(k): shape for k, v in _items(group) if (shape := _shape(v))})
    real.update({str(k): shape for k, v in _items(root.get("frozen_param_shapes")) if (shape := _shape(v))})  # fmt: skip
    for alias, owner in _items(root.get("shared_params")):
        if owner in real:
            real[str(alias)] = real[owner]
    empty = {
        str(name): record
        for name, record in module.items()
        if isinstance(record, TensorRecord) and record.numel == 0 and record.storage is not None
    }
    # a tied parameter is the placeholder of its owner's storage (rank 0 alone records it in
    # shared_params)
    owners = {(r.storage, r.storage_offset): n for n, r in empty.items() if n in real}
    for name, record in empty.items():
        owner = owners.get((record.storage, record.storage_offset))
        if name not in real and owner is not None:
            real[name] = real[owner]
    shapes = {
        f"module.{name}": real[name] for name in empty if name in real and _numel(real[name]) > 0
    }
    if not shapes:
        return None
    folder = os.path.dirname(path) or "."
    siblings = is_dir(folder) and any(OPTIM_STATES_FILE.match(name) for name in list_names(folder))
    where = (
        f"their values are partitioned over the ranks' optimizer states beside it: read its "
        f"folder instead (ckpttool convert {folder} OUT; ckpttool show {folder})"
        if siblings
        else "their values are partitioned over the ranks' *_optim_states.pt files of its "
        "tag folder, which are not beside it"
    )
    return Placeholders(shapes, "a DeepSpeed ZeRO-3 rank's model states", where)


def _items(node: Any) -> list[tuple[Any, Any]]:
    return list(node.items()) if isinstance(node, dict) else []
