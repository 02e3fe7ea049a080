"""Rendering a :class:`~ckpttool.commands.diff.run.DiffReport`: the human table and the JSON document.

The JSON schema is a contract (docs/schemas/diff.schema.json, explained in docs/diff.md;
tests/test_json_schemas.py checks real output against both): change it only by adding keys.
tabulate is imported only when there is a table to print: two equal files print one line, fast
(``diff --quick``).
"""

from __future__ import annotations

import math
from typing import Any

from ckpttool.commands.diff.match import TYPE_CHANGED
from ckpttool.commands.diff.modules import ModuleChange
from ckpttool.commands.diff.run import (
    DIFFER,
    EQUAL_AFTER_ROUNDING,
    IDENTICAL,
    ONLY_A,
    ONLY_B,
    WITHIN_TOLERANCE,
    DiffReport,
    FieldDiff,
    Side,
    TensorDiff,
)
from ckpttool.commands.diff.values import ValueDiff
from ckpttool.model.records import TensorRecord
from ckpttool.render.text import human_count, plain, short, table, with_bars

SCHEMA_VERSION = 1

STATUS_TEXT = {
    IDENTICAL: "identical",
    WITHIN_TOLERANCE: "within tolerance",
    DIFFER: "differ",
    ONLY_A: "only in A",
    ONLY_B: "only in B",
    EQUAL_AFTER_ROUNDING: "equal after rounding",
}
HIDDEN = (IDENTICAL, EQUAL_AFTER_ROUNDING)  # rows listed only with --all
HEADERS = [
    "key", "status", "A", "B", "max abs diff", "max rel diff", "rel change", "cosine",
    "changed", "mismatched", "notes",
]  # fmt: skip


def field_line(entry: FieldDiff) -> str:
    """``key: A -> B``; a side without the field shows ``(absent)``; a field that is a tensor
    on one side shows each side's type (``loss: 2.5 (float) -> 2.5 (tensor float32 [])``)."""
    if entry.status == TYPE_CHANGED:
        a = _typed(entry.a, entry.a_tensor)
        b = _typed(entry.b, entry.b_tensor)
        return f"{entry.key}: {a} -> {b}"
    a = "(absent)" if entry.status == ONLY_B else short(entry.a, 40)
    b = "(absent)" if entry.status == ONLY_A else short(entry.b, 40)
    return f"{entry.key}: {a} -> {b}"


#: More fields than this that only one side holds under one top-level entry are one line
#: (``optimizer: 26 fields only in B``) unless ``--all``: a Trainer checkpoint against its
#: model directory held 213 "(absent)" lines.
ONE_SIDED_SHOWN = 3


def _field_lines(fields: list[FieldDiff], show_all: bool) -> list[str]:
    """A line per field (:func:`field_line`); without ``show_all``, the fields one side alone
    holds summed up by top-level entry and side where there are more than
    :data:`ONE_SIDED_SHOWN`, in the place of the first."""
    if show_all:
        return [field_line(entry) for entry in fields]
    groups: dict[tuple[str, str], list[FieldDiff]] = {}
    for entry in fields:
        if entry.status in (ONLY_A, ONLY_B):
            groups.setdefault((entry.key.split(".")[0], entry.status), []).append(entry)
    lines: list[str] = []
    for entry in fields:
        group = groups.get((entry.key.split(".")[0], entry.status), [])
        if len(group) <= ONE_SIDED_SHOWN or entry.status not in (ONLY_A, ONLY_B):
            lines.append(field_line(entry))
        elif entry is group[0]:
            side = "A" if entry.status == ONLY_A else "B"
            lines.append(
                f"{entry.key.split('.')[0]}: {len(group)} fields only in {side} "
                "(--all or --json lists them)"
            )
    return lines


def _typed(value: object, record: TensorRecord | None) -> str:
    if record is None:
        return f"{short(value, 40)} ({'None' if value is None else type(value).__name__})"
    kind = f"(tensor {record.dtype} {list(record.shape)})"
    if value is None:
        return kind  # values not read (--quick), or more than one element
    if isinstance(value, float) and record.dtype in ("float32", "float16"):
        import numpy as np

        value = float(str(np.dtype(record.dtype).type(value)))  # its shortest repr, 2.629
    return f"{short(value, 40)} {kind}"


def render_text(
    report: DiffReport,
    *,
    show_all: bool = False,
    modules: list[ModuleChange] | None = None,
    top: list[TensorDiff] | None = None,
) -> str:
    """Field changes, then a table of the tensors that differ (all with ``show_all``), then
    the one-line summary. ``modules`` (``--by-module``) replaces the tensor table with the
    rollup by module group; ``top`` (``--top N``) adds the most changed tensors."""
    lines = _field_lines(report.fields, show_all)
    rows = [_row(entry) for entry in report.tensors if show_all or not _hidden(entry)]
    if modules is not None or top is not None:
        rows = []
        for text in (_modules_text(modules), _top_text(top)):
            if text:
                lines.extend(["", text] if lines else [text])
    if rows:
        from tabulate import tabulate

        if lines:
            lines.append("")
        lines.append(tabulate(rows, headers=HEADERS, disable_numparse=True))
    if lines:
        lines.append("")
    lines.append(report.summary())
    return "\n".join(lines)


MODULE_HEADERS = ["module", "tensors", "changed", "params", "rel change"]
TOP_HEADERS = ["key", "status", "rel change", "cosine", "changed"]


def _modules_text(modules: list[ModuleChange] | None) -> str:
    """The rollup by module group, a bar per row (parameter-weighted relative change)."""
    if not modules:
        return ""
    rows = [
        [
            group.group, str(group.tensors), str(group.changed), human_count(group.parameters),
            _number(group.relative_change) + _unweighed(group),
        ]
        for group in modules
    ]  # fmt: skip
    values = [group.relative_change for group in modules]
    return with_bars(table(rows, MODULE_HEADERS), values, title="‖ΔW‖/‖W‖")


def _top_text(top: list[TensorDiff] | None) -> str:
    """The most changed tensors, a bar per row."""
    if top is None:
        return ""
    if not top:
        return "no tensor changed"
    rows = []
    for entry in top:
        values = entry.values
        assert values is not None
        rows.append([
            entry.key, STATUS_TEXT[entry.status], _number(values.relative_change),
            _cosine(values.cosine_similarity), _percent(values.changed_fraction),
        ])  # fmt: skip
    changes = [entry.values.relative_change if entry.values else None for entry in top]
    return with_bars(table(rows, TOP_HEADERS), changes, title="‖ΔW‖/‖W‖")


def _unweighed(group: ModuleChange) -> str:
    """What a group's relative change leaves out: tensors not measured, step counters."""
    parts = [f"{group.unmeasured} not measured"] if group.unmeasured else []
    if group.counters:
        parts.append(f"{group.counters} step counter{'s' if group.counters > 1 else ''} left out")
    return f" ({'; '.join(parts)})" if parts else ""


def module_json(group: ModuleChange) -> dict[str, Any]:
    return {
        "group": group.group,
        "tensors": group.tensors,
        "changed": group.changed,
        "unmeasured": group.unmeasured,
        "counters": group.counters,
        "parameters": group.parameters,
        "norm_a": math.sqrt(group.sum_sq_a),
        "diff_norm": math.sqrt(group.sum_sq_diff),
        "relative_change": _json_number(group.relative_change),
    }


def _hidden(entry: TensorDiff) -> bool:
    """Rows listed only with --all: identical, equal after rounding, or equal in value (a
    lossless cast: every element the same once both sides are in the wider dtype)."""
    if entry.status in HIDDEN:
        return True
    values = entry.values
    return (
        entry.status == WITHIN_TOLERANCE
        and values is not None
        and values.max_abs_diff == 0
        and not values.nan_positions_differ
        and not values.inf_positions_differ
    )


def _row(entry: TensorDiff) -> list[str]:
    values = entry.values
    notes = list(entry.changes)
    if entry.alias is not None:
        side = entry.alias.side.upper()
        notes.append(f"{side} stores it as {entry.alias.stored_as} ({entry.alias.rule})")
    return [
        entry.key,
        STATUS_TEXT[entry.status],
        _describe(entry.a),
        _describe(entry.b),
        _number(values.max_abs_diff) if values and not values.bitwise_equal else "",
        _number(values.max_rel_diff) if values and not values.bitwise_equal else "",
        _number(values.relative_change) if values and not values.bitwise_equal else "",
        _cosine(values.cosine_similarity) if values and not values.bitwise_equal else "",
        _percent(values.changed_fraction) if values and not values.bitwise_equal else "",
        _mismatched(values) if values and not values.bitwise_equal else "",
        "; ".join(notes),
    ]


def _describe(record: TensorRecord | None) -> str:
    return "-" if record is None else f"{record.dtype} {list(record.shape)}"


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:.4g}"


def _cosine(value: float | None) -> str:
    return "-" if value is None else f"{value:.8g}"  # 0.99999998: a fine-tune is not "1"


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.3g}%"


def _mismatched(values: ValueDiff) -> str:
    return f"{values.mismatched}/{values.numel} ({100 * values.mismatch_fraction:.3g}%)"


def _json_number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)  # "inf" / "nan": JSON has no infinity


def side_json(side: Side) -> dict[str, Any]:
    out: dict[str, Any] = {
        "path": side.path,
        "format": side.format,
        "layout": side.layout,
        "section": side.section,
        "auto_section": side.auto_section,
        "num_tensors": side.num_tensors,
        "prefix": side.prefix,
    }
    if side.weights_section is not None:  # only then: older outputs stay as they were
        out["weights_section"] = side.weights_section
    if side.map is not None:  # diff --map (A only)
        out["map"] = side.map
    return out


def record_json(record: TensorRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {"key": record.key, "dtype": record.dtype, "shape": list(record.shape)}


def field_json(entry: FieldDiff) -> dict[str, Any]:
    return {
        "key": entry.key,
        "status": entry.status,
        "a": plain(entry.a),
        "b": plain(entry.b),
        "a_tensor": record_json(entry.a_tensor),
        "b_tensor": record_json(entry.b_tensor),
    }


def tensor_json(entry: TensorDiff) -> dict[str, Any]:
    values = None
    if entry.values is not None:
        v = entry.values
        sides = {"a": entry.a, "b": entry.b}
        cast = {
            name: f"{record.dtype} -> {v.compared_as}"
            for name, record in sides.items()
            if record is not None and record.dtype != v.compared_as
        }
        values = {
            "compared_as": v.compared_as,
            "cast": cast or None,
            "bitwise_equal": v.bitwise_equal,
            "numel": v.numel,
            "mismatched": v.mismatched,
            "mismatch_fraction": v.mismatch_fraction,
            "max_abs_diff": _json_number(v.max_abs_diff),
            "max_rel_diff": _json_number(v.max_rel_diff),
            "nan_positions_differ": v.nan_positions_differ,
            "inf_positions_differ": v.inf_positions_differ,
            "changed_fraction": v.changed_fraction,
            "relative_change": _json_number(v.relative_change),
            "cosine_similarity": v.cosine_similarity,
            "norm_a": v.norm_a,
            "norm_b": v.norm_b,
            "diff_norm": v.diff_norm,
        }
    alias = None
    if entry.alias is not None:
        alias = {
            "side": entry.alias.side,
            "stored_as": entry.alias.stored_as,
            "rule": entry.alias.rule,
        }
    return {
        "key": entry.key,
        "status": entry.status,
        "a": record_json(entry.a),
        "b": record_json(entry.b),
        "alias": alias,
        "changes": list(entry.changes),
        "values": values,
    }


def views_json(
    modules: list[ModuleChange] | None = None, top: list[TensorDiff] | None = None
) -> dict[str, Any]:
    """The keys ``--by-module`` (``modules``) and ``--top`` (``top``) add to ``diff --json``."""
    out: dict[str, Any] = {}
    if modules is not None:
        out["modules"] = [module_json(group) for group in modules]
    if top is not None:
        out["top"] = [entry.key for entry in top]
    return out


def render_json(report: DiffReport) -> dict[str, Any]:
    """``diff --json``: docs/schemas/diff.schema.json (with :func:`views_json`'s keys when
    ``--by-module`` or ``--top`` is given)."""
    return {
        "schema": SCHEMA_VERSION,
        "a": side_json(report.a),
        "b": side_json(report.b),
        "rtol": report.rtol,
        "atol": report.atol,
        "quick": report.quick,
        "rounded": report.rounded,
        "equal": report.equal,
        "summary": report.counts(),
        "notes": report.notes,
        "fields": [field_json(entry) for entry in report.fields],
        "tensors": [tensor_json(entry) for entry in report.tensors],
    }
