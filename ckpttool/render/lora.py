"""``lora merge``'s and ``lora extract``'s reports: what was written, which tensors changed and
how much of each difference a rank keeps, for people; JSON for scripts
(docs/schemas/lora-merge.schema.json, docs/schemas/lora-extract.schema.json)."""

from __future__ import annotations

from typing import Any

from ckpttool.commands.lora.extract import ExtractReport
from ckpttool.commands.lora.merge import MergeReport

#: Text lists longer than this are cut, with a count of the rest (``--json`` lists all).
SHOWN = 20


def render_json(report: MergeReport) -> dict[str, Any]:
    """The ``--json`` output of ``lora merge``: docs/schemas/lora-merge.schema.json, docs/lora.md."""
    return {
        "base": report.base,
        "adapter": report.adapter,
        "output": str(report.output),
        "outputs": [str(path) for path in report.outputs],
        "format": report.format,
        "layout": report.layout,
        "directory": report.directory,
        "tensors": report.tensors,
        "merged": [
            {
                "name": m.name,
                "module": m.module,
                "how": m.how,
                "rank": m.rank,
                "scaling": m.scaling,
                "dtype": m.dtype,
            }
            for m in report.merged
        ],
        "copied": report.copied,
        "verified": report.verified,
        "notes": report.notes,
    }


def render_text(report: MergeReport) -> str:
    """``merged ADAPTER into BASE: wrote OUT (...)`` and one line per changed tensor."""
    what = "model directory" if report.directory else report.format
    verified = "verified by reading it back" if report.verified else "NOT verified (--no-verify)"
    lines = [
        f"merged {report.adapter} into {report.base}: wrote {what} {report.output} "
        f"({report.tensors} tensors, {len(report.merged)} changed; {verified})"
    ]
    for m in report.merged[:SHOWN]:
        scale = f", r {m.rank}, scaling {m.scaling:g}" if m.scaling is not None else ""
        lines.append(f"  {m.how}: {m.name} ({m.dtype}{scale})")
    if len(report.merged) > SHOWN:
        lines.append(f"  ... and {len(report.merged) - SHOWN} more (--json lists all)")
    if report.copied:
        lines.append(f"  copied: {', '.join(report.copied)}")
    return "\n".join(lines)


def render_extract_json(report: ExtractReport) -> dict[str, Any]:
    """The ``--json`` output of ``lora extract``: docs/schemas/lora-extract.schema.json."""
    return {
        "base": report.base,
        "tuned": report.tuned,
        "output": str(report.output),
        "rank": report.rank,
        "extracted": [
            {
                "name": e.name,
                "module": e.module,
                "shape": list(e.shape),
                "rank": e.rank,
                "energy": e.energy,
            }
            for e in report.extracted
        ],
        "modules_to_save": report.modules_to_save,
        "unchanged": report.unchanged,
        "task_type": report.task_type,
        "verified": report.verified,
        "notes": report.notes,
    }


def render_extract_text(report: ExtractReport) -> str:
    """``wrote adapter OUT (...)``, one line per factorised tensor with the energy it keeps."""
    lines = [
        f"extracted {report.tuned} - {report.base} at rank {report.rank}: wrote adapter "
        f"{report.output} ({len(report.extracted)} LoRA modules, "
        f"{len(report.modules_to_save)} saved whole, {report.unchanged} tensors unchanged)"
    ]
    for e in report.extracted[:SHOWN]:
        lines.append(
            f"  {e.name} {list(e.shape)}: rank {e.rank} keeps {e.energy:.2%} of the difference"
        )
    if len(report.extracted) > SHOWN:
        lines.append(f"  ... and {len(report.extracted) - SHOWN} more (--json lists all)")
    if report.modules_to_save:
        lines.append(f"  modules_to_save: {', '.join(report.modules_to_save)}")
    return "\n".join(lines)
