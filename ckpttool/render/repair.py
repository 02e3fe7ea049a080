"""``repair``'s report: what was damaged, recovered, lost and changed, for people; JSON for
scripts."""

from __future__ import annotations

from typing import Any

from ckpttool.commands.repair_report import RepairReport
from ckpttool.model.text import human_size

#: Text lists longer than this are cut, with a count of the rest (``--json`` lists all).
SHOWN = 20


def render_text(report: RepairReport) -> str:
    """The verdict line, then the damage (what no action mends marked ``(stays)``), each lost /
    left out / filled tensor, a run directory's checkpoints, and what was (or, with
    ``dry_run``, would be) written or changed."""
    kind = report.format
    if not report.damaged:
        return f"{report.source}: INTACT ({kind}): nothing to repair"
    lines = [f"{report.source}: DAMAGED ({kind})"]
    stays = set(report.unrepaired)
    mark = " (would stay)" if report.dry_run else " (stays)"
    lines += [f"  damage{mark * (line in stays)}: {line}" for line in report.damage]
    for state in report.checkpoints:
        verdict = "complete" if state.complete else "INCOMPLETE: " + "; ".join(state.missing)
        lines.append(f"  checkpoint: {state.path}: {verdict}")
    if report.checkpoints:
        lines.append(f"  newest complete: {report.newest_complete or 'none'}")
    lines += _cut(
        [
            f"  lost: {t.key} ({t.dtype} {list(t.shape)}, {human_size(t.nbytes)})"
            + (f": {t.reason}" if t.reason else "")
            for t in report.lost
        ]
    )
    lines += _cut([f"  left out with a lost tensor: {key}" for key in report.dropped])
    lines += _cut([f"  filled: {t.key} (from {t.source})" for t in report.filled])
    if report.kind == "file":
        lines.append(f"  recovered: {report.recovered} tensor(s)")
    will = "would " if report.dry_run else ""
    for action in report.actions:
        detail = f": {action.detail}" if action.detail else ""
        lines.append(f"  {will}{action.action}: {action.path}{detail}")
    if report.output is not None and report.kind == "file":
        if report.written:
            lines.append(f"  wrote: {report.output}")
        elif report.dry_run:
            lines.append(f"  would write: {report.output}")
    return "\n".join(lines)


def _cut(lines: list[str]) -> list[str]:
    if len(lines) <= SHOWN:
        return lines
    return [*lines[:SHOWN], f"  ... and {len(lines) - SHOWN} more (--json lists all)"]


def render_json(report: RepairReport) -> dict[str, Any]:
    """``repair --json``: docs/schemas/repair.schema.json."""
    directory = report.kind == "directory"
    return {
        "source": report.source,
        "kind": report.kind,
        "format": "directory" if directory else report.format,
        "layout": report.format if directory else None,
        "damaged": report.damaged,
        "damage": list(report.damage),
        "recovered": report.recovered,
        "lost": [
            {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
             "reason": t.reason or None}
            for t in report.lost
        ],
        "dropped": list(report.dropped),
        "filled": [{"key": t.key, "source": t.source} for t in report.filled],
        "checkpoints": [
            {"path": s.path, "complete": s.complete, "missing": list(s.missing)}
            for s in report.checkpoints
        ],
        "newest_complete": report.newest_complete,
        "actions": [
            {"action": a.action, "path": a.path, "detail": a.detail} for a in report.actions
        ],
        "output": report.output,
        "written": report.written,
        "dry_run": report.dry_run,
        "unrepaired": list(report.unrepaired),
    }  # fmt: skip
