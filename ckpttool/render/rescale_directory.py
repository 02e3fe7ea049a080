"""How ``rescale-step`` reports the rewrite of a framework directory: every value changed and
what happens to every file."""

from __future__ import annotations

from typing import Any

from ckpttool.model.rescaling import DROP, DirectoryRescaleReport, RescalePlan, describe_repeats
from ckpttool.render.text import plural

__all__ = ["render_json", "render_text"]


def plan_json(
    plan: RescalePlan, batch_size: int | None, *, file_world_size: int | None, changed: bool
) -> dict[str, Any]:
    """The fields of a rescale plan that a file's and a directory's ``--json`` share."""
    return {
        "step_key": plan.step_key,
        "from": {"step": plan.old_step, "world_size": plan.from_world_size},
        "to": {"step": plan.new_step, "world_size": plan.world_size},
        "file_world_size": file_world_size,
        "changed": changed,
        "exact": plan.exact,
        "global_batches": plan.global_batches,
        "repeated_batches": plan.repeated_batches,
        "repeated_batches_per_rank": str(plan.repeated_per_rank),
        "batch_size": batch_size,
        "repeated_samples": plan.repeated_samples(batch_size) if batch_size else None,
        "max_repeated_samples_per_rank": (
            plan.max_repeated_samples_per_rank(batch_size) if batch_size else None
        ),
    }


def render_json(report: DirectoryRescaleReport) -> dict[str, Any]:
    plan = report.plan
    batch_size = report.batch_size
    return {
        "path": str(report.path),
        "output": str(report.output),
        "format": "directory",
        "layout": report.layout,
        **plan_json(
            plan,
            batch_size,
            file_world_size=None,
            changed=bool(report.changes)
            or any(a.action != "copy" or a.name != a.source for a in report.files),
        ),
        "rescaled_from": [],
        "dry_run": report.dry_run,
        "written": report.written,
        "backup": None,
        "in_place": report.in_place,
        "resume_from_checkpoint": report.resume_from_checkpoint,
        "changes": [
            {"file": change.file, "key": change.key, "old": change.old, "new": change.new}
            for change in report.changes
        ],
        "files": [
            {
                "name": action.name,
                "source": action.source,
                "action": action.action,
                "why": action.why or None,
            }
            for action in report.files
        ],
        "notes": list(report.notes),
    }


def _processes(count: int) -> str:
    return f"{count} {plural(count, 'process', 'processes')}"


def render_text(report: DirectoryRescaleReport) -> str:
    plan = report.plan
    name = plan.step_key
    lines = [
        f"{report.layout}: {name} {plan.old_step} @ {_processes(plan.from_world_size)} -> "
        f"{name} {plan.new_step} @ {_processes(plan.world_size)}"
    ]
    if plan.changed and not plan.exact:
        lines.append("not exact: " + describe_repeats(plan, report.batch_size))
    for change in report.changes:
        lines.append(f"  {change.file}: {change.key} {change.old!r} -> {change.new!r}")
    for action in report.files:
        if action.action == DROP:
            lines.append(f"  drop {action.source}: {action.why}")
        elif action.name != action.source:
            lines.append(f"  {action.source} -> {action.name}: {action.why}")
        elif action.why and action.action == "copy":
            lines.append(f"  {action.name}: {action.why}")
    lines += [f"note: {note}" for note in report.notes]
    if report.dry_run:
        lines.append("dry run: nothing was written")
    elif report.written:
        where = "in place" if report.in_place else f"from {report.path}"
        lines.append(f"wrote {report.output} ({where})")
    else:
        lines.append("nothing to do: nothing was written")
    return "\n".join(lines)
