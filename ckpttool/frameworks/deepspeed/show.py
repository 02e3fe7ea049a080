"""``show``'s lines for a DeepSpeed checkpoint: stage, ranks, counters, the real parameters."""

from __future__ import annotations

from typing import Any

from ckpttool.model.text import human_count, short


def deepspeed_lines(details: dict[str, Any]) -> list[str]:
    """The header lines from ``details["deepspeed"]`` (:func:`ckpttool.frameworks.deepspeed.files.summarize`)."""
    summary = details.get("deepspeed")
    if not isinstance(summary, dict):
        return []
    version = f", DeepSpeed {summary['ds_version']}" if summary.get("ds_version") else ""
    lines = [
        f"deepspeed:  ZeRO-{summary.get('stage')}, {summary.get('dtype')}, "
        f"{summary.get('dp_world_size')} data-parallel x {summary.get('mp_world_size')} "
        f"model-parallel rank(s){version}",
        f"tag:        {summary.get('tag')}" + _tags_note(summary),
        "counters:   "
        + ", ".join(
            f"{key} {summary.get(key)}"
            for key in ("global_steps", "global_samples", "skipped_steps")
        ),
    ]
    scheduler = summary.get("lr_scheduler")
    if isinstance(scheduler, dict) and scheduler:
        lines.append(
            "scheduler:  " + ", ".join(f"{k}={short(v, 40)}" for k, v in scheduler.items())
        )
    optimizer = summary.get("optimizer")
    if isinstance(optimizer, dict):
        lines.append(f"optimizer:  {optimizer.get('type') or 'unknown type'} (ds_config)"
                     + _scaler_note(optimizer.get("loss_scaler")))  # fmt: skip
        for index, group in enumerate(optimizer.get("param_groups") or []):
            hyper = ", ".join(f"{k}={short(v, 30)}" for k, v in group.items())
            lines.append(f"  group {index}: {hyper}")
    partitions = summary.get("partitions") or []
    if partitions:
        parts = [f"rank {p['rank']} group {p['group']}: {p['numel']} {p['dtype']}"
                 + (f" (+{p['padding']} padding)" if p.get("padding") else "")
                 for p in partitions]  # fmt: skip
        lines.append("partitions: " + "; ".join(parts))
    lines.append(_parameters_line(summary))
    return lines


def _tags_note(summary: dict[str, Any]) -> str:
    parts = []
    if summary.get("latest") is not None:
        parts.append(f"latest names {summary['latest']}")
    tags = summary.get("tags") or []
    if len(tags) > 1:
        parts.append(f"tags: {', '.join(str(t) for t in tags)}")
    return f"  ({'; '.join(parts)})" if parts else ""


def _scaler_note(scaler: Any) -> str:
    if not isinstance(scaler, dict) or "cur_scale" not in scaler:
        return ""
    kind = "dynamic" if scaler.get("dynamic") else "static"
    return f", loss scale {scaler['cur_scale']} ({kind})"


def _parameters_line(summary: dict[str, Any]) -> str:
    params = summary.get("parameters") or []
    counts: dict[str, list[int]] = {}
    for entry in params:
        slot = counts.setdefault(entry["kind"], [0, 0])
        slot[0] += 1
        slot[1] += entry["numel"] or 0 if entry["kind"] != "shared" else 0
    parts = [
        f"{n} {kind}{'s' if kind == 'parameter' and n != 1 else ''}"
        + (f" ({human_count(numel)} element{'s' * (numel != 1)})" if kind != "shared" else "")
        for kind, (n, numel) in counts.items()
    ]
    buffers = summary.get("buffers") or []
    if buffers:
        parts.append(f"{len(buffers)} buffer{'s' if len(buffers) != 1 else ''}")
    source = (
        "real shapes from param_shapes; under ZeRO-3 'module' holds 0-element placeholders"
        if summary.get("placeholders")
        else "shapes from param_shapes and module"
    )
    return f"parameters: {human_count(summary.get('num_parameters') or 0)}: {', '.join(parts)}  ({source})"


def parameter_table(details: dict[str, Any]) -> list[list[Any]]:
    """Rows of the parameter table: name, real shape, numel, what it is."""
    summary = details.get("deepspeed")
    if not isinstance(summary, dict):
        return []
    rows: list[list[Any]] = []
    for entry in summary.get("parameters") or []:
        kind = entry["kind"]
        if kind == "shared":
            what = f"shared with {entry['owner']}"
        elif kind == "trained" and entry.get("group") is not None:
            what = f"trained (group {entry['group']})"
        else:
            what = kind
        stored = entry.get("stored")
        if summary.get("placeholders") and stored and stored["shape"] != entry["shape"]:
            what += f"; stored as a {stored['shape']} placeholder"
        rows.append([entry["name"], entry["shape"], entry["numel"], what])
    for buffer in summary.get("buffers") or []:
        rows.append([buffer["name"], buffer["shape"], None, f"buffer ({buffer['dtype']})"])
    return rows
