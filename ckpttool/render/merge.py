"""How ``merge`` reports what it wrote: a few lines for people, one JSON object for scripts.

The JSON is docs/schemas/merge.schema.json, explained in docs/merge.md; change it only by
adding keys.
"""

from __future__ import annotations

from typing import Any

from ckpttool.commands.merge import MergeReport

SCHEMA_VERSION = 1


def render_json(report: MergeReport) -> dict[str, Any]:
    """The ``--json`` output of ``merge``: docs/schemas/merge.schema.json, docs/merge.md."""
    return {
        "schema": SCHEMA_VERSION,
        "output": str(report.output),
        "format": report.format,
        "like_input": report.like_input,
        "method": report.method,
        "lambda": report.lam,
        "density": report.density,
        "t": report.t,
        "inputs": [{"path": i.path, "role": i.role, "weight": i.weight} for i in report.inputs],
        "tensors": report.tensors,
        "merged": report.merged,
        "ints": report.ints,
        "dtype": report.dtype,
        "verified": report.verified,
        "notes": report.notes,
    }


def render_text(report: MergeReport) -> str:
    """``wrote OUT (...)`` and one line per input with its role and weight."""
    params = {
        "linear": "",
        "task-arithmetic": f", lambda {report.lam}",
        "ties": f", density {report.density}, lambda {report.lam}",
        "slerp": f", t {report.t}",
    }[report.method]
    verified = "verified" if report.verified else "not verified"
    like = "the base's layout, " if report.like_input else ""
    lines = [
        f"wrote {report.output} ({like}{report.format}, {report.method}{params}, "
        f"{report.tensors} tensors, {verified})"
    ]
    for item in report.inputs:
        weight = f"{item.weight:.6g}" if item.weight is not None else "-"
        lines.append(f"  {item.role:<5}  {weight:>8}  {item.path}")
    if report.ints:
        lines.append(f"integer/bool tensors taken as they are: {len(report.ints)}")
    return "\n".join(lines)
