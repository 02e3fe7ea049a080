"""``show``: what a checkpoint holds, from metadata alone (values only with ``stats=True``)."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpttool.layout import (
    LAYOUT_TITLES,
    OptimizerSummary,
    detect_layout,
    is_resume,
    layout_warnings,
    rng_present,
    scalar_fields,
    summarize_optimizer,
)
from ckpttool.reader import Checkpoint, open_checkpoint
from ckpttool.records import ChunkedStorageRecord, TensorRecord

if TYPE_CHECKING:
    from ckpttool.values import TensorStats


@dataclass
class TensorInfo:
    record: TensorRecord
    notes: list[str]
    stats: TensorStats | None = None


@dataclass
class ShowReport:
    path: str
    format: str
    file_size: int
    layout: str
    details: dict[str, Any]
    metadata: dict[str, str]
    fields: dict[str, Any]
    tensors: list[TensorInfo]
    num_parameters: int  # elements of the model's tensors, shared storage counted once
    bytes_by_dtype: dict[str, int]
    optimizer: OptimizerSummary | None = None
    rng: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def layout_title(self) -> str:
        return LAYOUT_TITLES.get(self.layout, self.layout)


def tensor_notes(records: list[TensorRecord]) -> dict[str, list[str]]:
    """Per key: shared storage (tied weights), views, non-contiguous, saved on an accelerator."""
    by_storage: dict[Any, list[TensorRecord]] = {}
    for record in records:
        if record.storage is not None and record.inline_data is None:
            by_storage.setdefault(record.storage, []).append(record)
    notes: dict[str, list[str]] = {r.key: [] for r in records}
    for group in by_storage.values():
        if len(group) > 1:
            # linear in the group: a hostile file can hang 100,000 views on one storage
            same = len({(o.shape, o.storage_offset, o.stride) for o in group}) == 1
            label = "tied with" if same else "shares storage with"
            more = f" (+{len(group) - 2})" if len(group) > 2 else ""
            for index, record in enumerate(group):
                first_other = group[1] if index == 0 else group[0]
                notes[record.key].append(f"{label} {first_other.key}{more}")
    for record in records:
        if not record.is_contiguous:
            notes[record.key].append("non-contiguous")
        if record.storage_offset:
            notes[record.key].append(f"offset {record.storage_offset}")
        if record.location not in ("cpu", ""):
            notes[record.key].append(f"saved on {record.location}")
        if record.kind == "ndarray":
            notes[record.key].append("numpy")
        if isinstance(record.storage, ChunkedStorageRecord):
            notes[record.key].append(chunk_note(record.storage))
    return notes


def chunk_note(storage: ChunkedStorageRecord, most: int = 4) -> str:
    """How a DCP tensor is stored: "2 chunks: __0_0.distcp, __1_0.distcp"."""
    files = list(dict.fromkeys(chunk.file for chunk in storage.chunks))
    more = f" (+{len(files) - most} files)" if len(files) > most else ""
    shown = ", ".join(files[:most]) + more
    count = len(storage.chunks)
    return f"{count} chunk{'s' if count != 1 else ''}: {shown}"


def count_parameters(records: list[TensorRecord]) -> int:
    seen: set[Any] = set()
    total = 0
    for record in records:
        identity = (record.storage, record.storage_offset, record.shape, record.stride)
        if record.storage is None or record.inline_data is not None or identity not in seen:
            seen.add(identity)
            total += record.numel
    return total


def build_report(
    ckpt: Checkpoint,
    *,
    section: str | None = None,
    pattern: str | None = None,
    stats: bool = False,
) -> ShowReport:
    layout = detect_layout(ckpt.root, ckpt.format)
    all_records = ckpt.tensors()
    records = ckpt.tensors(section) if section else all_records
    if pattern:
        records = [r for r in records if fnmatch.fnmatchcase(r.key, pattern)]
    notes = tensor_notes(all_records)
    infos = [TensorInfo(r, notes.get(r.key, [])) for r in records]
    warnings = layout_warnings(ckpt.root, layout, all_records) + list(ckpt.problems)
    if stats:
        from ckpttool.values import tensor_stats  # NumPy and value reading: only for --stats

        for info in infos:
            info.stats = tensor_stats(ckpt, info.record)
            if info.stats.nan or info.stats.inf:
                warnings.append(
                    f"{info.record.key}: {info.stats.nan} NaN and {info.stats.inf} Inf values"
                )
    model_records = all_records
    optimizer = None
    if is_resume(layout) and isinstance(ckpt.root, dict):
        model_records = ckpt.tensors("model")
        optimizer = summarize_optimizer(ckpt.root.get("optimizer"), ckpt.root.get("model"))
    elif layout == "lightning":
        model_records = ckpt.tensors("state_dict")
    bytes_by_dtype: dict[str, int] = {}
    for record in records:
        bytes_by_dtype[record.dtype] = bytes_by_dtype.get(record.dtype, 0) + record.nbytes
    fields = scalar_fields(ckpt.root)
    if ckpt.metadata:
        fields.update({f"__metadata__.{k}": v for k, v in ckpt.metadata.items()})
    return ShowReport(
        path=ckpt.name,
        format=ckpt.format,
        file_size=ckpt.file_size,
        layout=layout,
        details=ckpt.details,
        metadata=ckpt.metadata,
        fields=fields,
        tensors=infos,
        num_parameters=count_parameters(model_records),
        bytes_by_dtype=dict(sorted(bytes_by_dtype.items(), key=lambda kv: -kv[1])),
        optimizer=optimizer,
        rng=rng_present(ckpt.root),
        warnings=warnings,
    )


def show(
    path: str | os.PathLike[str],
    *,
    section: str | None = None,
    pattern: str | None = None,
    stats: bool = False,
) -> ShowReport:
    """Describe the checkpoint at ``path``. Reads tensor bytes only when ``stats`` is set."""
    with open_checkpoint(path) as ckpt:
        return build_report(ckpt, section=section, pattern=pattern, stats=stats)
