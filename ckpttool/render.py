"""Rendering: human tables (tabulate), stable JSON, the tree view. No library logic here."""

from __future__ import annotations

import json
import math
from typing import Any

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
        f"layout:     {report.layout_title}",
        f"tensors:    {len(report.tensors)}  ({human_count(report.num_parameters)} parameters)",
        "bytes:      "
        + ", ".join(f"{d} {human_size(n)}" for d, n in report.bytes_by_dtype.items()),
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
    lines.append("")
    rows = []
    for info in report.tensors:
        record = info.record
        row = [record.key, record.dtype, list(record.shape), record.numel,
               human_size(record.nbytes), "; ".join(info.notes) or None]  # fmt: skip
        if info.stats is not None:
            s = info.stats
            row[5:5] = [_num(s.min), _num(s.max), _num(s.mean), _num(s.std), s.nan, s.inf]
        rows.append(row)
    headers = ["key", "dtype", "shape", "numel", "size", "notes"]
    if any(info.stats is not None for info in report.tensors):
        headers[5:5] = ["min", "max", "mean", "std", "nan", "inf"]
    # tabulate prints None as an empty cell, and types it without trying int() and float()
    # on it as it does on "": most rows have no notes.
    from tabulate import tabulate  # here: --json and --tree print no table

    lines.append(tabulate(rows, headers=headers, disable_numparse=True))
    return "\n".join(lines)


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
    lines: list[str] = []

    def describe(node: Any) -> str:
        if isinstance(node, TensorRecord):
            return f"{node.kind} {node.dtype}{list(node.shape)}"
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
        if isinstance(node, (dict, list, tuple, OpaqueObject)):
            items = list(children(node))
            if len(items) > 64 and all(not isinstance(v, (dict, list)) for _, v in items):
                lines.append("  " * (level + 1) + f"... {len(items)} items")
                continue
            stack.extend((level + 1, n, c) for n, c in reversed(items))
    return "\n".join(lines)
