"""``edit``'s report: what was dropped and renamed, sizes before and after; JSON for scripts."""

from __future__ import annotations

from typing import Any

from ckpttool.commands.edit import EditReport
from ckpttool.model.dtypes import underflow_note
from ckpttool.model.edits import COUNTER_NAMES
from ckpttool.model.roles import LAYOUT_TITLES
from ckpttool.model.text import human_size

#: Text lists longer than this are cut, with a count of the rest (``--json`` lists all).
SHOWN = 20


def render_text(report: EditReport) -> str:
    title = LAYOUT_TITLES.get(report.layout, report.layout)
    lines = [f"{report.source}: {report.format}, {title}"]
    dropped = [f"  leave out: {name}" for name in report.files_dropped]
    dropped += [f"  drop: {key}" for key in report.dropped]
    renamed = [f"  rename: {old} -> {new}" for old, new in report.renamed]
    mapped = [f"  map {op}: {old} -> {new}" for op, old, new in report.mapped]
    for lines_of in (dropped, renamed, mapped):
        lines += lines_of[:SHOWN]
        if len(lines_of) > SHOWN:
            lines.append(f"  ... and {len(lines_of) - SHOWN} more (--json lists all)")
    lines += [f"  rule {rule!r}: {count} key(s)" for rule, count in report.rules]
    if report.ema:
        lines.append(f"  use EMA: {report.ema_taken} model tensor(s) from {report.ema}")
        if report.ema_missing:
            lines.append(f"  kept (not in the EMA): {', '.join(report.ema_missing[:5])}")
    if report.cast:
        lines.append(f"  cast: {len(report.cast)} tensor(s) to {report.dtype}")
    counters = sum(key.rpartition(".")[2] in COUNTER_NAMES for key in report.not_cast)
    if len(report.not_cast) > counters:
        lines.append(
            f"  not cast: {len(report.not_cast) - counters} tensor(s) of optimizer state, kept "
            "as a resumed run needs them (--cast-optimizer casts them)"
        )
    if counters:
        lines.append(f"  not cast: {counters} step counter(s)")
    if report.underflow:
        lines.append(f"  note: {underflow_note(report.dtype or '', dict(report.underflow))}")
    if report.compacted:
        lines.append(f"  compact: {len(report.compacted)} tensor(s) kept only the bytes they view")
    lines.append(
        f"  tensors: {report.tensors_before} -> {report.tensors_after}; stored: "
        f"{human_size(report.bytes_before)} -> {human_size(report.bytes_after)}"
    )
    if not report.changed:
        lines.append("  nothing to change: nothing written")
    elif report.written:
        lines.append(f"  wrote: {report.output}")
        if report.backup:
            lines.append(f"  backup: {report.backup}")
    elif report.dry_run:
        lines.append(f"  would write: {report.output}")
    return "\n".join(lines)


def render_json(report: EditReport) -> dict[str, Any]:
    """``edit --json``: docs/schemas/edit.schema.json."""
    return {
        "source": report.source,
        "output": report.output,
        "format": report.format,
        "layout": report.layout,
        "dropped": list(report.dropped),
        "files_dropped": list(report.files_dropped),
        "renamed": [{"from": old, "to": new} for old, new in report.renamed],
        "rules": [{"rule": rule, "matched": count} for rule, count in report.rules],
        "compacted": list(report.compacted),
        "cast": list(report.cast),
        "dtype": report.dtype,
        "not_cast": list(report.not_cast),
        "underflow": dict(report.underflow),
        "ema": report.ema,
        "ema_taken": report.ema_taken,
        "ema_missing": list(report.ema_missing),
        "mapped": [{"op": op, "from": old, "to": new} for op, old, new in report.mapped],
        "tensors_before": report.tensors_before,
        "tensors_after": report.tensors_after,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "changed": report.changed,
        "written": report.written,
        "backup": report.backup,
        "dry_run": report.dry_run,
    }
