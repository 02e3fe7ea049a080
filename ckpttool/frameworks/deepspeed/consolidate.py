"""The fp32 master weights of a DeepSpeed ZeRO checkpoint as one lazy state dict.

DeepSpeed keeps a ZeRO run's fp32 master weights as flat partitions, one per data-parallel
rank, in the ``*_optim_states.pt`` files next to the Adam moments. :func:`open_zero_weights`
rebuilds, without DeepSpeed and without reading a byte of tensor data, the state dict that
DeepSpeed's own ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` returns, in its
order and with its rules:

1. the module's buffers (``buffer_names``), floating ones as float32 (``.float()``);
2. frozen parameters (``frozen_param_shapes``): ZeRO-1/2 keeps them whole in the model-states
   file, ZeRO-3 as one padded fragment per rank; their saved dtype is kept, as DeepSpeed does;
3. trainable parameters (``param_shapes``, group by group): ZeRO-1/2 concatenates the ranks'
   ``single_partition_of_fp32_groups[g]`` and takes each parameter in turn (skipping
   ``param_alignment_paddings``), ZeRO-3 takes ``ceil(numel / world)`` elements of each rank's
   ``fp32_flat_groups`` per parameter and keeps the first ``numel`` of their concatenation;
4. shared parameters (``shared_params``, ``alias -> owner``) as aliases of their owner.

Each tensor is a :class:`~ckpttool.model.records.TensorRecord` whose storage is a
:class:`ZeroStorageRecord`: the list of byte ranges of the rank files that hold it. Reading it
(``Checkpoint.read_bytes``) preads only those ranges, so consolidating touches the fp32
partitions' bytes and never the Adam moments', and holds one tensor at a time. Everything that
takes a :class:`~ckpttool.checkpoint.Checkpoint` (``convert``, ``diff``, stats) works on the result.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpttool.errors import CorruptCheckpointError, InputError, NotZeroError
from ckpttool.formats.base import Parsed, no_span
from ckpttool.formats.registry import as_checkpoint
from ckpttool.frameworks.base import WEIGHTS_VIEW, OpenedMembers, ViewFacts, open_member
from ckpttool.frameworks.tree import DIRECTORY
from ckpttool.model.cast import stored_dtype, widen
from ckpttool.model.records import ITEMSIZE, OpaqueObject, StorageRecord, TensorRecord
from ckpttool.model.roles import DEEPSPEED

#: The consolidated view's ``details["layout"]`` (its tree is a flat state dict; outputs name it
#: by :func:`ckpttool.frameworks.base.reported_layout` from its view facts).
ZERO_FP32 = "deepspeed_zero_fp32"


@dataclass(frozen=True)
class ZeroTag:
    """The files of one DeepSpeed tag directory (``global_stepN/``) that consolidation reads."""

    directory: str  # a local path or a URL (the rank files are read by ranges)
    optim_files: list[str]  # by data-parallel rank
    model_files: list[str]  # mp_rank_00_model_states.pt; ZeRO-3: one per data-parallel rank

    @property
    def name(self) -> str:
        """The tag's name (``global_step4``)."""
        return self.directory.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]


def is_deepspeed_directory(path: str | os.PathLike[str]) -> bool:
    """A DeepSpeed save or tag directory of any ZeRO stage (0 included), complete or not."""
    from ckpttool.frameworks.deepspeed.files import detect
    from ckpttool.io.source import is_dir

    return is_dir(os.fspath(path)) and detect(os.fspath(path)) is not None


def find_tag(path: str | os.PathLike[str], found: object = None) -> ZeroTag:
    """The optimizer-state and model-state files of the tag ``path`` names (a save directory's
    ``latest``, or a tag directory), found by :func:`ckpttool.frameworks.deepspeed.files.zero_files`.
    Raises :class:`NotZeroError` when ``path`` is not DeepSpeed's or holds no ZeRO partitions,
    :class:`~ckpttool.errors.InputError` when the tag is incomplete (naming what is missing).
    ``found``: what detection found (``FrameworkDirectory.found``): the directory is DeepSpeed's,
    and is not listed again."""
    from ckpttool.frameworks.deepspeed.files import zero_files

    if found is None and not is_deepspeed_directory(path):
        raise NotZeroError(f"{path}: not a DeepSpeed checkpoint directory")
    files = zero_files(path, found)
    directory = files.tag_dir
    other_mp = sorted({mp for mp, _ in [*files.optim_states, *files.model_states]} - {0})
    if other_mp:
        raise InputError(
            f"{directory}: model-parallel rank(s) {other_mp}; ckpttool consolidates "
            "data-parallel ZeRO checkpoints (model-parallel rank 00 only)"
        )
    if not files.optim_states:
        raise NotZeroError(
            f"{directory}: DeepSpeed model states without *_optim_states.pt files: ZeRO stage 0 "
            "(the whole optimizer is in the model-states file, nothing is partitioned), or a "
            "tag whose optimizer files are missing",
            deepspeed=True,
        )
    optim = {dp: file for (_, dp), file in files.optim_states.items()}
    missing = [rank for rank in range(max(optim) + 1) if rank not in optim]
    if missing:
        raise InputError(
            f"{directory}: no optimizer states of data-parallel rank(s) {missing} "
            f"(zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt); the tag is incomplete"
        )
    model = {dp: file for (_, dp), file in files.model_states.items()}
    return ZeroTag(directory, [optim[r] for r in sorted(optim)], [model[r] for r in sorted(model)])


@dataclass(frozen=True)
class Piece:
    """``nbytes`` bytes from byte ``start`` of storage ``storage`` of rank file ``member``."""

    member: int  # index into the opened files
    storage: StorageRecord
    start: int
    nbytes: int
    dtype: str  # the element type stored there; cast to the tensor's dtype when it differs


@dataclass(frozen=True)
class ZeroStorageRecord(StorageRecord):
    """A consolidated tensor's bytes: the pieces of the rank files that hold them, in order."""

    pieces: tuple[Piece, ...] = field(default=(), compare=True)


@dataclass
class ZeroWeights:
    """What consolidation found out about the checkpoint (for reports and the universal writer)."""

    tag: ZeroTag
    stage: int
    dp_world_size: int
    tensors: dict[str, TensorRecord]  # consolidated, in zero_to_fp32's order (aliases included)
    aliases: dict[str, str]  # shared parameter -> the parameter it shares
    buffers: list[str]
    frozen: list[str]
    trainable: list[str]
    spans: dict[str, list[Span]]  # trainable parameter -> where its elements are, rank by rank
    model_state: dict[str, Any]  # rank 0's model-states tree (counters, scheduler, config)
    optimizer_states: list[dict[str, Any]]  # each rank's optimizer_state_dict tree


def stage_of(value: Any) -> int:
    """``zero_stage`` as an int: DeepSpeed pickles a ``ZeroStageEnum``."""
    if isinstance(value, OpaqueObject) and isinstance(value.args, tuple) and value.args:
        value = value.args[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptCheckpointError(f"zero_stage is {value!r}, not a ZeRO stage")
    return value


#: The training counters of a tag that ``diff`` compares (``model_states`` keys).
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")


def _view_facts(weights: ZeroWeights) -> ViewFacts:
    """What the consolidated view says of itself: the layout outputs report (the DeepSpeed
    checkpoint ``show`` names, ckpttool/model/vocabulary.py, though its tree is read as a state
    dict), the counters ``diff`` compares, and convert's note on what was consolidated."""
    counters = {key: weights.model_state[key] for key in COUNTERS if key in weights.model_state}
    ranks = weights.dp_world_size
    parts = [f"{len(weights.trainable)} trained parameters (fp32 master weights)"]
    if weights.frozen:
        parts.append(f"{len(weights.frozen)} frozen")
    if weights.buffers:
        parts.append(f"{len(weights.buffers)} buffers")
    note = (
        f"DeepSpeed ZeRO-{weights.stage} tag {weights.tag.name}, {ranks} data-parallel "
        f"rank{'s' if ranks != 1 else ''}: consolidated {', '.join(parts)}"
    )
    return ViewFacts(WEIGHTS_VIEW, DEEPSPEED, counters, (note,))


def open_zero_weights(path: str | os.PathLike[str], tag: ZeroTag | None = None) -> Any:
    """The consolidated fp32 state dict of the ZeRO checkpoint at ``path`` (whose files
    :func:`find_tag` found, when ``tag`` is given), as a Checkpoint.

    ``details["zero"]`` holds the :class:`ZeroWeights`, ``details["view"]`` the view's
    :class:`~ckpttool.frameworks.base.ViewFacts`. Errors name the file concerned."""

    if tag is None:
        tag = find_tag(path)
    opened = OpenedMembers()
    with opened.closed_on_error(tag.directory):
        for file in [*tag.optim_files, *tag.model_files]:
            opened.append(open_member(file))
        weights = _consolidate(tag, opened)

    def read(storage: StorageRecord, start: int, stop: int) -> bytearray:
        assert isinstance(storage, ZeroStorageRecord)
        return read_pieces(opened, storage, start, stop)

    parsed = Parsed(format=DIRECTORY, root=dict(weights.tensors), span=no_span,
                    read=read, close=opened.close,
                    unchanged=opened.check_unchanged)  # fmt: skip
    parsed.details.update({"layout": ZERO_FP32, "zero": weights, "view": _view_facts(weights)})
    size = sum(ckpt.file_size for ckpt in opened)
    return as_checkpoint(os.fspath(path), parsed, None, size)


def read_pieces(
    opened: Sequence[Any], storage: ZeroStorageRecord, start: int, stop: int
) -> bytearray:
    """Bytes ``[start, stop)`` of a consolidated tensor, read piece by piece (cast if needed)."""
    out = bytearray()
    itemsize = ITEMSIZE[storage.dtype]
    position = 0  # byte offset, in the tensor's dtype, of the current piece
    for piece in storage.pieces:
        scale = ITEMSIZE[piece.dtype] / itemsize  # source bytes per output byte
        length = int(piece.nbytes / scale)
        lo, hi = max(start, position), min(stop, position + length)
        if lo < hi:
            src_lo = piece.start + int((lo - position) * scale)
            src_hi = piece.start + int((hi - position) * scale)
            data = opened[piece.member].read_storage(piece.storage, src_lo, src_hi)
            out += data if piece.dtype == storage.dtype else _cast(data, piece.dtype, storage.dtype)
        position += length
        if position >= stop:
            break
    if len(out) != stop - start:
        raise CorruptCheckpointError(f"{storage.key}: its pieces hold fewer bytes than its shape")
    return out


#: NumPy's name of each dtype ``Tensor.float()`` widens here (bfloat16: ``cast.widen``).
_NUMPY = {"float16": "<f2", "float64": "<f8", "int8": "i1", "int16": "<i2", "int32": "<i4",
          "int64": "<i8", "uint8": "u1", "bool": "?"}  # fmt: skip


def _cast(data: bytearray, source: str, target: str) -> bytes:
    """``Tensor.float()`` of stored values: bfloat16 exactly (its bits are float32's top
    half), the others by NumPy's conversion (round to nearest, as torch's)."""
    if target != "float32":
        raise CorruptCheckpointError(f"cannot convert {source} to {target}")
    if source == "bfloat16":
        return widen(np.frombuffer(data, stored_dtype(source)), source).tobytes()
    if source in _NUMPY:
        return np.frombuffer(data, _NUMPY[source]).astype("<f4").tobytes()
    raise CorruptCheckpointError(f"cannot widen {source} to float32")


def _consolidate(tag: ZeroTag, opened: list[Any]) -> ZeroWeights:
    ranks = len(tag.optim_files)
    optim_states = [_section(ckpt, "optimizer_state_dict") for ckpt in opened[:ranks]]
    first = optim_states[0]
    stage = stage_of(first.get("zero_stage"))
    count = first.get("partition_count")
    world = max(count) if isinstance(count, list) else count
    if world != ranks:
        raise CorruptCheckpointError(
            f"{tag.directory}: the optimizer states record {world} data-parallel partitions but "
            f"{ranks} *_optim_states.pt files are there; a rank's file is missing or left from "
            "another run"
        )
    model_states = [ckpt.root for ckpt in opened[ranks:]]
    if stage == 3 and len(model_states) != ranks:
        raise CorruptCheckpointError(
            f"{tag.directory}: ZeRO-3 writes one model-states file per rank: {ranks} expected, "
            f"{len(model_states)} found"
        )
    model = model_states[0]
    for key in ("param_shapes", "buffer_names", "module"):
        if key not in model:
            raise CorruptCheckpointError(
                f"{tag.model_files[0]}: no {key!r}; not a ZeRO model state"
            )
    tensors: dict[str, TensorRecord] = {}
    buffers = _buffers(model, ranks, tensors)
    frozen = _frozen(stage, model_states, ranks, tensors)
    shapes = [{str(k): _shape(v) for k, v in group.items()} for group in model["param_shapes"]]
    if stage not in (1, 2, 3):
        raise CorruptCheckpointError(f"ZeRO stage {stage}: not a partitioned optimizer state")
    groups = [state.get(_fp32_key(stage)) for state in optim_states]
    if stage <= 2:
        paddings = first.get("param_alignment_paddings")
        spans = _zero2_spans(shapes, groups, paddings, world)
    else:
        spans = _zero3_spans(shapes, groups, world)
    weights = ZeroWeights(tag, stage, world, tensors, {}, buffers, frozen, list(spans), spans,
                          model, optim_states)  # fmt: skip
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            tensors[name] = pieced_record(
                name, "float32", shape, span_pieces(weights, spans[name], "fp32")
            )
    for alias, owner in (model.get("shared_params") or {}).items():
        if owner in tensors:
            tensors[str(alias)] = _with_key(tensors[owner], str(alias))
            weights.aliases[str(alias)] = str(owner)
    return weights


def _section(ckpt: Any, key: str) -> dict[str, Any]:
    value = ckpt.root.get(key) if isinstance(ckpt.root, dict) else None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{ckpt.name}: no {key!r}; not a ZeRO optimizer state")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, OpaqueObject):  # torch.Size pickled by an older torch
        value = value.args[0] if value.args else ()
    if not isinstance(value, (tuple, list)) or not all(isinstance(n, int) for n in value):
        raise CorruptCheckpointError(f"a parameter shape is {value!r}, not a list of sizes")
    return tuple(value)


def _with_key(record: TensorRecord, key: str) -> TensorRecord:
    from dataclasses import replace

    return replace(record, key=key)


def pieced_record(
    name: str, dtype: str, shape: tuple[int, ...], pieces: list[Piece]
) -> TensorRecord:
    numel = math.prod(shape)
    storage = ZeroStorageRecord(key=name, dtype=dtype, numel=numel, location="cpu",
                                record="zero:" + name, data_size=numel * ITEMSIZE[dtype],
                                pieces=tuple(pieces))  # fmt: skip
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return TensorRecord(key=name, dtype=dtype, shape=shape, stride=stride, storage_offset=0,
                        storage=storage, kind="parameter")  # fmt: skip


def _flat(record: Any, where: str) -> TensorRecord:
    if not isinstance(record, TensorRecord) or record.storage is None or not record.is_contiguous:
        raise CorruptCheckpointError(f"{where} is not a stored contiguous tensor")
    return record


def slice_piece(member: int, record: TensorRecord, first: int, count: int) -> Piece:
    """Elements ``[first, first + count)`` of a flat tensor record, as a piece."""
    assert record.storage is not None
    start = (record.storage_offset + first) * record.itemsize
    return Piece(member, record.storage, start, count * record.itemsize, record.dtype)


def _buffers(model: dict[str, Any], member: int, tensors: dict[str, TensorRecord]) -> list[str]:
    """The module's buffers, floating ones widened to float32 as ``zero_to_fp32`` does."""
    names = {str(n) for n in model.get("buffer_names") or []}
    out = []
    for name, value in model["module"].items():
        if name not in names:
            continue
        record = _flat(value, f"buffer {name}")
        dtype = "float32" if record.is_floating else record.dtype
        pieces = [slice_piece(member, record, 0, record.numel)] if record.numel else []
        tensors[name] = pieced_record(name, dtype, record.shape, pieces)
        out.append(name)
    return out


def _frozen(
    stage: int, model_states: list[dict[str, Any]], member: int, tensors: dict[str, TensorRecord]
) -> list[str]:
    """Frozen parameters: whole in the model-states file (ZeRO-1/2), or one padded fragment per
    rank's model-states file (ZeRO-3, ``member`` + rank). Their saved dtype is kept."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    out = []
    for name, shape_value in shapes.items():
        name, shape = str(name), _shape(shape_value)
        remaining = math.prod(shape)
        pieces, dtype = [], "float32"
        for rank, state in enumerate(model_states if stage == 3 else model_states[:1]):
            fragments = state.get("frozen_param_fragments") or {}
            fragment = _flat(fragments.get(name), f"frozen parameter {name}'s fragment")
            dtype = fragment.dtype
            take = min(remaining, fragment.numel)
            if take:
                pieces.append(slice_piece(member + rank, fragment, 0, take))
            remaining -= take
        if remaining:
            raise CorruptCheckpointError(f"frozen parameter {name}: its fragments are too short")
        tensors[name] = pieced_record(name, dtype, shape, pieces)
        out.append(name)
    return out


@dataclass(frozen=True)
class Span:
    """``count`` elements from element ``first`` of rank ``rank``'s flat group ``group``."""

    rank: int
    group: int
    first: int
    count: int


def state_record(weights: ZeroWeights, rank: int, group: int, key: str) -> TensorRecord:
    """Rank ``rank``'s flat tensor of group ``group`` for ``key``: ``fp32`` (the master
    weights' partition) or an optimizer state (``exp_avg``, ``exp_avg_sq``)."""
    state = weights.optimizer_states[rank]
    where = f"rank {rank}'s {key} of group {group}"
    try:
        if key == "fp32":
            return _flat(state[_fp32_key(weights.stage)][group], where)
        inner = state["base_optimizer_state" if weights.stage <= 2 else "optimizer_state_dict"]
        return _flat(inner["state"][group][key], where)
    except (KeyError, IndexError, TypeError):
        raise CorruptCheckpointError(f"{weights.tag.optim_files[rank]}: no {where}") from None


def span_pieces(weights: ZeroWeights, spans: Sequence[Span], key: str) -> list[Piece]:
    """The pieces of the rank files that hold ``spans`` of state ``key``."""
    pieces = []
    for span in spans:
        record = state_record(weights, span.rank, span.group, key)
        pieces.append(slice_piece(span.rank, record, span.first, span.count))
    return pieces


def _fp32_key(stage: int) -> str:
    return "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"


def _zero2_spans(
    shapes: list[dict[str, tuple[int, ...]]],
    groups: list[Any],
    paddings: Any,
    world: int,
) -> dict[str, list[Span]]:
    """ZeRO-1/2: group g is the ranks' partitions g concatenated; parameters follow in order,
    each followed by its ``param_alignment_paddings`` entry."""
    out: dict[str, list[Span]] = {}
    for rank, rank_groups in enumerate(groups):
        if not isinstance(rank_groups, list) or len(rank_groups) != len(shapes):
            raise CorruptCheckpointError(
                f"rank {rank}'s single_partition_of_fp32_groups does not hold {len(shapes)} groups"
            )
    for g, group_shapes in enumerate(shapes):
        parts = [_flat(groups[r][g], f"rank {r}'s fp32 partition {g}") for r in range(world)]
        bounds = np.cumsum([0] + [p.numel for p in parts]).tolist()
        group_paddings = paddings[g] if isinstance(paddings, list) else None
        if group_paddings is not None and len(group_paddings) != len(group_shapes):
            raise CorruptCheckpointError(
                f"param_alignment_paddings[{g}] has {len(group_paddings)} entries for "
                f"{len(group_shapes)} parameters"
            )
        offset = 0
        for index, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            if offset + numel > bounds[-1]:
                raise CorruptCheckpointError(
                    f"{name}: the fp32 partitions of group {g} end before it ({bounds[-1]} elements)"
                )
            spans = []
            for rank in range(world):
                lo, hi = max(offset, bounds[rank]), min(offset + numel, bounds[rank + 1])
                if lo < hi:
                    spans.append(Span(rank, g, lo - bounds[rank], hi - lo))
            out[name] = spans
            offset += numel + (int(group_paddings[index]) if group_paddings else 0)
        align = 2 * world
        if -(-offset // align) * align != -(-bounds[-1] // align) * align:
            raise CorruptCheckpointError(
                f"group {g}: the parameters take {offset} elements but the fp32 partitions hold "
                f"{bounds[-1]}; param_shapes and the partitions disagree"
            )
    return out


def _zero3_spans(
    shapes: list[dict[str, tuple[int, ...]]], groups: list[Any], world: int
) -> dict[str, list[Span]]:
    """ZeRO-3: each rank holds ceil(numel / world) elements of every parameter, in order, in
    its flat groups; a parameter is its ranks' slices concatenated, cut to numel."""
    flat = []
    for rank, rank_groups in enumerate(groups):
        if not isinstance(rank_groups, list) or not rank_groups:
            raise CorruptCheckpointError(f"rank {rank}'s fp32_flat_groups is not a list of tensors")
        flat.append([_flat(t, f"rank {rank}'s fp32 flat group {i}")
                     for i, t in enumerate(rank_groups)])  # fmt: skip
    sizes = [t.numel for t in flat[0]]
    if any([t.numel for t in rank_groups] != sizes for rank_groups in flat):
        raise CorruptCheckpointError("the ranks' fp32_flat_groups differ in size")
    bounds = np.cumsum([0, *sizes]).tolist()
    out: dict[str, list[Span]] = {}
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            per_rank = -(-numel // world)
            if offset + per_rank > bounds[-1]:
                raise CorruptCheckpointError(
                    f"{name}: the ranks' fp32 flat groups end before it ({bounds[-1]} elements)"
                )
            spans: list[Span] = []
            remaining = numel
            for rank in range(world):
                take = min(per_rank, remaining)
                for g in range(len(sizes)):
                    lo, hi = max(offset, bounds[g]), min(offset + take, bounds[g + 1])
                    if lo < hi:
                        spans.append(Span(rank, g, lo - bounds[g], hi - lo))
                remaining -= take
            out[name] = spans
            offset += per_rank
    if offset != bounds[-1]:
        raise CorruptCheckpointError(
            f"the parameters take {offset} elements of each rank's fp32 flat groups, which hold "
            f"{bounds[-1]}; param_shapes and the partitions disagree"
        )
    return out
