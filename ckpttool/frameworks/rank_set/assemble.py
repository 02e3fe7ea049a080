"""A rank set's global tensors, assembled from placement metadata (never by comparing values).

Each rank file holds, for a DTensor, its local piece and the spec: the device mesh's shape,
this rank's coordinate in it and one placement per mesh dimension. Where the piece lies in the
global tensor follows from those alone, by torch's own rule
(``Shard._local_shard_size_and_offset``: along the sharded dimension each of the ``n`` ranks
of a mesh dimension gets ``ceil(size / n)`` elements, the last ones fewer or none), mesh
dimension by mesh dimension, left to right. ``Replicate`` leaves the tensor whole on that mesh
dimension: the rank at coordinate 0 of every replicated mesh dimension is the one read, the
others are copies (``verify`` compares them). ``Partial`` pieces are addends of a pending
reduction: refused. A tensor that is no DTensor (FSDP2 leaves buffers whole) is replicated on
every rank: rank 0's is read.

The pieces must tile the global tensor exactly: every element covered once, each piece the
shape its placement gives. Reading a range of a global tensor assembles the whole tensor once
(one global tensor in memory at a time) from the pieces' bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import CorruptCheckpointError, InputError
from ckpttool.model.dtypes import ITEMSIZE
from ckpttool.model.records import (
    ChunkedStorageRecord,
    ChunkRecord,
    DTensorInfo,
    TensorRecord,
)


@dataclass(frozen=True)
class Piece:
    """One box of one rank's piece of a global tensor: where it lies in the global tensor
    (``offsets``, ``sizes``), where in the local tensor (``local_offsets``), and the record
    that holds it. A ``_StridedShard`` piece is several boxes; any other one box."""

    member: int  # index of the rank's file among the opened ones
    record: TensorRecord  # the local tensor, in that file
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...] = ()  # () : all zeros


Runs = tuple[tuple[int, int], ...]  # global index ranges [start, stop) of one tensor dim


def _take(runs: Runs, start: int, stop: int) -> Runs:
    """Positions ``[start, stop)`` of the index list ``runs`` stands for, as runs."""
    out = []
    position = 0
    for lo, hi in runs:
        length = hi - lo
        a, b = max(start, position), min(stop, position + length)
        if a < b:
            out.append((lo + a - position, lo + b - position))
        position += length
    return tuple(out)


def _merge(runs: Runs) -> Runs:
    out: list[tuple[int, int]] = []
    for lo, hi in runs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RankStorageRecord(ChunkedStorageRecord):
    """A global tensor's bytes: its pieces in the rank files (``chunks`` name them for
    ``show``), and the copies of them other ranks hold (``replicas``, for ``verify``)."""

    pieces: tuple[Piece, ...] = field(default=(), compare=False)
    replicas: tuple[tuple[Piece, Piece], ...] = field(default=(), compare=False)  # (copy, read)


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def placed(key: str, shape: tuple[int, ...], info: DTensorInfo) -> tuple[tuple[Runs, ...], bool]:
    """(runs, read): the global indices this rank's piece of ``key`` holds along each tensor
    dimension, by its placements (torch's ``_compute_local_shape_and_global_offset``), and
    whether it is the copy read (coordinate 0 on every replicated mesh dimension). A
    ShardedTensor's shard lies at the offsets it records."""
    if info.kinds and info.kinds[0][0] == "offsets":
        offsets = info.kinds[0][1]
        if len(offsets) != len(shape):
            raise CorruptCheckpointError(
                f"{key}: a shard's offsets {list(offsets)} for {list(shape)}"
            )
        return tuple(((o, o + n),) if n else () for o, n in zip(offsets, info.local.shape)), True
    if info.coordinate is None or len(info.coordinate) != len(info.mesh_shape):
        raise CorruptCheckpointError(
            f"{key}: the DTensor's device mesh does not record this rank's coordinate"
        )
    if len(info.kinds) != len(info.mesh_shape):
        raise CorruptCheckpointError(
            f"{key}: {len(info.kinds)} placements for a {len(info.mesh_shape)}-D device mesh"
        )
    runs: list[Runs] = [((0, n),) if n else () for n in shape]
    read = True
    for mesh_dim, kind in enumerate(info.kinds):
        count, index = info.mesh_shape[mesh_dim], info.coordinate[mesh_dim]
        if not 0 <= index < count:
            raise CorruptCheckpointError(f"{key}: mesh coordinate {index} of {count}")
        if kind[0] in ("shard", "strided_shard"):
            dim = kind[1] + len(shape) if kind[1] < 0 else kind[1]
            if not 0 <= dim < len(shape):
                raise CorruptCheckpointError(
                    f"{key}: {kind[0]} of dim {kind[1]} of a {len(shape)}-D tensor"
                )
            size = sum(hi - lo for lo, hi in runs[dim])
            if kind[0] == "shard":  # Shard._local_shard_size_and_offset
                chunk = -(-size // count)
                start = min(chunk * index, size)
                runs[dim] = _take(runs[dim], start, min(start + chunk, size))
            else:  # _StridedShard: split in split_factor parts, each part chunked by rank
                factor = kind[2]
                first = -(-size // factor)
                taken: list[tuple[int, int]] = []
                for split in range(factor):
                    lo, hi = min(first * split, size), min(first * (split + 1), size)
                    second = -(-(hi - lo) // count)
                    a = min(second * index, hi - lo)
                    b = min(second * (index + 1), hi - lo)
                    taken += _take(runs[dim], lo + a, lo + b)
                runs[dim] = _merge(tuple(taken))
        elif kind[0] == "replicate":
            read = read and index == 0
        elif kind[0] == "partial":
            raise InputError(
                f"{key}: a Partial({kind[1]}) placement on mesh dimension {mesh_dim}: each rank "
                "holds an addend of a reduction that was never done, not a piece of the tensor; "
                "ckpttool does not add them up. Save it after redistributing it to Replicate or "
                "Shard (DTensor.redistribute, or full_tensor())"
            )
        else:
            raise InputError(f"{key}: an unknown placement {kind[1]}: not assembled")
    return tuple(runs), read


def boxes(member: int, record: TensorRecord, runs: tuple[Runs, ...]) -> list[Piece]:
    """The boxes of a piece whose dimensions hold the global indices ``runs``: one box per
    combination of runs (one box unless a dimension is strided)."""
    from itertools import product

    if any(not r for r in runs):  # an empty piece: a box of no elements
        sizes = tuple(sum(hi - lo for lo, hi in r) for r in runs)
        return [Piece(member, record, tuple(0 for _ in runs), sizes)]
    per_dim = []
    for dim_runs in runs:
        local = 0
        spans = []
        for lo, hi in dim_runs:
            spans.append((local, lo, hi - lo))
            local += hi - lo
        per_dim.append(spans)
    return [
        Piece(
            member,
            record,
            tuple(c[1] for c in combo),
            tuple(c[2] for c in combo),
            tuple(c[0] for c in combo),
        )
        for combo in product(*per_dim)
    ]


def global_record(
    key: str, first: TensorRecord, pieces: list[Piece], copies: list[tuple[Piece, Piece]],
    files: list[str], placement: str,
) -> TensorRecord:  # fmt: skip
    """The global tensor ``key`` (shape and dtype of rank 0's record), read from ``pieces``."""
    shape = first.shape
    numel = math.prod(shape)
    chunks = tuple(ChunkRecord(files[p.member], 0, 0, p.offsets, p.sizes) for p in pieces)
    storage = RankStorageRecord(
        key=f"rank_set:{key}", dtype=first.dtype, numel=numel, location="cpu",
        record=f"rank_set:{key}", data_size=numel * ITEMSIZE.get(first.dtype, 1),
        chunks=chunks, shape=shape, placement=placement, pieces=tuple(pieces),
        replicas=tuple(copies),
    )  # fmt: skip
    return TensorRecord(
        key=key, dtype=first.dtype, shape=shape, stride=contiguous(shape), storage_offset=0,
        storage=storage, requires_grad=first.requires_grad, kind=first.kind,
    )  # fmt: skip


def tiling_problems(
    key: str, shape: tuple[int, ...], pieces: list[Piece], files: list[str]
) -> list[str]:
    """Why ``pieces`` do not tile the global tensor of ``shape`` exactly (empty: they do)."""
    problems = []
    expected: dict[tuple[int, int], list[int]] = {}  # a rank's piece -> its boxes' extent
    for piece in pieces:
        far = expected.setdefault((piece.member, id(piece.record)), [0] * len(piece.sizes))
        for dim, (lo, n) in enumerate(zip(piece.local_offsets or piece.offsets, piece.sizes)):
            far[dim] = max(far[dim], (lo if piece.local_offsets else 0) + n)
    for piece in pieces:
        want = tuple(expected[piece.member, id(piece.record)])
        if piece.record.shape != want:
            problems.append(
                f"{key}: {files[piece.member]} holds a piece of shape {list(piece.record.shape)}"
                f" where its placement puts {list(want)}"
            )
            expected[piece.member, id(piece.record)] = list(piece.record.shape)  # said once
        if piece.record.dtype != pieces[0].record.dtype:
            problems.append(f"{key}: {files[piece.member]} holds it as {piece.record.dtype}")
    if problems:
        return problems
    covered = sum(math.prod(p.sizes) for p in pieces)
    overlaps = [
        (a, b) for i, a in enumerate(pieces) for b in pieces[i + 1 :]
        if math.prod(a.sizes) and math.prod(b.sizes) and all(
            oa < ob + sb and ob < oa + sa
            for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes)
        )
    ]  # fmt: skip
    if overlaps:
        a, b = overlaps[0]
        problems.append(f"{key}: the pieces of {files[a.member]} and {files[b.member]} overlap")
    elif covered != math.prod(shape):
        problems.append(
            f"{key}: the ranks' pieces cover {covered} of its {math.prod(shape)} elements "
            f"(global shape {list(shape)}); a rank file is missing or from another run"
        )
    return problems


class Assembler:
    """Reads global tensors from the opened rank files, one whole tensor at a time."""

    def __init__(self, opened: list[Any]) -> None:
        self.opened = opened
        self._last: tuple[str, Any] | None = None  # the last tensor assembled, flat bytes

    def piece_array(self, piece: Piece) -> Any:
        from ckpttool.io.values import read_array

        return read_array(self.opened[piece.member], piece.record)

    def whole(self, storage: RankStorageRecord) -> Any:
        """The global tensor's bytes (a flat uint8 array), assembled once: ``convert`` reads a
        tensor in ranges, and only the last tensor is kept."""
        import numpy as np

        if self._last is not None and self._last[0] == storage.key:
            return self._last[1]
        self._last = None  # the previous tensor is let go before this one is assembled
        itemsize = ITEMSIZE.get(storage.dtype, 1)
        out = np.zeros((*storage.shape, itemsize), dtype=np.uint8)
        current: tuple[int, int] | None = None  # the rank piece being placed (its boxes follow
        found: Any = None  # one another), read once
        for piece in storage.pieces:
            if not math.prod(piece.sizes):
                continue
            if current != (piece.member, id(piece.record)):
                current = (piece.member, id(piece.record))
                found = None  # one rank's piece in memory besides the tensor
                local = np.ascontiguousarray(self.piece_array(piece))
                found = local.view(np.uint8).reshape((*piece.record.shape, itemsize))
            start = piece.local_offsets or tuple(0 for _ in piece.sizes)
            source = tuple(slice(o, o + s) for o, s in zip(start, piece.sizes))
            where = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
            out[where] = found[source]
        data = out.reshape(-1)
        self._last = (storage.key, data)
        return data

    def read(self, storage: Any, start: int, stop: int) -> bytearray:
        if not isinstance(storage, RankStorageRecord):
            raise CorruptCheckpointError(f"{storage.key}: not a rank set's tensor")
        return bytearray(self.whole(storage)[start:stop].tobytes())

    def replica_problems(self, key: str, storage: RankStorageRecord, files: list[str]) -> list[str]:
        """Copies that differ from the copy read (``verify``): byte for byte."""
        problems = []
        compared = set()
        for copy, original in storage.replicas:
            pair = (copy.member, id(copy.record), original.member, id(original.record))
            if pair in compared:  # a strided piece's other boxes: the same two arrays
                continue
            compared.add(pair)
            if self.piece_array(copy).tobytes() != self.piece_array(original).tobytes():
                problems.append(
                    f"{key}: replicated, but {files[copy.member]}'s copy differs from "
                    f"{files[original.member]}'s"
                )
        return problems
