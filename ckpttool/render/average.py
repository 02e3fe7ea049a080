"""How ``average`` reports what it wrote: a few lines for people, one JSON object for scripts.

The JSON is docs/schemas/average.schema.json, explained in docs/average.md; change it only by
adding keys.
"""

from __future__ import annotations

from typing import Any

from ckpttool.commands.average import AverageReport

SCHEMA_VERSION = 1


def render_json(report: AverageReport) -> dict[str, Any]:
    """The ``--json`` output of ``average``: docs/schemas/average.schema.json, docs/average.md."""
    return {
        "schema": SCHEMA_VERSION,
        "output": str(report.output),
        "format": report.format,
        "like_input": report.like_input,
        "layout": report.layout,
        "method": report.method,
        "decay": report.decay,
        "inputs": [
            {"path": i.path, "name": i.name, "step": i.step, "weight": i.weight}
            for i in report.inputs
        ],
        "skipped": report.skipped,
        "tensors": report.tensors,
        "averaged": report.averaged,
        "ints": report.ints,
        "dtype": report.dtype,
        "verified": report.verified,
        "notes": report.notes,
    }


def render_text(report: AverageReport) -> str:
    """``wrote OUT (...)`` and one line per input with its step and weight."""
    how = {"mean": "mean", "weighted": "weighted mean", "ema": f"EMA, decay {report.decay}"}
    like = f"{report.layout}'s layout, " if report.like_input else ""
    verified = "verified" if report.verified else "not verified"
    lines = [
        f"wrote {report.output} ({like}{report.format}, {how[report.method]} of "
        f"{len(report.inputs)} checkpoint(s), {report.tensors} tensors, {verified})"
    ]
    for item in report.inputs:
        step = f"step {item.step}" if item.step is not None else "no step"
        lines.append(f"  {item.weight:.6g}  {item.name} ({step})")
    if report.ints:
        lines.append(f"integer/bool tensors taken as they are: {len(report.ints)}")
    return "\n".join(lines)
