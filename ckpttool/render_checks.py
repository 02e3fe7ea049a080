"""Rendering of ``verify`` and ``scan`` results (human text and JSON)."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from ckpttool.scan import ScanReport
from ckpttool.verify import VerifyResult


def verify_lines(results: list[VerifyResult]) -> str:
    lines = []
    for result in results:
        status = "OK" if result.ok else "PROBLEMS"
        lines.append(f"{result.path}: {status} ({result.format or 'unreadable'})")
        lines.extend(f"  checked: {what}" for what in result.checked)
        lines.extend(f"  problem: {problem}" for problem in result.problems)
        lines.extend(
            f"  leftover: {tmp} (a temp file of an interrupted save; the checkpoint itself "
            "was not replaced by it — delete it once you have checked)"
            for tmp in result.leftovers
        )
    return "\n".join(lines)


def verify_json(results: list[VerifyResult]) -> dict[str, Any]:
    return {
        "ok": all(r.ok for r in results),
        "files": [
            {"path": r.path, "format": r.format, "ok": r.ok, "checked": r.checked,
             "problems": r.problems, "leftover_temp_files": r.leftovers}
            for r in results
        ],
    }  # fmt: skip


def scan_lines(report: ScanReport) -> str:
    rows: list[list[object]] = []
    for scanned in report.files:
        if scanned.error is not None:
            rows.append([scanned.path, "-", "could not scan", scanned.error])
        for use in scanned.globals:
            if use.verdict != "safe":
                rows.append([scanned.path, use.qualname, use.verdict, use.count])
        rows.extend([scanned.path, "-", "dangerous", note] for note in scanned.notes)
    flagged = sum(len(f.flagged) + len(f.notes) for f in report.files)
    summary = f"{len(report.files)} files scanned, {flagged} findings" + (
        f", {len(report.skipped)} non-checkpoint files skipped" if report.skipped else ""
    )
    if not rows:
        return f"clean: only safe data constructs referenced\n{summary}"
    table = tabulate(rows, headers=["file", "global", "verdict", "count / detail"],
                     disable_numparse=True)  # fmt: skip
    return f"{table}\n{summary}"


def scan_json(report: ScanReport) -> dict[str, Any]:
    return {
        "clean": report.clean,
        "skipped": report.skipped,
        "files": [
            {"path": f.path, "format": f.format, "error": f.error, "notes": f.notes,
             "globals": [{"name": g.qualname, "verdict": g.verdict, "count": g.count}
                         for g in f.globals]}
            for f in report.files
        ],
    }  # fmt: skip
