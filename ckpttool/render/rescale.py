"""How ``rescale-step`` reports what it did: one fact per line for people, JSON for scripts."""

from __future__ import annotations

from typing import Any

from ckpttool.commands.rescale.directory import DirectoryRescaleReport
from ckpttool.commands.rescale.run import (
    HISTORY_KEY,
    SCHEDULER_KEY,
    WORLD_SIZE_KEY,
    RescalePlan,
    RescaleReport,
    describe_repeats,
)
from ckpttool.render.rescale_directory import plan_json
from ckpttool.render.rescale_directory import render_json as directory_json
from ckpttool.render.rescale_directory import render_text as directory_text

__all__ = ["render_json", "render_text"]


def render_json(report: RescaleReport | DirectoryRescaleReport) -> dict[str, Any]:
    """The ``--json`` output of ``rescale-step``: docs/schemas/rescale-step.schema.json."""
    if isinstance(report, DirectoryRescaleReport):
        return directory_json(report)
    plan = report.plan
    batch_size = report.batch_size
    return {
        "path": str(report.path),
        "output": str(report.output),
        "format": report.format,
        "layout": report.layout,
        **plan_json(plan, batch_size, file_world_size=plan.file_world_size, changed=plan.changed),
        HISTORY_KEY: list(plan.history),
        "scheduler": scheduler_json(plan),
        "dry_run": report.dry_run,
        "written": report.written,
        "backup": str(report.backup) if report.backup else None,
    }


def scheduler_json(plan: RescalePlan) -> dict[str, Any] | None:
    """What happened to the file's LR scheduler: null when nothing (no scheduler, no change)."""
    if not plan.scheduler_changes and not plan.scheduler_note:
        return None
    return {
        "changes": [{"key": k, "old": old, "new": new} for k, old, new in plan.scheduler_changes],
        "note": plan.scheduler_note or None,
    }


def scheduler_lines(plan: RescalePlan) -> list[str]:
    if plan.scheduler_note:
        return [f"note: {SCHEDULER_KEY}: {plan.scheduler_note}"]
    if not plan.scheduler_changes:
        return []
    moved = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in plan.scheduler_changes)
    return [f"{SCHEDULER_KEY}: {moved} (it counts optimizer steps: scaled like {plan.step_key})"]


def render_text(report: RescaleReport | DirectoryRescaleReport) -> str:
    """The human report, one fact per line."""
    if isinstance(report, DirectoryRescaleReport):
        return directory_text(report)
    return "\n".join(_lines(report))


def _lines(report: RescaleReport) -> list[str]:
    plan = report.plan
    name = plan.step_key
    lines = [
        f"{name} {plan.old_step} @ world_size {plan.from_world_size} -> "
        f"{name} {plan.new_step} @ world_size {plan.world_size}"
    ]
    if plan.world_size_from_option:
        says = "has no world_size" if plan.file_world_size is None else (
            f"says world_size {plan.file_world_size!r}"
        )  # fmt: skip
        lines.append(f"the file {says}; the step was taken as counted on {plan.from_world_size}")
    if not plan.changed:
        lines.append("nothing to do: the file already matches; nothing was written")
        return lines
    if plan.exact:
        lines.append(
            f"exact: {plan.old_step} x {plan.from_world_size} = {plan.global_batches} global "
            f"batches = {plan.world_size} x {plan.new_step}"
        )
    else:
        lines.append(
            f"not exact: {plan.old_step} x {plan.from_world_size} = {plan.global_batches} "
            f"global batches were trained; the resumed run skips {plan.world_size} x "
            f"{plan.new_step} = {plan.new_step * plan.world_size} of them, so "
            + describe_repeats(plan, report.batch_size)
        )
    history = ", ".join(
        f"{entry.get(name, '?')} @ world_size {entry.get(WORLD_SIZE_KEY, '?')}"
        for entry in plan.history
    )
    lines.append(f"{HISTORY_KEY}: {history}")
    lines += scheduler_lines(plan)
    if report.dry_run:
        lines.append("dry run: nothing was written")
    else:
        where = "in place" if report.output == report.path else f"from {report.path}"
        lines.append(f"wrote {report.output} ({where})")
    if report.backup:
        lines.append(f"backup: {report.backup}")
    return lines
