"""``show``: what a checkpoint holds, from metadata alone (values only with ``stats=True``)."""

from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.show_settings import part_settings, settings_of
from ckpttool.errors import CkptError
from ckpttool.frameworks.base import Placeholders
from ckpttool.frameworks.registry import file_placeholders, framework_of
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ChunkedStorageRecord,
    StorageRecord,
    TensorRecord,
    count_once,
    paths_of,
    shared_storages,
    storage_groups,
    storage_views,
    tensor_keys,
    tensor_subclasses,
    with_key,
    without_values,
)
from ckpttool.model.roles import (
    LAYOUT_TITLES,
    OptimizerSummary,
    layout_of,
    layout_warnings,
    model_part,
    optimizer_part,
    part_node,
    rng_present,
    scalar_fields,
    scalar_tensors,
    summarize_optimizer,
)

if TYPE_CHECKING:
    from ckpttool.io.values import TensorStats


@dataclass(slots=True)
class TensorInfo:
    record: TensorRecord
    notes: list[str]
    stats: TensorStats | None = None
    stats_unavailable: str | None = None  # with --stats: why this tensor has none


@dataclass
class ShowReport:
    path: str
    format: str
    file_size: int
    layout: str
    details: dict[str, Any]
    metadata: dict[str, str]
    fields: dict[str, Any]  # every scalar field; from the CLI's text only those it prints
    tensors: list[TensorInfo]  # the selected ones (all, or those --section/--filter keep)
    # elements of the selected tensors that belong to the model, each stored element once
    # (records.count_once); None when the file has no model part ckpttool can name, or the
    # selection holds none of its tensors
    num_parameters: int | None
    bytes_by_dtype: dict[str, int]  # of the selected tensors, each stored element once
    total_tensors: int = 0  # in the whole file
    section: str | None = None
    pattern: str | None = None
    # a framework directory: the section its weights files fill, whose keys are shown (and
    # --filter matched) as the files store them, without the section's name before them
    weights_section: str | None = None
    # key of the model: top-level, or a dotted path found by structure ("" the whole file;
    # None unknown)
    model_part: str | None = None
    optimizer_part: str | None = None
    shared: list[list[str]] = field(default_factory=list)  # selected keys, by shared storage
    optimizer: OptimizerSummary | None = None
    rng: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # what was saved beside the tensors, by top-level part (a scheduler's position, a config
    # dataclass, an argparse.Namespace, Lightning's hyper_parameters): see part_settings
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # bytes the file stores for storages that no tensor views, and in how many storages
    unreferenced: tuple[int, int] = (0, 0)

    @property
    def layout_title(self) -> str:
        return LAYOUT_TITLES.get(self.layout, self.layout)

    @property
    def is_selection(self) -> bool:
        return bool(self.section or self.pattern)

    @property
    def num_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())


def tensor_notes(
    records: list[TensorRecord], groups: list[list[TensorRecord]] | None = None
) -> dict[str, list[str]]:
    """Per key: shared storage (tied weights), views, non-contiguous, saved on an accelerator.

    ``groups``: ``storage_groups(records)`` when the caller has it. Keys without a note are
    left out (most keys: a checkpoint of 100,000 tensors would hold as many empty lists).
    """
    notes: dict[str, list[str]] = {}
    for group in storage_groups(records) if groups is None else groups:
        # linear in the group: a hostile file can hang 100,000 views on one storage
        same = len({(o.shape, o.storage_offset, o.stride) for o in group}) == 1
        label = "tied with" if same else "shares storage with"
        more = f" (+{len(group) - 2})" if len(group) > 2 else ""
        for index, record in enumerate(group):
            first_other = group[1] if index == 0 else group[0]
            notes.setdefault(record.key, []).append(f"{label} {first_other.key}{more}")
    contiguous: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape: its contiguous strides
    for record in records:
        shape = record.shape
        strides = contiguous.get(shape)
        if strides is None:
            strides = contiguous[shape] = contiguous_strides(shape)
        storage = record.storage
        location = storage.location if storage is not None else record.location
        if (
            record.stride == strides
            and not record.storage_offset
            and (location == "cpu" or location == "")
            and record.kind == "tensor"
            and not record.parts
            and record.quant is None
            and not isinstance(storage, ChunkedStorageRecord)
            and record.dtensor is None
        ):
            continue  # nothing to say (almost every tensor)
        found = []
        if not record.is_contiguous:
            found.append("non-contiguous")
        if record.storage_offset:
            found.append(f"offset {record.storage_offset}")
        if location not in ("cpu", ""):
            found.append(f"saved on {location}")
        if record.kind == "ndarray":
            found.append("numpy")
        elif record.kind == "storage":
            found.append("a storage saved on its own")
        if record.parts:
            found.append(layout_note(record))
        if record.quant is not None:
            found.append(f"quantized {record.quant.describe()}")
        if isinstance(storage, ChunkedStorageRecord):
            found.append(chunk_note(storage))
        if record.dtensor is not None:
            found.append(record.dtensor.describe())
        if found:
            notes.setdefault(record.key, []).extend(found)
    return notes


def subclass_notes(root: Any, weights_key: str | None) -> dict[str, str]:
    """Per inner tensor of a wrapper subclass (torchao's quantized weights): which tensor it
    is part of and what that tensor is ("qdata of 0.weight: torchao Int8Tensor, float32
    [8, 16], block_size [1, 16]")."""
    strip = f"{weights_key}." if weights_key else ""
    notes = {}
    for key, obj in tensor_subclasses(root, outermost=True).items():
        key = key.removeprefix(strip)
        for name in tensor_keys(obj):
            notes[f"{key}.{name}"] = f"{name} of {key}: {obj.describe()}"
    return notes


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides = []
    expected = 1
    for size in reversed(shape):
        strides.append(expected)
        expected *= size
    return tuple(reversed(strides))


def layout_note(record: TensorRecord) -> str:
    """A sparse or nested tensor's layout and parts: "sparse_csr, nnz 3, indices int64"."""
    if record.layout == "nested":
        return f"nested, {record.shape[0]} components, buffer {record.parts[0].numel} elements"
    index_dtypes = sorted({part.dtype for part in record.parts[:-1]})
    return f"{record.layout}, nnz {record.nnz}, indices {'/'.join(index_dtypes)}"


def chunk_note(storage: ChunkedStorageRecord, most: int = 4) -> str:
    """How a DCP tensor is stored: "2 chunks: __0_0.distcp, __1_0.distcp"."""
    files = list(dict.fromkeys(chunk.file for chunk in storage.chunks))
    more = (
        f" (+{len(files) - most} file{'s' * (len(files) - most != 1)})" if len(files) > most else ""
    )
    shown = ", ".join(files[:most]) + more
    count = len(storage.chunks)
    placed = f"{storage.placement}, " if storage.placement else ""
    return f"{placed}{count} chunk{'s' if count != 1 else ''}: {shown}"


def count_parameters(records: list[TensorRecord]) -> int:
    """Elements of ``records``, each stored element once (tied weights once)."""
    return count_once(records)[0]


def largest_first(by_dtype: dict[str, int]) -> dict[str, int]:
    """Bytes by dtype (from :func:`~ckpttool.model.records.count_once`), largest first."""
    return dict(sorted(by_dtype.items(), key=lambda kv: -kv[1]))


def weights_section(ckpt: Checkpoint) -> str | None:
    """The section a framework directory's weights files fill (``model``), when it is one, or
    the one section that holds them all as named parts (``model.unet``, ``model.vqvae``:
    ``model``)."""
    members = ckpt.details.get("members")
    if ckpt.format != "directory" or not isinstance(members, list):
        return None
    sections = {m.get("section") for m in members if m.get("role") == "weights"}
    if not sections or not all(isinstance(found, str) and found for found in sections):
        return None
    parents = {str(found).split(".", 1)[0] for found in sections}
    if len(parents) == 1 and all("." in str(found) for found in sections):
        return parents.pop()  # parts, even when only one is there: keyed by their names
    return str(sections.pop()) if len(sections) == 1 else None


def stored_keys(records: list[TensorRecord], section: str) -> list[TensorRecord]:
    """``records`` with ``section.`` taken off the keys under it: a weights file's tensors
    under the keys the file stores them by."""
    start = section + "."
    return [with_key(r, r.key[len(start) :]) if r.key.startswith(start) else r for r in records]


#: The top-level key of ``rescale-step``'s history (``rescaled_from.N.<key>`` fields).
RESCALE_HISTORY = "rescaled_from"


def text_field_parent(key: str) -> bool:
    """Whether a container at ``key`` may hold a field ``show``'s text prints (one of the
    root's, or of its rescale history): keys under another hold a dot, and are not printed."""
    return not key or key == RESCALE_HISTORY or key.startswith(RESCALE_HISTORY + ".")


def build_report(
    ckpt: Checkpoint,
    *,
    section: str | None = None,
    pattern: str | None = None,
    stats: bool = False,
    all_fields: bool = True,
) -> ShowReport:
    """What ``show`` reports of ``ckpt``; without ``all_fields``, ``fields`` holds only those
    the text prints (``text_field_parent``)."""
    layout = layout_of(ckpt)
    all_records = ckpt.tensors()
    records = ckpt.tensors(section) if section else all_records
    weights_key = weights_section(ckpt)
    if weights_key is not None:
        shown = stored_keys(all_records, weights_key)
        if len({r.key for r in shown}) == len(shown):
            all_records = shown
            records = stored_keys(records, weights_key) if section else all_records
        else:  # a stored key equal to another part's (optimizer.*): keep the full keys
            weights_key = None
    if pattern:
        records = [r for r in records if fnmatch.fnmatchcase(r.key, pattern)]
    state_scalars = scalar_tensors(ckpt.root, layout) if not (section or pattern) else {}
    if state_scalars:  # training state, shown with the other counters (--filter still finds it)
        records = [r for r in records if r.key not in state_scalars]
    views = storage_views(all_records)
    groups = storage_groups(all_records, views)
    unreferenced = unreferenced_bytes(all_records)
    notes = tensor_notes(all_records, groups)
    subclassed = {} if ckpt.without_objects else subclass_notes(ckpt.root, weights_key)
    for key, note in subclassed.items():
        notes.setdefault(key, []).append(note)
    if notes:
        infos = [TensorInfo(r, list(notes.get(r.key, ()))) for r in records]
    else:
        infos = [TensorInfo(r, []) for r in records]
    warnings = layout_warnings(
        ckpt.root, layout, all_records, objects=not ckpt.without_objects
    ) + list(ckpt.problems)
    warnings += [f"of the tensors listed, {reason}" for reason in without_values(records)]
    warnings += same_key_warnings(ckpt.root, all_records)
    if stats:
        warnings.extend(add_stats(ckpt, infos))
    model_key = model_part(ckpt.root, layout)
    optimizer_key = optimizer_part(ckpt.root, layout)
    selected_elements, selected_bytes = count_once(
        records, views if records is all_records else None
    )
    num_parameters = None
    if model_key is not None:
        if model_key:
            in_model = tensor_keys(ckpt.section(model_key), model_key)
            if model_key == weights_key:
                in_model = [key[len(model_key) + 1 :] for key in in_model]
            model_keys = set(in_model)
            selected_model = [r for r in records if r.key in model_keys]
        else:  # the whole file
            selected_model = records
        if len(selected_model) == len(records):  # the whole selection: one count serves both
            num_parameters = selected_elements if records else None
        elif selected_model:
            num_parameters = count_parameters(selected_model)
    placeholders = file_placeholders(ckpt.root, ckpt.name)
    if placeholders is not None:
        num_parameters = _with_real_shapes(placeholders, infos, warnings, num_parameters)
    framework = framework_of(ckpt.details.get("layout"))
    real = framework.num_parameters(ckpt.details) if framework is not None else None
    if real is not None and not (section or pattern):
        # the real parameters as the framework knows them (DeepSpeed: param_shapes; ZeRO-3
        # files hold placeholders and flat partitions)
        num_parameters = real
    optimizer = None
    if optimizer_key is not None:
        optimizer = summarize_optimizer(
            part_node(ckpt.root, optimizer_key), part_node(ckpt.root, model_key)
        )
    fields = scalar_fields(ckpt.root, below=None if all_fields else text_field_parent)
    if state_scalars:
        fields.update({key: scalar_value(ckpt, r) for key, r in state_scalars.items()})
        order = {key: index for index, key in enumerate(ckpt.root)}
        fields = dict(sorted(fields.items(), key=lambda kv: order.get(kv[0], len(order))))
    if ckpt.metadata:
        fields.update({f"__metadata__.{k}": v for k, v in ckpt.metadata.items()})
    return ShowReport(
        path=ckpt.name,
        format=ckpt.format,
        file_size=ckpt.file_size,
        layout=layout,
        details=({**ckpt.details, "weights_section": weights_key} if weights_key else ckpt.details),
        metadata=ckpt.metadata,
        fields=fields,
        tensors=infos,
        num_parameters=num_parameters,
        bytes_by_dtype=largest_first(selected_bytes),
        total_tensors=len(all_records),
        section=section,
        pattern=pattern,
        weights_section=weights_key,
        model_part=model_key,
        optimizer_part=optimizer_key,
        shared=(
            shared_storages(records)
            if records is not all_records
            else [[record.key for record in group] for group in groups]
        ),
        optimizer=optimizer,
        rng=rng_present(ckpt.root),
        warnings=warnings,
        parts=_selected_parts(ckpt, section),
        unreferenced=unreferenced,
    )


def _with_real_shapes(
    placeholders: Placeholders,
    infos: list[TensorInfo],
    warnings: list[str],
    num_parameters: int | None,
) -> int | None:
    """A file's 0-element placeholders shown with the real shapes it records (each tensor's
    note, one warning saying where the values are), and counted by them: ``num_parameters``
    with each placeholder storage's real elements, once (a tied pair shares one)."""
    listed = [info for info in infos if info.record.key in placeholders.shapes]
    if not listed:
        return num_parameters
    seen: set[Any] = set()
    extra = 0
    for info in listed:
        shape = placeholders.shapes[info.record.key]
        info.notes.insert(0, f"placeholder of {list(shape)}: 0 elements stored")
        storage = info.record.storage
        identity = (
            (storage.key, info.record.storage_offset) if storage is not None else info.record.key
        )
        if identity not in seen:
            seen.add(identity)
            extra += math.prod(shape)
    warnings.insert(0, placeholders.refusal([info.record.key for info in listed]))
    return (num_parameters or 0) + extra if num_parameters is not None else None


def scalar_value(ckpt: Checkpoint, record: TensorRecord) -> Any:
    """The value a 0-d tensor holds (4 bytes or so read), or what it is when it has none to
    read (a meta tensor) or its bytes are damaged."""
    from ckpttool.io.values import as_float, read_array, stats_unavailable  # NumPy: rare

    if stats_unavailable(record) is None:
        try:
            array = read_array(ckpt, record)
            if record.dtype.startswith(("int", "uint", "bool")):
                return array.item()
            value = as_float(record, array)[()]
            # float32's own shortest text (3.2, not 3.200000047683716)
            return float(str(value)) if value.dtype.itemsize < 8 else float(value)
        except CkptError:
            pass
    return f"a 0-d {record.dtype} tensor"


def _selected_parts(ckpt: Checkpoint, section: str | None) -> dict[str, dict[str, Any]]:
    """:func:`part_settings`; with ``--section``, that section's own settings only."""
    if not section:
        return part_settings(ckpt.root)
    settings = settings_of(ckpt.section(section))
    return {section: settings} if settings else {}


def same_key_warnings(root: Any, records: list[TensorRecord]) -> list[str]:
    """Keys that several paths flatten to (``{'a.b': {'c': t}, 'a': {'b.c': t}}``): rows with
    the same key, which the table alone would not explain."""
    seen: set[str] = set()
    repeated: dict[str, None] = {}
    for record in records:
        if record.key in seen:
            repeated.setdefault(record.key)
        seen.add(record.key)
    if not repeated:
        return []
    first = next(iter(repeated))
    paths = " and ".join(paths_of(root, first))
    more = f" (+{len(repeated) - 1} more keys)" if len(repeated) > 1 else ""
    return [
        f"two paths flatten to the same key {first!r}: {paths}{more}; their rows are listed "
        "under one key, and diff and convert refuse them"
    ]


def add_stats(ckpt: Checkpoint, infos: list[TensorInfo]) -> list[str]:
    """Read each tensor's values for its statistics; returns the warnings they raise.

    A tensor whose values cannot be described (a quantized or meta tensor) or read (its bytes
    are damaged) gets the reason instead: one tensor never stops the report.
    """
    from ckpttool.io.values import stats_basis, stats_unavailable, tensor_stats  # NumPy: --stats

    warnings = []
    ckpt.plan_reads([info.record for info in infos])  # a URL: few large requests
    for info in infos:
        record = info.record
        info.stats_unavailable = stats_unavailable(record)
        if info.stats_unavailable is not None:
            continue
        try:
            info.stats = tensor_stats(ckpt, record)
        except CkptError as error:
            reason = str(error).removeprefix(f"{ckpt.name}: ").removeprefix(f"{record.key}: ")
            info.stats_unavailable = reason
            warnings.append(f"{record.key}: no statistics: {info.stats_unavailable}")
            continue
        basis = stats_basis(record)
        if basis is not None:
            info.notes.append(basis)
        if info.stats.nan or info.stats.inf:
            warnings.append(f"{record.key}: {info.stats.nan} NaN and {info.stats.inf} Inf values")
    return warnings


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


def check_collection(layout: Any) -> None:
    """A directory of several checkpoints (a Trainer ``output_dir``; ``layout`` is its
    :class:`~ckpttool.frameworks.base.FrameworkDirectory`): each checkpoint that holds every
    file its resume needs is opened as ``show`` opens one, and one whose files do not read (a
    torn ``model.safetensors``) is marked incomplete with why, in its ``missing``: "complete"
    must not be said of a checkpoint ``show`` itself cannot open. Structure only: ``verify``
    checks the bytes."""
    from ckpttool.io.source import join

    for entry in layout.details.get("checkpoints", []):
        if not entry.get("complete"):
            continue
        path = join(layout.directory, entry["name"])
        try:
            with open_checkpoint(path, strict=False, refuse_dangerous=False) as ckpt:
                problems = list(ckpt.problems)
        except CkptError as error:
            problems = [str(error).removeprefix(f"{path}: ").removeprefix(f"{path}/")]
        if problems:
            entry["complete"] = False
            entry["missing"] = [*entry.get("missing", []), *(f"damaged: {p}" for p in problems)]


def unreferenced_bytes(records: list[TensorRecord]) -> tuple[int, int]:
    """(bytes, storages): what the file stores that no tensor views. A tensor saved as a view
    keeps its whole storage (``torch.save(big[:10])`` stores all of ``big``)."""
    spans: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for record in records:
        storage = record.storage
        if (
            storage is None
            or record.inline_data is not None
            or record.parts
            or record.layout != "strided"
            or record.dtype in ELEMENTS_PER_BYTE
            or type(storage) is not StorageRecord
        ):
            continue
        first = record.storage_offset * record.itemsize
        entry = spans.setdefault(storage.key, (storage.nbytes, []))
        entry[1].append((first, max(record.stored_extent_bytes, first)))
    total = count = 0
    for nbytes, intervals in spans.values():
        covered, reach = 0, 0
        for start, end in sorted(intervals):
            start = max(start, reach)
            if end > start:
                covered += end - start
                reach = end
        if nbytes > covered:
            total += nbytes - covered
            count += 1
    return total, count
