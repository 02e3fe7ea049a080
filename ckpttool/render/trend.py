"""Rendering a :class:`~ckpttool.commands.trend.TrendReport`: the text report and the JSON
document (docs/schemas/trend.schema.json, explained in docs/trend.md; change it only by adding
keys)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ckpttool.commands.trend import (
    JUMP_FACTOR,
    JUMP_HISTORY,
    GroupTrend,
    TensorTrend,
    TrendPoint,
    TrendReport,
)
from ckpttool.render.text import plural, table

SCHEMA_VERSION = 1
#: Eighths of a cell's height, for a sparkline of updates (lowest to highest).
SPARKS = "▁▂▃▄▅▆▇█"
HEADERS = ["module", "tensors", "norm first", "norm last", "median rel update", "max rel update", "updates"]  # fmt: skip


def point_label(point: TrendPoint) -> str:
    """``step 40 (checkpoint-40)``, or the name alone when it has no step."""
    if point.step is None:
        return point.name
    epoch = f"epoch {point.epoch} " if point.epoch is not None else ""
    return f"{epoch}step {point.step} ({point.name})"


def sparkline(values: list[float | None], nonfinite: list[int] | None = None) -> str:
    """One character per update, its height relative to the largest (" ": none, "!": not
    finite, or a NaN/Inf in the checkpoint: ``nonfinite`` counts per update)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    out = []
    for index, value in enumerate(values):
        if nonfinite is not None and nonfinite[index]:
            out.append("!")
        elif value is None:
            out.append(" ")
        elif not math.isfinite(value):
            out.append("!")
        elif top <= 0 or value <= 0:
            out.append(SPARKS[0] if value == 0 else SPARKS[1])
        else:
            out.append(SPARKS[min(7, int(value / top * 7.999))])
    return "".join(out)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _row(name: str, tensors: int, norms: list[float | None], relative: list[float | None], nonfinite: list[int]) -> list[str]:  # fmt: skip
    measured = [(value, index) for index, value in enumerate(relative) if value is not None]
    finite = [value for value, _ in measured if math.isfinite(value)]
    largest = f"{_number(max(measured)[0])} at #{max(measured)[1]}" if measured else "-"
    return [
        name,
        str(tensors),
        _number(norms[0]),
        _number(norms[-1]),
        _number(statistics.median(finite)) if finite else "-",
        largest,
        sparkline(relative[1:], nonfinite[1:]),
    ]


def render_text(report: TrendReport, *, by_tensor: bool = False) -> str:
    """The checkpoints in order, a row per module group (``by_tensor``: per tensor) with its
    norm and its relative updates (a sparkline, one mark per checkpoint after the first), then
    the findings: the first NaN/Inf, what never changed, the jumps."""
    order = {"step": "by step", "name": "by the numbers in their names", "given": "as given"}
    lines = [
        f"{len(report.checkpoints)} {plural(len(report.checkpoints), 'checkpoint')}, ordered {order[report.order]}:"
    ]
    lines += [f"  #{i}: {point_label(p)}" for i, p in enumerate(report.checkpoints)]
    lines.append("")
    rows: list[list[str]]
    if by_tensor:
        rows = [
            _row(t.key, 1, t.norms, t.relative_updates, [(n or 0) + (f or 0) for n, f in zip(t.nan, t.inf)])
            for t in report.tensors
        ]  # fmt: skip
        headers = ["tensor", *HEADERS[1:]]
    else:
        rows = [
            _row(g.group, g.tensors, g.norms, g.relative_updates, g.nonfinite)
            for g in report.groups
        ]
        headers = HEADERS
    if rows:
        lines.append(table(rows, headers))
        lines.append("")
    lines.extend(findings(report))
    return "\n".join(lines)


def findings(report: TrendReport) -> list[str]:
    points = report.checkpoints
    out = []
    if report.first_nonfinite is None:
        out.append("no NaN or Inf in any checkpoint")
    else:
        index = report.first_nonfinite
        tensors = {t.key: t for t in report.tensors}
        which = ", ".join(
            f"{key} ({_counts(tensors[key], index)})" for key in report.nonfinite_tensors
        )
        out.append(f"first NaN/Inf: #{index}, {point_label(points[index])}: {which}")
    if len(points) > 1:
        if report.never_changed:
            out.append(
                f"never changed: {len(report.never_changed)} "
                f"{plural(len(report.never_changed), 'tensor')}: " + ", ".join(report.never_changed)
            )
            if report.frozen_modules:
                out.append("  modules never changed: " + ", ".join(report.frozen_modules))
        else:
            out.append("never changed: none (every tensor moved at least once)")
        rule = f"> {JUMP_FACTOR:g}x the median of the {JUMP_HISTORY}+ previous relative updates"
        if report.jumps:
            out.append(f"update jumps ({rule}):")
            out.extend(
                f"  #{j.checkpoint}, {point_label(points[j.checkpoint])}: {j.group} "
                f"{j.relative_update:.4g} (median before {j.median_before:.4g})"
                for j in report.jumps
            )
        else:
            out.append(f"update jumps ({rule}): none")
    return out


def _counts(item: TensorTrend, index: int) -> str:
    parts = []
    if item.nan[index]:
        parts.append(f"{item.nan[index]} NaN")
    if item.inf[index]:
        parts.append(f"{item.inf[index]} Inf")
    return ", ".join(parts)


def _json_number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _series(values: list[float | None]) -> list[float | str | None]:
    return [_json_number(v) for v in values]


def group_json(group: GroupTrend) -> dict[str, Any]:
    return {
        "group": group.group,
        "tensors": group.tensors,
        "norms": _series(group.norms),
        "updates": _series(group.updates),
        "relative_updates": _series(group.relative_updates),
        "nonfinite": group.nonfinite,
    }


def tensor_json(item: TensorTrend) -> dict[str, Any]:
    return {
        "key": item.key,
        "group": item.group,
        "norms": _series(item.norms),
        "updates": _series(item.updates),
        "relative_updates": _series(item.relative_updates),
        "nan": item.nan,
        "inf": item.inf,
    }


def render_json(report: TrendReport) -> dict[str, Any]:
    """``trend --json``: docs/schemas/trend.schema.json."""
    first = None
    if report.first_nonfinite is not None:
        point = report.checkpoints[report.first_nonfinite]
        first = {
            "checkpoint": report.first_nonfinite,
            "step": point.step,
            "name": point.name,
            "tensors": report.nonfinite_tensors,
        }
    return {
        "schema": SCHEMA_VERSION,
        "order": report.order,
        "checkpoints": [
            {"path": p.path, "name": p.name, "step": p.step, "epoch": p.epoch, "section": p.section}
            for p in report.checkpoints
        ],
        "healthy": report.healthy,
        "first_nonfinite": first,
        "never_changed": report.never_changed,
        "frozen_modules": report.frozen_modules,
        "jump_rule": {"factor": JUMP_FACTOR, "history": JUMP_HISTORY},
        "jumps": [
            {
                "checkpoint": j.checkpoint,
                "step": report.checkpoints[j.checkpoint].step,
                "group": j.group,
                "relative_update": j.relative_update,
                "median_before": j.median_before,
            }
            for j in report.jumps
        ],
        "groups": [group_json(g) for g in report.groups],
        "tensors": [tensor_json(t) for t in report.tensors],
        "notes": report.notes,
    }
