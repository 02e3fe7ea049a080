"""A legacy Megatron checkpoint folder (``mp_rank_XX[_YYY]/model_optim_rng.pt``) as one
checkpoint: the tensor-parallel shards of each parameter merged along its dimension, the
pipeline stages' layers renumbered to global layer numbers.

Each file is Megatron-LM's ``save_checkpoint`` dict (``args``, ``checkpoint_version``,
``iteration``, ``model``, ``optimizer``, ``rng_state``...) of one (tensor, pipeline) rank. How a
parameter is split follows from the layer that owns it (megatron-core's
``tensor_parallel/layers.py``, and the legacy model's names):

* column-parallel (``ColumnParallelLinear``, ``VocabParallelEmbedding``): weight and bias split
  along dimension 0: ``linear_qkv``/``query_key_value``, ``linear_fc1``/``dense_h_to_4h``,
  ``word_embeddings``, ``output_layer``; with a gated linear unit (``args.swiglu`` or
  ``gated_linear_unit``) each rank's ``linear_fc1`` rows are its gate half then its up half,
  placed in the gate and up halves of the whole;
* row-parallel (``RowParallelLinear``): weight split along dimension 1: ``linear_proj``/
  ``dense`` (attention output), ``linear_fc2``/``dense_4h_to_h``; its bias is whole on every
  rank;
* anything else (norms, position embeddings, the fused ``layer_norm_weight``) is whole on every
  tensor rank: rank 0's is read, ``verify`` compares the others byte for byte.

Pipeline stage ``p`` numbers its layers from 0; their global numbers start after the layers of
the stages before it. A tensor outside the layers held by several stages (the output layer's
copy of a shared embedding) is read from the first.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import CorruptCheckpointError
from ckpttool.formats.base import Parsed, no_span
from ckpttool.formats.registry import as_checkpoint
from ckpttool.frameworks.base import FrameworkDirectory, OpenedMembers, open_member
from ckpttool.frameworks.megatron.dist import SUMMARY, summary_of
from ckpttool.frameworks.megatron.files import SHARD_FILE, Found, LegacyShards
from ckpttool.frameworks.tree import DIRECTORY, layout_details
from ckpttool.io.source import join
from ckpttool.model.dtypes import ITEMSIZE
from ckpttool.model.records import ChunkedStorageRecord, ChunkRecord, TensorRecord

COLUMN = frozenset({
    "linear_qkv", "query_key_value", "linear_fc1", "dense_h_to_4h", "word_embeddings",
    "output_layer", "linear_q", "linear_kv", "query", "key_value",
})  # fmt: skip
ROW = frozenset({"linear_proj", "dense", "linear_fc2", "dense_4h_to_h"})
GLU = frozenset({"linear_fc1", "dense_h_to_4h"})
LAYER = re.compile(r"^(.*?(?:^|\.)layers)\.(\d+)\.(.+)$")
#: Parts of the dict that are per rank and not merged (listed in show's note).
PER_RANK = ("optimizer", "rng_state", "opt_param_scheduler")


@dataclass(frozen=True)
class Piece:
    member: int  # index of the shard among the opened files
    record: TensorRecord
    offsets: tuple[int, ...]  # where it goes in the whole tensor
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]  # where it starts in the shard's tensor


@dataclass(frozen=True, slots=True)
class MergedStorageRecord(ChunkedStorageRecord):
    """A parameter's bytes, assembled from the tensor-parallel shards' pieces."""

    pieces: tuple[Piece, ...] = field(default=(), compare=False)
    copies: tuple[Piece, ...] = field(default=(), compare=False)  # replicas, for verify


def split_dim(key: str, glu: bool) -> tuple[int | None, bool]:
    """(the dimension the tensor ranks split ``key`` along, None: whole on each; whether its
    rows are gate and up halves)."""
    parts = key.split(".")
    if len(parts) < 2:
        return None, False
    module, param = parts[-2], parts[-1]
    if module in COLUMN and param in ("weight", "bias"):
        return 0, glu and module in GLU
    if module in ROW and param == "weight":
        return 1, False
    return None, False


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                out.update(flatten(value, name + "."))
            else:
                out[name] = value
    return out


def open_legacy(layout: FrameworkDirectory, *, strict: bool, refuse_dangerous: bool) -> Any:
    found = layout.found
    assert isinstance(found, Found) and found.shards is not None
    shards = found.shards
    if layout.missing and strict:
        raise CorruptCheckpointError(
            f"{layout.directory}: {layout.missing[0]} is missing: the merged tensors need every "
            f"tensor rank's shard of every pipeline stage ({shards.tensor_parallel} x "
            f"{shards.pipeline_parallel})"
        )
    if layout.problems and strict:
        raise CorruptCheckpointError(f"{layout.directory}: {layout.problems[0]}")
    order = sorted(shards.files, key=lambda tp_pp: (tp_pp[1], tp_pp[0]))
    names = [shards.files[k] for k in order]
    opened = OpenedMembers()
    with opened.closed_on_error(layout.directory):
        for name in names:
            opened.append(open_member(join(layout.directory, name), strict=strict,
                                      refuse_dangerous=refuse_dangerous))  # fmt: skip
        missing = _missing_by_args(opened[0].root, shards)
        if missing and strict:
            raise CorruptCheckpointError(
                f"{layout.directory}: {missing[0]} is missing: args of "
                f"{names[0]} say the save had more ranks than the folders hold"
            )
        layout.missing = sorted(set(layout.missing) | set(missing))
        layout.complete = not layout.missing
        root, summary, problems = _merge(opened, names, order, shards.tensor_parallel)
        problems = list(layout.problems) + problems
        if problems and strict:
            raise CorruptCheckpointError(problems[0])
        assembler = _Assembler(opened)
        if not strict:
            problems += assembler.replica_problems(root.get("model", {}), names)

    details = layout_details(layout)
    details[SUMMARY] = summary
    parsed = Parsed(format=DIRECTORY, root=root, span=no_span, details=details,
                    problems=problems, read=assembler.read, close=opened.close,
                    unchanged=opened.check_unchanged)  # fmt: skip
    return as_checkpoint(layout.directory, parsed, None, sum(c.file_size for c in opened))


def _missing_by_args(first: Any, shards: LegacyShards) -> list[str]:
    """The shard files ``args`` (tensor and pipeline parallel sizes) say the save wrote that
    are not there: a whole ``mp_rank`` folder gone leaves no name behind."""
    args = first.get("args") if isinstance(first, dict) else None
    if not isinstance(args, dict):
        return []
    tensor = args.get("tensor_model_parallel_size")
    pipeline = args.get("pipeline_model_parallel_size")
    tensor = tensor if isinstance(tensor, int) and tensor > 0 else shards.tensor_parallel
    pipeline = pipeline if isinstance(pipeline, int) and pipeline > 0 else shards.pipeline_parallel
    pipelined = shards.pipelined or pipeline > 1
    return [
        (f"mp_rank_{tp:02d}_{pp:03d}" if pipelined else f"mp_rank_{tp:02d}") + f"/{SHARD_FILE}"
        for pp in range(pipeline)
        for tp in range(tensor)
        if (tp, pp) not in shards.files
    ]


def _merge(
    opened: list[Any], names: list[str], order: list[tuple[int, int]], tensor_parallel: int
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    problems: list[str] = []
    trees = []
    for name, ckpt in zip(names, opened):
        if not isinstance(ckpt.root, dict) or not isinstance(ckpt.root.get("model"), dict):
            raise CorruptCheckpointError(f"{name}: not a Megatron save (no 'model' dict)")
        trees.append(ckpt.root)
    first = trees[0]
    iterations = {t.get("iteration") for t in trees}
    if len(iterations) > 1:
        problems.append(
            f"the shards are of different iterations ({sorted(map(str, iterations))}): "
            "files of several saves mixed"
        )
    found_args = first.get("args")
    args: dict[str, Any] = found_args if isinstance(found_args, dict) else {}
    glu = bool(args.get("swiglu") or args.get("gated_linear_unit"))
    stages = sorted({pp for _, pp in order})
    # global layer offset of each stage: the layers of the stages before it (tensor rank 0)
    offsets: dict[int, int] = {}
    total = 0
    for stage in stages:
        offsets[stage] = total
        member = order.index((0, stage)) if (0, stage) in order else None
        numbers = set()
        if member is not None:
            for key in flatten(trees[member]["model"]):
                match = LAYER.match(key)
                if match:
                    numbers.add(int(match[2]))
        total += max(numbers) + 1 if numbers else 0
    by_key: dict[str, dict[int, tuple[int, TensorRecord]]] = {}  # key -> tp -> (member, record)
    others: dict[str, Any] = {}
    seen_stage: dict[str, int] = {}
    for member, ((tp, pp), tree) in enumerate(zip(order, trees)):
        for key, value in flatten(tree["model"]).items():
            match = LAYER.match(key)
            if match:
                key = f"{match[1]}.{int(match[2]) + offsets[pp]}.{match[3]}"
            if not isinstance(value, TensorRecord):
                others.setdefault(key, value)
                continue
            if seen_stage.setdefault(key, pp) != pp:
                continue  # a copy on a later stage (a shared embedding's): the first is read
            by_key.setdefault(key, {})[tp] = (member, value)
    model: dict[str, Any] = {}
    split_count = {0: 0, 1: 0, None: 0}
    for key, ranks in by_key.items():
        if sorted(ranks) != list(range(tensor_parallel)):
            problems.append(f"{key}: held by tensor ranks {sorted(ranks)} of {tensor_parallel}")
            continue
        dim, gated = split_dim(key, glu)
        try:
            model[key] = _merged(key, [ranks[r] for r in range(tensor_parallel)], dim, gated, names)
            split_count[dim] += 1
        except CorruptCheckpointError as error:
            problems.append(str(error))
    root: dict[str, Any] = {k: v for k, v in first.items() if k not in ("model", *PER_RANK)}
    root["model"] = model
    summary = summary_of(first, names[0])
    vocab = _vocabulary(model, args, tensor_parallel)
    summary["merged"] = [
        f"{len(by_key)} tensors from {len(names)} shards: {split_count[0]} column-parallel "
        f"(dim 0), {split_count[1]} row-parallel (dim 1), {split_count[None]} whole on each "
        "tensor rank",
        *([f"{total} layers renumbered across {len(stages)} pipeline stages"] if len(stages) > 1 else []),
        *([vocab] if vocab else []),
    ]  # fmt: skip
    kept = [part for part in PER_RANK if part in first]
    summary["notes"] = (
        [f"{', '.join(kept)}: per rank, not merged (each shard file holds its own)"]
        if kept else []
    )  # fmt: skip
    return root, summary, problems


def _vocabulary(model: dict[str, Any], args: dict[str, Any], tensor_parallel: int) -> str:
    for key, record in model.items():
        if key.endswith("word_embeddings.weight") and record.shape:
            rows = record.shape[0]
            padded = args.get("padded_vocab_size")
            multiple = args.get("make_vocab_size_divisible_by")
            how = (
                f", a multiple of make_vocab_size_divisible_by {multiple} x tensor parallel "
                f"{tensor_parallel}"
                if isinstance(multiple, int)
                else ""
            )
            said = f" (args.padded_vocab_size {padded})" if padded is not None else ""
            return (
                f"vocabulary: {rows} embedding rows{said}{how}: padded, the rows past the "
                "tokenizer's vocabulary are not trained"
            )
    return ""


def _merged(
    key: str, ranks: list[tuple[int, TensorRecord]], dim: int | None, gated: bool, names: list[str]
) -> TensorRecord:
    member0, first = ranks[0]
    local = first.shape
    for member, record in ranks:
        if record.dtype != first.dtype:
            raise CorruptCheckpointError(f"{key}: {names[member]} holds it as {record.dtype}")
        if dim is None or dim >= len(local):
            if record.shape != local:
                raise CorruptCheckpointError(
                    f"{key}: whole on each tensor rank, but {names[member]} holds "
                    f"{list(record.shape)} and {names[member0]} {list(local)}"
                )
        elif record.shape[:dim] + record.shape[dim + 1 :] != local[:dim] + local[dim + 1 :]:
            raise CorruptCheckpointError(
                f"{key}: the tensor ranks' pieces {list(record.shape)} and {list(local)} do not "
                f"tile along dimension {dim}"
            )
    if dim is None or dim >= len(local):
        whole = tuple(0 for _ in local)
        pieces = [Piece(member0, first, whole, local, whole)]
        copies = [Piece(m, r, whole, local, whole) for m, r in ranks[1:]]
        shape = local
        how = "whole on each tensor rank"
    else:
        pieces = []
        start = 0
        count = len(ranks)
        total = sum(r.shape[dim] for _, r in ranks)
        for member, record in ranks:
            size = record.shape[dim]
            if gated and size % 2 == 0 and total % 2 == 0:  # gate half, then up half
                half = size // 2
                for part, base in ((0, start // 2), (1, total // 2 + start // 2)):
                    pieces.append(_box(member, record, dim, base, half, part * half))
            else:
                pieces.append(_box(member, record, dim, start, size, 0))
            start += size
        copies = []
        shape = (*local[:dim], total, *local[dim + 1 :])
        how = f"split along dim {dim} by {count} tensor ranks" + (" (gate, up)" if gated else "")
    numel = math.prod(shape)
    chunks = tuple(ChunkRecord(names[p.member], 0, 0, p.offsets, p.sizes) for p in pieces)
    storage = MergedStorageRecord(
        key=f"megatron:{key}", dtype=first.dtype, numel=numel, location="cpu",
        record=f"megatron:{key}", data_size=numel * ITEMSIZE.get(first.dtype, 1), chunks=chunks,
        shape=shape, placement=how, pieces=tuple(pieces), copies=tuple(copies),
    )  # fmt: skip
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return TensorRecord(
        key=key, dtype=first.dtype, shape=shape, stride=stride, storage_offset=0,
        storage=storage, requires_grad=first.requires_grad, kind=first.kind,
    )  # fmt: skip


def _box(member: int, record: TensorRecord, dim: int, at: int, size: int, local: int) -> Piece:
    offsets = tuple(at if d == dim else 0 for d in range(len(record.shape)))
    sizes = tuple(size if d == dim else n for d, n in enumerate(record.shape))
    starts = tuple(local if d == dim else 0 for d in range(len(record.shape)))
    return Piece(member, record, offsets, sizes, starts)


class _Assembler:
    """Reads merged tensors from the shard files, one whole tensor at a time."""

    def __init__(self, opened: list[Any]) -> None:
        self.opened = opened
        self._last: tuple[str, Any] | None = None

    def _array(self, piece: Piece) -> Any:
        import numpy as np

        from ckpttool.io.values import read_array

        return np.ascontiguousarray(read_array(self.opened[piece.member], piece.record))

    def whole(self, storage: MergedStorageRecord) -> Any:
        import numpy as np

        if self._last is not None and self._last[0] == storage.key:
            return self._last[1]
        self._last = None
        itemsize = ITEMSIZE.get(storage.dtype, 1)
        out = np.zeros((*storage.shape, itemsize), dtype=np.uint8)
        for piece in storage.pieces:
            local = self._array(piece).view(np.uint8).reshape((*piece.record.shape, itemsize))
            source = tuple(slice(o, o + s) for o, s in zip(piece.local_offsets, piece.sizes))
            where = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
            out[where] = local[source]
        data = out.reshape(-1)
        self._last = (storage.key, data)
        return data

    def read(self, storage: Any, start: int, stop: int) -> bytearray:
        if not isinstance(storage, MergedStorageRecord):
            raise CorruptCheckpointError(f"{storage.key}: not a merged Megatron tensor")
        return bytearray(self.whole(storage)[start:stop].tobytes())

    def replica_problems(self, model: dict[str, Any], names: list[str]) -> list[str]:
        """Tensors whole on each tensor rank whose copies differ (``verify``)."""
        problems = []
        for key, record in model.items():
            storage = record.storage
            if not isinstance(storage, MergedStorageRecord) or not storage.copies:
                continue
            read = self._array(storage.pieces[0]).tobytes()
            for copy in storage.copies:
                if self._array(copy).tobytes() != read:
                    problems.append(
                        f"{key}: whole on each tensor rank, but {names[copy.member]}'s copy "
                        f"differs from {names[storage.pieces[0].member]}'s"
                    )
        return problems
