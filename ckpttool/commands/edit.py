"""``edit``: rewrite a checkpoint file in its own format with entries dropped, kept or renamed
(issue 30; this first part: single files, the operations ``--for-inference``, ``--drop``,
``--keep``, ``--rename`` and ``--compact``).

The file's format reads its tree and where each storage lies
(:meth:`~ckpttool.formats.base.FileFormat.recover`, which also checks every record: a damaged
file is refused, ``repair`` is for it). The edits (:mod:`ckpttool.model.edits`) run on the tree,
in a stated order: ``--use-ema``, ``--for-inference``, ``--drop``, ``--keep``, ``--rename``,
``--map``, ``--dtype``, ``--compact``. The result is
written by :func:`ckpttool.commands.rewrite.write_checked`: storages copied whole from the source
(in the kernel for a torch zip), every tensor the same view of them, read back before it
replaces anything; a storage no kept tensor views is not written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from ckpttool.commands.edit_derived import (
    compute_shared,
    computed_ahead,
    derived_in_order,
    recorded,
    sweep_leftovers,
    workers,
)
from ckpttool.commands.mapped import contiguous, mapped_records, strided
from ckpttool.commands.rewrite import write_checked
from ckpttool.errors import (
    CkptError,
    CorruptCheckpointError,
    EmptyFileError,
    InputError,
    NotACheckpointError,
    OutputExistsError,
    name_file,
)
from ckpttool.formats.registry import recover_file
from ckpttool.frameworks.registry import file_placeholders
from ckpttool.io import units
from ckpttool.io.atomic import clear_stale_backup
from ckpttool.model import edits
from ckpttool.model.cast import CASTABLE, TARGETS, cast_array, stored_dtype
from ckpttool.model.mapping import MapSpec, load_map, plan
from ckpttool.model.records import (
    ITEMSIZE,
    StorageRecord,
    TensorRecord,
    join_key,
    walk,
    with_fields,
)
from ckpttool.model.roles import (
    PICKLED_MODULE,
    WHOLE_FILE,
    detect_layout,
    model_part,
    module_view,
    part_node,
    with_part,
)


@dataclass(frozen=True)
class EditReport:
    """What ``edit_file`` changed (or, with ``dry_run``, would change)."""

    source: str
    output: str
    format: str
    layout: str
    dropped: tuple[str, ...]  # keys of the entries left out, in order
    renamed: tuple[tuple[str, str], ...]  # (old key, new key)
    rules: tuple[tuple[str, int], ...]  # each --rename rule and how many keys it matched
    tensors_before: int
    tensors_after: int
    bytes_before: int  # bytes of the storages the tensors view
    bytes_after: int
    written: bool
    backup: str | None = None
    compacted: tuple[str, ...] = ()  # tensors whose storage was cut to the bytes they view
    cast: tuple[str, ...] = ()  # tensors cast to ``dtype``
    dtype: str | None = None  # the dtype tensors were cast to
    # floating tensors --dtype left in their dtype: an optimizer's state (without
    # --cast-optimizer) and step counters
    not_cast: tuple[str, ...] = ()
    underflow: tuple[tuple[str, int], ...] = ()  # (tensor, values the cast made 0)
    ema: str | None = None  # where --use-ema took the model's weights from
    ema_taken: int = 0  # model tensors given their EMA values
    ema_missing: tuple[str, ...] = ()  # model tensors the EMA does not hold (kept)
    mapped: tuple[tuple[str, str, str], ...] = ()  # (op, sources, targets) of each --map step
    dry_run: bool = False  # nothing was to be written
    files_dropped: tuple[str, ...] = ()  # a directory's member files left out
    unmatched: tuple[str, ...] = ()  # patterns that matched nothing (``require_matches=False``)

    @property
    def changed(self) -> bool:
        return bool(
            self.dropped or self.renamed or self.compacted or self.cast or self.ema_taken
            or self.mapped or self.files_dropped
        )  # fmt: skip


def _refuse_placeholders(root: Any, source: Path) -> None:
    """The edits that make or change weights (``--for-inference``, ``--use-ema``, ``--map``,
    ``--dtype``) refused for a file whose model is 0-element placeholders (a DeepSpeed ZeRO-3
    rank's model states): the result would pass for the weights."""
    found = file_placeholders(root, str(source))
    if found is not None:
        raise InputError(found.refusal(list(found.shapes)))


def default_output(src: Path) -> Path:
    """``NAME.edited.EXT`` beside ``src``."""
    return src.with_name(f"{src.stem}.edited{src.suffix}")


def edit_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    drop: list[str] | tuple[str, ...] = (),
    keep: list[str] | tuple[str, ...] = (),
    rename: list[str] | tuple[str, ...] = (),
    for_inference: bool = False,
    use_ema: str | None = None,
    map_name: str | None = None,
    map_params: dict[str, int] | None = None,
    compact: bool = False,
    dtype: str | None = None,
    keep_dtype: list[str] | tuple[str, ...] = (),
    allow_overflow: bool = False,
    cast_optimizer: bool = False,
    in_place: bool = False,
    backup: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    require_matches: bool = True,
) -> EditReport:
    """Rewrite the checkpoint file ``src`` with the edits applied, in its own format, to ``dst``
    (default :func:`default_output`; ``in_place``: ``src`` itself, replaced atomically, kept as
    ``SRC.bak`` with ``backup``). Nothing is written when nothing changes or with ``dry_run``.
    ``dtype`` casts the floating tensors but an optimizer's state and step counters
    (:func:`~ckpttool.model.edits.cast_scope`); ``cast_optimizer``: the optimizer's state too.
    Raises a :class:`~ckpttool.errors.CkptError` naming ``src``."""
    source = Path(src)
    if in_place and dst is not None:
        raise InputError("give an output or in_place, not both")
    output = source if in_place else Path(dst) if dst is not None else default_output(source)
    backup_path = source.with_name(source.name + ".bak") if backup else None
    try:
        if not source.is_file():
            raise InputError("no such file" if not source.exists() else "not a file")
        if backup and not in_place:
            raise InputError(
                "backup applies to in-place edits; with an output the original is kept"
            )
        if not in_place and output.exists() and os.path.samefile(output, source):
            raise InputError(f"the output {output} is the source: pass in_place to edit it")
        with open(source, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise EmptyFileError("the file is empty")
            found = recover_file(handle, size)
            if found is None:
                raise NotACheckpointError(
                    "edit rewrites torch.save files (zip and legacy), safetensors files and "
                    "pickles; not this file"
                )
            before = _tensors(found.root)
            if found.damage or any(
                r.storage is not None
                and r.inline_data is None
                and r.storage.key not in found.intact
                for _, r in before
            ):
                why = "; ".join(found.damage[:2]) or "a storage's bytes are missing"
                raise CorruptCheckpointError(
                    f"the file is damaged ({why}): `ckpttool repair` it first"
                )
            # pickled nn.Modules are written back as they were pickled, each object whole;
            # their state dicts say what the file is (ultralytics' model and ema)
            modules = module_view(found.root)
            viewed = found.root if modules is None else modules.root
            whole_module = modules is not None and "" in modules.classes
            layout = detect_layout(viewed, found.format, PICKLED_MODULE if whole_module else None)
            if for_inference or use_ema is not None or map_name is not None or dtype is not None:
                _refuse_placeholders(found.root, source)
            log = edits.EditLog()
            root = found.root
            sources = _Sources(handle.fileno(), found.intact)
            if use_ema is not None:
                root = edits.use_ema(root, layout, use_ema or None, log)
            if for_inference:
                root = edits.drop(root, edits.inference_drops(viewed, layout), log)
            root = edits.drop(root, list(drop), log)
            root = edits.keep(root, list(keep), log)
            root = edits.rename(root, list(rename), log)
            if require_matches:
                edits.refuse_unmatched(log.unmatched)
            if map_name is not None:
                spec = load_map(map_name, dict(map_params or {}), source.parent)
                root = _apply_map(root, layout, spec, sources, log)
            if cast_optimizer and dtype is None:
                raise InputError("--cast-optimizer goes with --dtype")
            if dtype is not None:
                castable = edits.cast_scope(root, optimizer=cast_optimizer)
                root = _cast(root, dtype, list(keep_dtype), allow_overflow, sources, log, castable)
            if compact:
                root, sources.regions = edits.compact(root, log)
            after = _tensors(root)
            changed = bool(
                log.dropped or log.renamed or log.compacted or log.cast or log.ema_taken
                or log.mapped
            )  # fmt: skip
            write = changed and not dry_run
            if write and not in_place and output.exists() and not overwrite:
                raise OutputExistsError(
                    f"{output} already exists (pass overwrite=True to replace it)"
                )
            if (
                write
                and backup_path is not None
                and os.path.lexists(backup_path)
                and not clear_stale_backup(source, backup_path, dry_run=dry_run)
            ):
                raise OutputExistsError(f"{backup_path} already exists: move it away first")

            # --jobs N, torchrun's ranks: the derived storages (casts...) shared by the workers
            ranks = units.sharing()
            order = derived_in_order(root, sources.derived) if write else {}
            shared = bool(order) and (ranks is not None or workers() > 1)
            if ranks is not None and not shared:
                units.lead_only()  # the rest is rank 0's alone
            if write:
                with _derived(sources, order, output, shared) as crcs:
                    if backup_path is not None:
                        # the original's inode, kept by a new name (the file a symlink
                        # names: os.link would link the symlink itself)
                        os.link(os.path.realpath(source), backup_path)
                    try:
                        write_checked(found, root, output, sources.read_range, sources.read, crcs)
                    except BaseException:
                        if backup_path is not None:
                            backup_path.unlink(missing_ok=True)
                        raise
    except CkptError as error:
        raise name_file(error, str(source)) from None
    return EditReport(
        source=str(source),
        output=str(output),
        format=found.format,
        layout=layout,
        dropped=tuple(log.dropped),
        renamed=tuple(log.renamed),
        rules=tuple(zip(rename, log.rule_counts)),
        compacted=tuple(log.compacted),
        cast=tuple(log.cast),
        dtype=TARGETS.get(dtype, dtype) if dtype else None,
        not_cast=tuple(log.not_cast),
        underflow=tuple(
            (key, sources.underflow[key]) for key in log.cast if sources.underflow.get(key)
        ),
        ema=log.ema,
        ema_taken=len(log.ema_taken),
        ema_missing=tuple(log.ema_missing),
        mapped=tuple(log.mapped),
        unmatched=tuple(log.unmatched),
        dry_run=dry_run,
        tensors_before=len(_viewed_tensors(found.root)),
        tensors_after=len(_viewed_tensors(root)),
        bytes_before=_stored_bytes(before),
        bytes_after=_stored_bytes(after),
        written=write,
        backup=str(backup_path) if write and backup_path is not None else None,
    )


def _tensors(root: Any) -> list[tuple[str, TensorRecord]]:
    return [(key, record) for key, record in walk(root) if isinstance(record, TensorRecord)]


def _viewed_tensors(root: Any) -> list[tuple[str, TensorRecord]]:
    """The tensors every other command lists: a pickled nn.Module's state dict, not its
    attributes (``_tensors`` walks the tree as written, attributes and all)."""
    modules = module_view(root)
    return _tensors(root if modules is None else modules.root)


def _stored_bytes(tensors: list[tuple[str, TensorRecord]]) -> int:
    """Bytes of the distinct storages the tensors view (what the file stores for them)."""
    storages = {}
    for _, record in tensors:
        if record.storage is not None and record.inline_data is None:
            storages[record.storage.key] = record.storage.nbytes
    return sum(storages.values())


@contextmanager
def _derived(
    sources: _Sources, order: dict[str, int], output: Path, shared: bool
) -> Iterator[dict[str, int]]:
    """The derived storages ``order`` names made ready for the writer, each computed once
    (:mod:`ckpttool.commands.edit_derived`): by torchrun's ranks into part files, ahead of the
    writer on ``--jobs`` threads, or as the writer asks for them; yields their CRC-32s by key
    (filled as they are computed)."""
    if shared and units.sharing() is not None:
        with compute_shared(sources.derived, order, output) as parts:
            assert parts is not None
            sources.derived.update(parts.producers)
            yield parts.crcs
        return
    sweep_leftovers(output)
    crcs: dict[str, int] = {}
    recorded(sources.derived, list(order), crcs)
    if not shared:
        yield crcs
        return
    with computed_ahead(sources.derived, list(order)):
        yield crcs


class _Sources:
    """Where each storage of the edited tree comes from: the source file (``intact``: key ->
    offset, length), a range of one of its storages (``regions``: ``--compact``), or bytes
    computed from the source (``derived``: key -> producer, e.g. a cast)."""

    def __init__(self, fd: int, intact: dict[str, tuple[int, int]]) -> None:
        self.fd = fd
        self.intact = intact
        self.regions: dict[str, tuple[str, int, int]] = {}
        self.derived: dict[str, Callable[[], bytes]] = {}
        self.underflow: dict[str, int] = {}  # a cast tensor's values that became 0, by key
        self._last: tuple[str, bytes] | None = None  # the last derived bytes (the read-back)

    def read_range(self, storage_key: str, start: int, length: int) -> bytes:
        if storage_key in self.derived:
            return self.read(storage_key)[start : start + length]
        if storage_key in self.regions:  # a storage cut to its views' bytes
            storage_key, first, end = self.regions[storage_key]
            offset = self.intact[storage_key][0]
            return os.pread(self.fd, min(length, end - first - start), offset + first + start)
        offset, stored = self.intact[storage_key]
        return os.pread(self.fd, min(length, stored - start), offset + start)

    def read(self, storage_key: str) -> bytes:
        producer = self.derived.get(storage_key)
        if producer is not None:
            last = self._last  # read once: worker threads share it
            if last is None or last[0] != storage_key:
                last = self._last = (storage_key, producer())
            return last[1]
        if storage_key in self.regions:
            _, first, end = self.regions[storage_key]
            return self.read_range(storage_key, 0, end - first)
        return self.read_range(storage_key, 0, self.intact[storage_key][1])


_CAST_PREFIX = "\0cast\0"


def _cast(
    root: Any,
    dtype: str,
    keep: list[str],
    allow_overflow: bool,
    sources: _Sources,
    log: edits.EditLog,
    castable: Callable[[str], bool] = lambda key: True,
) -> Any:
    """``root`` with every floating tensor (of a castable dtype) not matching ``keep`` cast to
    ``dtype`` (``fp16``/``bf16``/``fp32`` or a torch name), as new contiguous storages computed
    from the source's bytes at write time (one tensor in memory at a time). Tensors viewing the
    same elements of one storage (tied weights) share the cast storage. ``castable``: which keys
    may be cast (:func:`~ckpttool.model.edits.cast_scope`); the floating ones it refuses are
    logged as not cast."""
    target = TARGETS.get(dtype, dtype)
    if target not in CASTABLE:
        raise InputError(f"--dtype {dtype}: expected one of {', '.join(TARGETS)}")
    root = _dequantize_fp8(root, "", target, keep, sources, log)
    made: dict[tuple[Any, ...], StorageRecord] = {}

    def cast(record: TensorRecord, key: str) -> TensorRecord:
        if (
            record.dtype not in CASTABLE
            or record.dtype == target
            or record.storage is None
            or record.inline_data is not None
            or record.parts
            or record.layout != "strided"
            or any(fnmatchcase(key, pattern) for pattern in keep)
        ):
            return record
        if not castable(key):
            log.not_cast.append(key)
            return record
        view = (
            record.storage.key,
            record.storage_offset,
            record.shape,
            record.stride,
            record.dtype,
        )
        storage = made.get(view)
        if storage is None:
            new_key = f"{_CAST_PREFIX}{len(made)}"
            storage = StorageRecord(new_key, target, record.numel, "cpu", new_key,
                                    record.numel * ITEMSIZE[target])  # fmt: skip
            made[view] = storage
            sources.derived[new_key] = _caster(record, key, target, allow_overflow, sources)
        log.cast.append(key)
        return with_fields(record, dtype=target, storage=storage, storage_offset=0,
                           stride=contiguous(tuple(record.shape)))  # fmt: skip

    return edits.map_tensors(root, cast)


def _caster(
    record: TensorRecord, key: str, target: str, allow_overflow: bool, sources: _Sources
) -> Callable[[], bytes]:
    def produce() -> bytes:
        import numpy as np

        assert record.storage is not None
        first = record.storage_offset * record.itemsize
        span = max(record.stored_extent_bytes - first, 0)
        raw = sources.read_range(record.storage.key, first, span)
        held = stored_dtype(record.dtype)
        flat = np.frombuffer(raw, dtype=held)
        values = np.lib.stride_tricks.as_strided(
            flat, shape=record.shape, strides=[s * held.itemsize for s in record.stride]
        )
        out, counts = cast_array(np.ascontiguousarray(values), record.dtype, target)
        sources.underflow[key] = counts.underflow  # set, not added: a storage may be made twice
        if counts.overflow and not allow_overflow:
            raise InputError(
                f"--dtype: {counts.overflow:,} finite value(s) of {key!r} (largest "
                f"{counts.max_abs:g}) do not fit in {target}: pass --allow-overflow to write "
                "them as inf, or --keep-dtype to leave that tensor alone"
            )
        return out.tobytes()

    return produce


def _apply_map(root: Any, layout: str, spec: MapSpec, sources: _Sources, log: edits.EditLog) -> Any:
    """``root`` with the model's state dict mapped by ``spec``: renames keep their storage,
    the other operations write new contiguous storages computed at write time."""
    part = model_part(root, layout)
    if part is None or not isinstance(root, dict):
        raise InputError(f"--map {spec.name}: the checkpoint has no model state dict to map")
    model = part_node(root, part)
    if not isinstance(model, dict) or not all(isinstance(k, str) for k in model):
        raise InputError(f"--map {spec.name}: the model part is not a state dict")
    tensors = {k: v for k, v in model.items() if isinstance(v, TensorRecord)}
    steps, unmatched = plan(list(tensors), spec)
    out: dict[str, Any] = {}
    for key, value in model.items():
        if key not in tensors or (key in unmatched and spec.unmatched == "keep"):
            out[key] = value
    for step in steps:
        records = [tensors[k] for k in step.sources]
        log.mapped.append((step.rule.op, ", ".join(step.sources), ", ".join(step.targets)))
        if step.rule.op == "rename":
            out[step.targets[0]] = records[0]
            continue
        made_records = mapped_records(
            step, records, spec, sources.derived, lambda r: _values(r, sources)
        )
        for target, made in zip(step.targets, made_records):
            out[target] = made
    log.dropped.extend(join_key(part, k) for k in unmatched if spec.unmatched == "drop")
    return out if part == WHOLE_FILE else with_part(root, part, out)


def _values(record: TensorRecord, sources: _Sources) -> Any:
    """The tensor's elements as a NumPy array of unsigned integers of its element size (the
    operations only move elements), shaped and strided as the tensor."""
    assert record.storage is not None
    first = record.storage_offset * record.itemsize
    raw = sources.read_range(record.storage.key, first, max(record.stored_extent_bytes - first, 0))
    return strided(record, raw, 0)


#: Names a float8 weight's scale has beside it: DeepSeek-V3's multiplier (``weight_scale_inv``),
#: and the ``weight_scale`` of compressed-tensors / FBGEMM checkpoints (also a multiplier).
FP8_SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: The block of elements one scale covers when the scale is a 2-D grid (DeepSeek-V3's
#: ``weight_block_size``).
FP8_BLOCK = (128, 128)
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_FP8_PREFIX = "\0fp8\0"


def _dequantize_fp8(
    node: Any, key: str, target: str, keep: list[str], sources: _Sources, log: edits.EditLog
) -> Any:
    """Each dict's float8 tensors that have a scale beside them (``NAME_scale_inv`` /
    ``NAME_scale``: one per tensor, per row, or per 128x128 block) as ``target`` tensors,
    ``value * scale`` computed in float32 then cast; the scales dropped."""
    if not isinstance(node, dict):
        return node
    out: dict[Any, Any] = {}
    scales_used: set[Any] = set()
    for name, value in node.items():
        child = join_key(key, str(name))
        if isinstance(value, dict):
            out[name] = _dequantize_fp8(value, child, target, keep, sources, log)
            continue
        scale_name = next(
            (f"{name}{suffix}" for suffix in FP8_SCALE_SUFFIXES if f"{name}{suffix}" in node),
            None,
        )
        if (
            not isinstance(value, TensorRecord)
            or value.dtype not in _FP8
            or scale_name is None
            or not isinstance(node[scale_name], TensorRecord)
            or any(fnmatchcase(child, pattern) for pattern in keep)
        ):
            out[name] = value
            continue
        scale = node[scale_name]
        _scale_grid(value, scale, child)  # checked now: an error before anything is written
        new_key = f"{_FP8_PREFIX}{child}"
        storage = StorageRecord(new_key, target, value.numel, "cpu", new_key,
                                value.numel * ITEMSIZE[target])  # fmt: skip
        sources.derived[new_key] = _fp8_producer(value, scale, child, target, sources)
        out[name] = TensorRecord(child, target, tuple(value.shape), contiguous(value.shape), 0,
                                 storage)  # fmt: skip
        scales_used.add(scale_name)
        log.cast.append(child)
    for name in scales_used:
        out.pop(name, None)
        log.dropped.append(join_key(key, str(name)))
    return out


def _scale_grid(weight: TensorRecord, scale: TensorRecord, key: str) -> tuple[int, int]:
    """How many rows and columns of ``weight`` one element of ``scale`` covers (a scale with
    one element covers it all)."""
    if scale.numel == 1:
        return 0, 0
    shape = tuple(scale.shape)
    if len(weight.shape) == 2:
        rows, cols = weight.shape
        if shape in ((rows,), (rows, 1)):
            return 1, cols
        block_rows, block_cols = FP8_BLOCK
        if shape == (-(-rows // block_rows), -(-cols // block_cols)):
            return block_rows, block_cols
    raise InputError(
        f"{key}: a float8 weight {list(weight.shape)} with a scale {list(scale.shape)} that is "
        f"neither per tensor, per row, nor per {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block"
    )


def _fp8_producer(
    weight: TensorRecord, scale: TensorRecord, key: str, target: str, sources: _Sources
) -> Callable[[], bytes]:
    def produce() -> bytes:
        import numpy as np

        from ckpttool.io.values import as_float

        def floats(record: TensorRecord) -> Any:
            codes = np.ascontiguousarray(_values(record, sources)).reshape(-1)
            if record.dtype in ("float16", "float32", "float64"):
                return codes.view(stored_dtype(record.dtype)).astype(np.float32)
            return as_float(record, codes)  # bfloat16, float8 (e8m0 too): exact

        values = floats(weight).reshape(weight.shape)
        factors = floats(scale).astype(np.float32)
        block_rows, block_cols = _scale_grid(weight, scale, key)
        if scale.numel == 1:
            product = values * factors[0]
        else:
            grid = factors.reshape(-(-weight.shape[0] // block_rows), -1)
            expanded = np.repeat(np.repeat(grid, block_rows, axis=0), block_cols, axis=1)
            product = values * expanded[: weight.shape[0], : weight.shape[1]]
        product = np.ascontiguousarray(product, dtype=np.float32)
        out, _ = cast_array(product, "float32", target)
        return out.tobytes()

    return produce
