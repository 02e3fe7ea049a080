"""``verify``'s report: each path's verdict, checks and problems for people; JSON for scripts."""

from __future__ import annotations

from typing import Any

from ckpttool.commands.verify import VerifyResult


def render_text(results: list[VerifyResult]) -> str:
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


def render_json(results: list[VerifyResult]) -> dict[str, Any]:
    """``verify --json``: docs/schemas/verify.schema.json."""
    return {
        "ok": all(r.ok for r in results),
        "files": [
            {"path": r.path, "format": r.format, "ok": r.ok, "error": r.error,
             "checked": r.checked, "problems": r.problems, "leftover_temp_files": r.leftovers}
            for r in results
        ],
    }  # fmt: skip
