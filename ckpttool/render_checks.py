"""Rendering of ``verify`` and ``scan`` results (human text and JSON)."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from ckpttool.pickle.policy import Verdict
from ckpttool.scan import ScanReport
from ckpttool.verify import VerifyResult


def verify_lines(results: list[VerifyResult]) -> str:
    """The report of every path that could be checked, then a count when there were several.

    A path that could not be checked is here only for the temp files found beside it: the CLI
    prints why it could not be checked on stderr.
    """
    lines = []
    for result in results:
        if result.error is not None:
            if result.leftovers:
                lines.append(f"{result.path}: NOT CHECKED")
        else:
            status = "OK" if result.ok else "PROBLEMS"
            lines.append(f"{result.path}: {status} ({result.format or 'unreadable'})")
        lines.extend(f"  checked: {what}" for what in result.checked)
        lines.extend(f"  problem: {problem}" for problem in result.problems)
        lines.extend(
            f"  leftover: {tmp} (a temp file of an interrupted save; the checkpoint itself "
            "was not replaced by it — delete it once you have checked)"
            for tmp in result.leftovers
        )
    if len(results) > 1:
        clean = sum(r.ok for r in results)
        unchecked = sum(r.error is not None for r in results)
        lines.append(
            f"{len(results)} paths: {clean} OK, {len(results) - clean - unchecked} with "
            f"problems, {unchecked} could not be checked"
        )
    return "\n".join(lines)


def verify_json(results: list[VerifyResult]) -> dict[str, Any]:
    return {
        "ok": all(r.ok for r in results),
        "files": [
            {"path": r.path, "format": r.format, "ok": r.ok, "error": r.error,
             "checked": r.checked, "problems": r.problems, "leftover_temp_files": r.leftovers}
            for r in results
        ],
    }  # fmt: skip


def scan_lines(report: ScanReport) -> str:
    rows: list[list[object]] = []
    for scanned in report.files:
        if scanned.error is not None:
            rows.append([scanned.path, "-", "could not scan", scanned.error])
        for use in scanned.globals:
            if use.verdict is not Verdict.SAFE:
                rows.append([scanned.path, use.qualname, use.verdict, use.count])
        rows.extend([scanned.path, "-", Verdict.DANGEROUS, note] for note in scanned.notes)
    rows.extend(
        [directory, "-", "no checkpoint found", "no file in it is a checkpoint"]
        for directory in report.empty
    )
    flagged = sum(len(f.flagged) + len(f.notes) for f in report.files)
    summary = f"{len(report.files)} files scanned, {flagged} findings" + (
        f", {len(report.skipped)} non-checkpoint files skipped" if report.skipped else ""
    )
    if not rows:
        verdict = "clean: only safe data constructs referenced" if report.files else (
            "no checkpoint found: nothing was scanned"
        )  # fmt: skip
        return f"{verdict}\n{summary}"
    table = tabulate(rows, headers=["file", "global", "verdict", "count / detail"],
                     disable_numparse=True)  # fmt: skip
    return f"{table}\n{summary}"


def scan_json(report: ScanReport) -> dict[str, Any]:
    return {
        "clean": report.clean,
        "skipped": report.skipped,
        "no_checkpoint_found": report.empty,
        "files": [
            {"path": f.path, "format": f.format, "error": f.error, "notes": f.notes,
             "globals": [{"name": g.qualname, "verdict": g.verdict, "count": g.count}
                         for g in f.globals]}
            for f in report.files
        ],
    }  # fmt: skip
