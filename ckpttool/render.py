"""Rendering: human tables (tabulate), stable JSON, the tree view. No library logic here."""

from __future__ import annotations

import json
import math
from typing import Any

from ckpttool.layout import NESTED
from ckpttool.records import ChunkedStorageRecord, GlobalRef, OpaqueObject, TensorRecord, children
from ckpttool.show import ShowReport

_UNITS = ("B", "KB", "MB", "GB", "TB")


def human_size(n: int | float) -> str:
    size = float(n)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"  # pragma: no cover


def human_count(n: int) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= threshold:
            return f"{n / threshold:.2f}{suffix}"
    return str(n)


def plain(value: Any) -> Any:
    """A JSON-safe rendering of any tree value (tensors as short descriptions)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, TensorRecord):
        return f"<tensor {value.dtype}{list(value.shape)}>"
    if isinstance(value, GlobalRef):
        return str(value)
    if isinstance(value, OpaqueObject):
        return {"__class__": value.cls, **{k: plain(v) for k, v in value.fields().items()}}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return str(value)


def short(value: Any, width: int = 60) -> str:
    text = json.dumps(plain(value)) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def tensor_json(info: Any) -> dict[str, Any]:
    record: TensorRecord = info.record
    out: dict[str, Any] = {
        "key": record.key,
        "dtype": record.dtype,
        "shape": list(record.shape),
        "numel": record.numel,
        "nbytes": record.nbytes,
        "stride": list(record.stride),
        "storage_offset": record.storage_offset,
        "storage": record.storage.key if record.storage else None,
        "location": record.location,
        "kind": record.kind,
        "notes": info.notes,
    }
    if isinstance(record.storage, ChunkedStorageRecord):  # DCP: where each piece is stored
        out["chunks"] = [
            {"file": c.file, "offsets": list(c.offsets), "sizes": list(c.sizes)}
            for c in record.storage.chunks
        ]
    if info.stats is not None:
        out["stats"] = {k: plain(v) for k, v in vars(info.stats).items()}
    elif info.stats_unavailable is not None:
        out["stats"] = None
        out["stats_unavailable"] = info.stats_unavailable
    return out


def show_json(report: ShowReport) -> dict[str, Any]:
    optimizer = None
    if report.optimizer is not None:
        optimizer = plain(vars(report.optimizer))
    return {
        "file": report.path,
        "format": report.format,
        "size": report.file_size,
        "layout": report.layout,
        "details": plain(report.details),
        "fields": {k: plain(v) for k, v in report.fields.items()},
        "num_tensors": len(report.tensors),
        "num_parameters": report.num_parameters,
        "bytes_by_dtype": report.bytes_by_dtype,
        "num_bytes": report.num_bytes,
        "total_tensors": report.total_tensors,
        "selection": (
            {"section": report.section, "filter": report.pattern} if report.is_selection else None
        ),
        "model_part": report.model_part,
        "optimizer_part": report.optimizer_part,
        "shared_storage": report.shared,
        "optimizer": optimizer,
        "rng": report.rng,
        "warnings": report.warnings,
        "tensors": [tensor_json(info) for info in report.tensors],
    }


def render_show(report: ShowReport) -> str:
    lines = [
        f"file:       {report.path}",
        f"format:     {report.format}  ({human_size(report.file_size)} on disk)",
        *_data_files_line(report.details),
        f"layout:     {report.layout_title}{_parts_note(report)}",
        *_count_lines(report),
    ]
    top = {k: v for k, v in report.fields.items() if "." not in k}
    for key, value in top.items():
        lines.append(f"{key + ':':<11} {short(value)}")
    scaler = {k: v for k, v in report.fields.items() if k.startswith("scaler.")}
    if scaler:
        lines.append("scaler:     " + ", ".join(f"{k[7:]}={v}" for k, v in scaler.items()))
    history = _rescale_history(report.fields)
    if history:
        lines.append(f"rescaled_from: {history}")
    if report.rng:
        lines.append("rng:        " + ", ".join(report.rng))
    if report.optimizer is not None:
        lines.extend(_optimizer_lines(report))
    if not report.tensors:
        return "\n".join(lines)
    lines.append("")
    rows = []
    for info in report.tensors:
        record = info.record
        row = [record.key, record.dtype, list(record.shape), record.numel,
               human_size(record.nbytes), "; ".join(info.notes) or None]  # fmt: skip
        if info.stats is not None:
            s = info.stats
            row[5:5] = [_num(s.min), _num(s.max), _num(s.mean), _num(s.std), s.nan, s.inf]
        elif info.stats_unavailable is not None:
            row[5:5] = ["n/a", None, None, None, None, None]
            row[-1] = "; ".join([*info.notes, f"no stats: {info.stats_unavailable}"])
        rows.append(row)
    headers = ["key", "dtype", "shape", "numel", "size", "notes"]
    if any(info.stats is not None or info.stats_unavailable for info in report.tensors):
        headers[5:5] = ["min", "max", "mean", "std", "nan", "inf"]
    # tabulate prints None as an empty cell, and types it without trying int() and float()
    # on it as it does on "": most rows have no notes.
    from tabulate import tabulate  # here: --json and --tree print no table

    lines.append(tabulate(rows, headers=headers, disable_numparse=True))
    return "\n".join(lines)


def _parts_note(report: ShowReport) -> str:
    """Where a nested dict keeps its model and optimizer, when found by their key names."""
    if report.layout != NESTED:
        return ""
    parts = [f"{name} in {key!r}"
             for name, key in (("model", report.model_part), ("optimizer", report.optimizer_part))
             if key]  # fmt: skip
    return f" ({', '.join(parts)})" if parts else ""


def _count_lines(report: ShowReport) -> list[str]:
    """The ``tensors:``, ``bytes:`` and ``tied:`` lines: what the selected tensors hold."""
    if report.total_tensors == 0:
        return ["tensors:    none (this checkpoint holds no tensors)"]
    where = ", ".join(
        f"{name} {value!r}"
        for name, value in (("section", report.section), ("filter", report.pattern))
        if value
    )
    if not report.tensors:
        return [f"tensors:    0 of {report.total_tensors}  ({where} matched no tensor)"]
    count = (
        f"{len(report.tensors)} of {report.total_tensors}" if where else str(len(report.tensors))
    )
    extras = [where] if where else []
    if report.num_parameters is not None:
        extras.append(f"{human_count(report.num_parameters)} parameters")
    lines = [
        f"tensors:    {count}" + (f"  ({'; '.join(extras)})" if extras else ""),
        "bytes:      "
        + ", ".join(f"{d} {human_size(n)}" for d, n in report.bytes_by_dtype.items()),
    ]
    if report.shared:
        keys = sum(len(group) for group in report.shared)
        first = report.shared[0]
        example = ", ".join(first[:2]) + (f" +{len(first) - 2}" if len(first) > 2 else "")
        more = f"; {len(report.shared) - 1} more" if len(report.shared) > 1 else ""
        storages = f"{len(report.shared)} storage{'s' if len(report.shared) > 1 else ''}"
        lines.append(
            f"tied:       {storages} shared by {keys} keys, counted once ({example}{more})"
        )
    return lines


def _data_files_line(details: dict[str, Any]) -> list[str]:
    """A directory checkpoint's data files (DCP: one per rank), missing ones marked."""
    files = details.get("files")
    if not isinstance(files, dict):
        return []
    sizes = [f"{name} {human_size(size) if size is not None else 'MISSING'}"
             for name, size in files.items()]  # fmt: skip
    chunks = details.get("tensor_chunks")
    return [f"files:      {', '.join(sizes)}" + (f"  ({chunks} tensor chunks)" if chunks else "")]


def _rescale_history(fields: dict[str, Any]) -> str:
    """``rescale-step``'s history (``rescaled_from.N.<key>`` fields) as one line, oldest first."""
    entries: dict[str, dict[str, Any]] = {}
    for key, value in fields.items():
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "rescaled_from":
            entries.setdefault(parts[1], {})[parts[2]] = value
    return "; ".join(
        ", ".join(f"{name} {value}" for name, value in entries[index].items())
        for index in sorted(entries, key=lambda index: (len(index), index))  # "10" after "9"
    )


def _optimizer_lines(report: ShowReport) -> list[str]:
    opt = report.optimizer
    assert opt is not None
    dtypes = ", ".join(f"{d} {human_size(n)}" for d, n in opt.state_dtypes.items())
    lines = [
        f"optimizer:  {opt.type_guess}, state for {opt.params_with_state} params ({dtypes})",
    ]
    for index, group in enumerate(opt.param_groups):
        hyper = ", ".join(f"{k}={short(v, 24)}" for k, v in group.items() if v is not None)
        lines.append(f"  group {index}: {hyper}")
    if opt.param_names:
        lines.append(f"  state entries map to model parameters by order ({len(opt.param_names)})")
    return lines


def _num(value: float) -> str:
    return f"{value:.4g}"


def render_tree(root: Any, depth: int | None = None) -> str:
    """The nesting of the object tree. A flat state dict is shown as its module hierarchy
    (from its dotted keys), identical numbered blocks once; ``depth`` limits the levels shown.
    Only runs of more than 64 plain values (RNG states, id lists) are elided."""
    from ckpttool.show_tree import ModuleNode, is_flat_state_dict, module_tree

    lines: list[str] = []

    def describe(node: Any) -> str:
        if isinstance(node, TensorRecord):
            return f"{node.kind} {node.dtype}{list(node.shape)}"
        if isinstance(node, ModuleNode):
            return _describe_module(node)
        if isinstance(node, OpaqueObject):
            return f"<{node.cls}>"
        if isinstance(node, (dict, list, tuple)):
            return f"{type(node).__name__}[{len(node)}]"
        return short(node)

    stack: list[tuple[int, str, Any]] = [(0, "", root)]
    while stack:
        level, name, node = stack.pop()
        label = f"{name}: " if name else ""
        lines.append("  " * level + label + describe(node))
        if depth is not None and level >= depth:
            continue
        if isinstance(node, ModuleNode):
            stack.extend((level + 1, c.name, c) for c in reversed(node.children))
        elif is_flat_state_dict(node):
            stack.extend((level + 1, c.name, c) for c in reversed(module_tree(node)))
        elif isinstance(node, (dict, list, tuple, OpaqueObject)):
            items = list(children(node))
            if len(items) > 64 and not any(
                isinstance(v, (dict, list, tuple, OpaqueObject, TensorRecord)) for _, v in items
            ):
                lines.append("  " * (level + 1) + f"... {len(items)} items")
                continue
            stack.extend((level + 1, n, c) for n, c in reversed(items))
    return "\n".join(lines)


def _describe_module(node: Any) -> str:
    """``attn: 4 tensors, 256 params, 1.0 KB``; a run of identical blocks says how many."""
    if node.tensor is not None:
        tensor = f"{node.tensor.kind} {node.tensor.dtype}{list(node.tensor.shape)}"
        return tensor if node.repeats == 1 else f"{node.repeats} × {tensor}"
    plural = "s" if node.num_tensors != 1 else ""
    one = (
        f"{node.num_tensors} tensor{plural}, {human_count(node.parameters)} params, "
        f"{human_size(node.nbytes)}"
    )
    if node.repeats == 1:
        return one
    return (
        f"{node.repeats} identical blocks of {one} each "
        f"({human_count(node.parameters * node.repeats)} params, "
        f"{human_size(node.nbytes * node.repeats)} in all)"
    )
