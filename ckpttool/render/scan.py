"""``scan``'s report: a table of what is not safe for people (tabulate); JSON for scripts."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from ckpttool.commands.scan import ARCHIVE_NOT_SCANNED, ScanReport
from ckpttool.pickle.policy import Verdict
from ckpttool.render.text import plural


def render_text(report: ScanReport) -> str:
    """A row per finding (globals not safe, notes, unscannable paths, empty directories), then a
    count; a path with no finding is not listed."""
    rows: list[list[object]] = []
    for scanned in report.files:
        if scanned.error is not None:
            rows.append([scanned.path, "-", "could not scan", scanned.error])
        for use in scanned.globals:
            if use.verdict is not Verdict.SAFE:
                name = use.qualname
                if use.written_as is not None:
                    name += f" (written {use.written_as})"
                if use.qualname in scanned.places:
                    name += f" in {', '.join(scanned.places[use.qualname])}"
                rows.append([scanned.path, name, use.verdict, use.count])
        rows.extend([scanned.path, "-", _note_verdict(note), note] for note in scanned.notes)
    rows.extend(
        [directory, "-", "no checkpoint found", "no file in it is a checkpoint"]
        for directory in report.empty
    )
    flagged = sum(len(f.flagged) + len(f.notes) for f in report.files)
    files, skipped = len(report.files), len(report.skipped)
    summary = f"{files} {plural(files, 'file')} scanned, {flagged} {plural(flagged, 'finding')}" + (
        f", {skipped} non-checkpoint {plural(skipped, 'file')} skipped" if skipped else ""
    )
    if not rows:
        verdict = "clean: only safe data constructs referenced" if report.files else (
            "no checkpoint found: nothing was scanned"
        )  # fmt: skip
        return f"{verdict}\n{summary}"
    table = tabulate(rows, headers=["file", "global", "verdict", "count / detail"],
                     disable_numparse=True)  # fmt: skip
    return f"{table}\n{summary}"


def _note_verdict(note: str) -> str:
    """A note's verdict column: dangerous, or an archive ``scan`` could not open."""
    return ARCHIVE_NOT_SCANNED if note.startswith(ARCHIVE_NOT_SCANNED) else Verdict.DANGEROUS


def render_json(report: ScanReport) -> dict[str, Any]:
    """``scan --json``: docs/schemas/scan.schema.json."""
    return {
        "clean": report.clean,
        "skipped": report.skipped,
        "no_checkpoint_found": report.empty,
        "files": [
            {"path": f.path, "format": f.format, "error": f.error, "notes": f.notes,
             "places": f.places,
             "globals": [{"name": g.qualname, "verdict": g.verdict, "count": g.count,
                          "written_as": g.written_as} for g in f.globals]}
            for f in report.files
        ],
    }  # fmt: skip
