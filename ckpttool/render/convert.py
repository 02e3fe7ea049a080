"""How ``convert`` reports what it wrote: a few lines for people, one JSON object for scripts.

Notes (entries left out, underflow) and warnings (names kept with wrapper prefixes) are not
here: the CLI prints them on stderr so that ``--json`` output stays clean.
"""

from __future__ import annotations

from typing import Any

from ckpttool.commands.convert.run import ConvertReport
from ckpttool.model.roles import LAYOUT_TITLES
from ckpttool.render.text import human_size, plural

__all__ = ["render_json", "render_text"]

_SHOWN = 4  # aliases and fields listed by name before "(+N more)"


def render_json(report: ConvertReport) -> dict[str, Any]:
    """The ``--json`` output of ``convert``: docs/schemas/convert.schema.json, docs/convert.md."""
    return {
        "source": str(report.source),
        "outputs": [str(path) for path in report.outputs],
        "format": report.format,
        "layout": report.layout,
        "section": report.section,
        "tensors": report.tensors,
        "aliases": report.aliases,
        "tensor_bytes": report.tensor_bytes,
        "file_bytes": report.file_bytes,
        "dtype": report.dtype,
        "cast": report.cast,
        "underflow": report.underflow,
        "overflow": report.overflow,
        "fields": report.fields,
        "notes": report.notes,
        "warnings": report.warnings,
        "verified": report.verified,
        "directory": None if report.directory is None else str(report.directory),
        "copied": report.copied,
    }


def render_text(report: ConvertReport) -> str:
    """``wrote DST (...)`` and one line per fact worth knowing."""
    if report.directory is not None:
        what = f"model directory {report.directory}"
    elif len(report.outputs) > 1:
        shards = len(report.outputs) - 1
        what = f"{report.outputs[-1]} and {shards} {plural(shards, 'shard')}"
    else:
        what = str(report.outputs[0])
    count = f"{report.tensors} {plural(report.tensors, 'tensor')}"
    lines = [f"wrote {what} ({report.format}, {count}, {human_size(report.file_bytes)})"]
    section = f", section {report.section!r}" if report.section else ""
    layout = LAYOUT_TITLES.get(report.layout, report.layout)
    lines.append(f"  from      {report.source} ({layout}{section})")
    if report.directory is not None:
        written = [path.name for path in report.outputs]
        copied = f"; copied: {', '.join(report.copied)}" if report.copied else ""
        lines.append(f"  files     {_some(written)}{copied}")
    if report.cast:
        casts = ", ".join(f"{kind.replace('->', ' -> ')} ({n})" for kind, n in report.cast.items())
        lines.append(f"  cast      {casts}")
    if report.overflow:
        total = sum(report.overflow.values())
        lines.append(
            f"  overflow  {total:,} {plural(total, 'value')} written as inf (--allow-overflow)"
        )
    if report.aliases:
        pairs = [f"{alias} -> {stored}" for alias, stored in report.aliases.items()]
        lines.append(f"  aliases   {_some(pairs)}; stored once")
    if report.fields:
        names = [key.removeprefix("ckpttool.field.") for key in report.fields]
        lines.append(f"  fields    {_some(names)}; kept in __metadata__")
    if report.verified:
        lines.append("  verified  every tensor read back bit for bit, sizes as expected")
    else:
        lines.append("  verified  no (--no-verify)")
    return "\n".join(lines)


def _some(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")
