"""The ``.metadata`` file of a torch.distributed.checkpoint (DCP) directory, read without torch.

DCP pickles one ``torch.distributed.checkpoint.metadata.Metadata``: ``state_dict_metadata`` maps
each flattened key (FQN) to a ``TensorStorageMetadata`` (dtype in ``properties``, global
``size``, ``chunks`` with their ``offsets``/``sizes``) or a ``BytesStorageMetadata`` (any other
value, stored as a small ``torch.save`` archive); ``storage_data`` maps a ``MetadataIndex`` (FQN
plus the chunk's offsets) to a ``_StorageInfo`` (file, offset, length); ``planner_data`` maps
each FQN to its path in the nested state dict (``("optimizer", "param_groups", 0, "lr")``).

The safe unpickler imports none of these classes: each arrives as an
:class:`~ckpttool.model.records.OpaqueObject` with its state. This module interprets those records by
class name and checks every field it uses, so a tampered file ends in a
:class:`~ckpttool.errors.CorruptCheckpointError` (or a listed problem), never in a crash, a huge
allocation or a read outside the checkpoint directory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeGuard

from ckpttool.errors import CorruptCheckpointError
from ckpttool.formats.dcp.pickle_records import IndexMeta, InfoMeta, TensorMeta
from ckpttool.model.records import ITEMSIZE, ChunkRecord, OpaqueObject

DCP_MODULE = "torch.distributed.checkpoint"
MAX_LIST_INDEX = 1 << 20  # a planner_data path indexes a list no longer than this
MAX_PAIRWISE = 512  # chunks of one tensor checked pairwise for overlaps
MAX_COUNT = 2**63 - 1  # torch counts sizes, offsets and bytes in int64
MAX_DIMS = 64  # torch's limit on a tensor's rank

Path_ = tuple[str | int, ...]  # a key's path in the nested state dict
_DTYPE_NAMES = {**{name: name for name in ITEMSIZE}, **{f"torch.{name}": name for name in ITEMSIZE}}


@dataclass(frozen=True, slots=True)
class StorageSpan:
    """Where one stored item (a chunk or a value) is: a byte range of one data file."""

    file: str  # relative to the directory, a plain name ("__0_0.distcp")
    offset: int
    length: int
    transforms: tuple[str, ...] = ()  # DCP's stream transforms (compression...), not read

    def __str__(self) -> str:
        return f"{self.file}@{self.offset}+{self.length}"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    fqn: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]  # the global shape
    requires_grad: bool
    chunks: tuple[ChunkRecord, ...]  # those with a storage record, in the metadata's order


@dataclass(frozen=True, slots=True)
class BytesEntry:
    fqn: str
    span: StorageSpan | None  # None when storage_data has no record for it


@dataclass
class DcpMetadata:
    entries: list[TensorEntry | BytesEntry]  # in the file's order
    paths: dict[str, Path_]  # planner_data: FQN -> path in the nested state dict
    version: str | None
    problems: list[str] = field(default_factory=list)

    @cached_property
    def files(self) -> list[str]:
        """Every data file some entry refers to, sorted."""
        return sorted({span.file for span in self.spans()})

    def spans(self) -> Iterator[StorageSpan]:
        """Every stored item's place (tensor chunks and values), in the metadata's order."""
        for entry in self.entries:
            if isinstance(entry, TensorEntry):
                yield from map(span_of, entry.chunks)
            elif entry.span is not None:
                yield entry.span

    def items(self) -> Iterator[tuple[str, StorageSpan]]:
        """Every stored item with a description, in the metadata's order (made as needed: at
        100,000 chunks a list of them was 50 MB)."""
        for entry in self.entries:
            if isinstance(entry, TensorEntry):
                for c in entry.chunks:
                    yield f"{entry.fqn} (chunk at {list(c.offsets)})", span_of(c)
            elif entry.span is not None:
                yield entry.fqn, entry.span


def span_of(chunk: ChunkRecord) -> StorageSpan:
    return StorageSpan(chunk.file, chunk.offset, chunk.length)


def _bad(what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"not a valid torch.distributed.checkpoint .metadata: {what}")


def _describe(node: Any) -> str:
    return node.cls if isinstance(node, OpaqueObject) else type(node).__name__


def _is(node: Any, name: str) -> bool:
    return (
        isinstance(node, OpaqueObject)
        and node.cls.startswith(DCP_MODULE + ".")
        and node.cls.rsplit(".", 1)[-1] == name
    )


def _state(node: Any, name: str) -> dict[str, Any]:
    """The fields of a DCP dataclass record named ``name`` (its pickled ``__dict__``)."""
    if not _is(node, name):
        raise _bad(f"expected a {name}, found {_describe(node)}")
    state = node.state if node.state is not None else {}
    if not isinstance(state, dict):
        raise _bad(f"a {name} with state of type {type(state).__name__}")
    return state


def _is_count(value: Any) -> TypeGuard[int]:
    """A size, offset or length as torch stores them: a non-negative int64."""
    return type(value) is int and 0 <= value <= MAX_COUNT


def _ints(value: Any, fqn: str, what: str, valid: dict[int, Any]) -> tuple[int, ...]:
    """``value`` if it is a shape or an offset torch can count. ``valid``: the tuples checked,
    by identity (the walker shares equal shapes; equality would take (1.0, True) for (1, 1))."""
    if valid.get(id(value)) is value:
        return value  # type: ignore[return-value]
    if not isinstance(value, tuple) or not all(_is_count(v) for v in value):
        raise _bad(f"{fqn}'s {what} is {value!r:.80}, not a tuple of non-negative int64s")
    if len(value) > MAX_DIMS or math.prod(value) > MAX_COUNT:
        raise _bad(f"{fqn}'s {what} {value!r:.80} has more elements than torch can count")
    valid[id(value)] = value
    return value


def _dtype(properties: Any, fqn: str) -> tuple[str, bool]:
    """(dtype name, requires_grad) from a TensorProperties record (tuple or dict state)."""
    if not _is(properties, "TensorProperties"):
        raise _bad(f"{fqn}: properties are a {_describe(properties)}")
    state = properties.state
    if isinstance(state, tuple) and state:  # __getstate__: (dtype, layout, requires_grad, ...)
        dtype, requires_grad = state[0], state[2] if len(state) > 2 else False
    elif isinstance(state, dict):
        dtype, requires_grad = state.get("dtype"), state.get("requires_grad", False)
    else:
        raise _bad(f"{fqn}: TensorProperties without a dtype")
    return _dtype_name(dtype, requires_grad, fqn)


def _dtype_name(dtype: Any, requires_grad: Any, fqn: str) -> tuple[str, bool]:
    # the name ITEMSIZE keys (one string per dtype, not one per tensor), "torch." or not
    name = _DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else None
    if name not in ITEMSIZE:
        raise _bad(f"{fqn}: unknown dtype {dtype!r:.40}")
    return name, bool(requires_grad)


def _span(info: Any, plain: set[str]) -> StorageSpan:
    if info.__class__ is InfoMeta:  # read by the walker's ``dcp_call``: no transforms
        return _checked_span(info.relative_path, info.offset, info.length, None, plain)
    state = _state(info, "_StorageInfo")
    return _checked_span(
        state.get("relative_path"), state.get("offset"), state.get("length"),
        state.get("transform_descriptors"), plain,
    )  # fmt: skip


def _checked_span(
    file: Any, offset: Any, length: Any, transforms: Any, plain: set[str]
) -> StorageSpan:
    """A checked span; ``plain``: the file names checked (a few, each named by every chunk)."""
    if file not in plain:
        if not isinstance(file, str) or file in ("", ".", "..") or any(c in file for c in "/\\\0"):
            raise _bad(f"a data file named {file!r:.80}: DCP names files inside its directory")
        plain.add(file)
    if not _is_count(offset) or not _is_count(length):
        raise _bad(f"{file}: a byte range with offset {offset!r:.40} length {length!r:.40}")
    if not transforms:  # None, or none listed: what DCP writes unless it compresses
        return StorageSpan(file, offset, length)
    if not isinstance(transforms, (list, tuple)):
        raise _bad(f"{file}: transform_descriptors is a {type(transforms).__name__}")
    return StorageSpan(file, offset, length, tuple(str(t) for t in transforms))


def _storage_index(storage_data: Any) -> dict[tuple[str, Any], StorageSpan]:
    """storage_data keyed by (fqn, chunk offsets) and (fqn, chunk index), as torch looks up."""
    if not isinstance(storage_data, dict):
        raise _bad(f"storage_data is a {type(storage_data).__name__}")
    index: dict[tuple[str, Any], StorageSpan] = {}
    plain: set[str] = set()
    for key, info in storage_data.items():
        if key.__class__ is IndexMeta:  # read by the walker's ``dcp_call``
            fqn, offset, position = key.fqn, key.offset, key.index
        else:
            state = _state(key, "MetadataIndex")
            fqn, offset, position = state.get("fqn"), state.get("offset"), state.get("index")
        if not isinstance(fqn, str):
            raise _bad(f"a MetadataIndex with fqn {fqn!r:.80}")
        span = _span(info, plain)
        index[(fqn, tuple(offset) if isinstance(offset, (tuple, list)) else None)] = span
        if isinstance(position, int):
            index.setdefault((fqn, position), span)
    return index


def _tensor_entry(
    fqn: str,
    node: Any,
    spans: dict[tuple[str, Any], StorageSpan],
    problems: list[str],
    valid: dict[int, Any],
) -> TensorEntry:
    if node.__class__ is TensorMeta:  # read by the walker's ``dcp_call``
        dtype, requires_grad = _dtype_name(node.dtype, node.requires_grad, fqn)
        shape = _ints(node.size, fqn, "size", valid)
        raw_chunks: Any = node.chunks
    else:
        state = _state(node, "TensorStorageMetadata")
        dtype, requires_grad = _dtype(state.get("properties"), fqn)
        shape = _ints(state.get("size"), fqn, "size", valid)
        raw_chunks = state.get("chunks")
        if not isinstance(raw_chunks, list):
            raise _bad(f"{fqn}: chunks is a {type(raw_chunks).__name__}")
        raw_chunks = (_chunk_fields(raw) for raw in raw_chunks)  # each checked in turn
    chunks = []
    for position, (raw_offsets, raw_sizes) in enumerate(raw_chunks):
        offsets = _ints(raw_offsets, fqn, "chunk offsets", valid)
        sizes = _ints(raw_sizes, fqn, "chunk sizes", valid)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _bad(f"{fqn}: a chunk of rank {len(sizes)} in a tensor of rank {len(shape)}")
        outside = (  # a whole-tensor chunk (the common case) is outside if it is offset
            any(offsets) if sizes == shape else any(map(_past, offsets, sizes, shape))
        )
        if outside:
            raise _bad(f"{fqn}: chunk at {list(offsets)} of shape {list(sizes)} is outside "
                       f"the tensor's shape {list(shape)}")  # fmt: skip
        span = spans.get((fqn, offsets)) or spans.get((fqn, position))
        if span is None:
            problems.append(f"{fqn}: the chunk at {list(offsets)} has no storage record")
            continue
        if span.transforms:
            problems.append(
                f"{fqn}: the chunk in {span.file} is stored through {list(span.transforms)} "
                "(compression or another DCP extension), which ckpttool does not read"
            )
            continue
        if math.prod(sizes) * ITEMSIZE[dtype] > span.length:
            problems.append(
                f"{fqn}: the chunk at {list(offsets)} needs {math.prod(sizes) * ITEMSIZE[dtype]:,}"
                f" bytes but its record in {span.file} has {span.length:,}"
            )
            continue
        chunks.append(ChunkRecord(span.file, span.offset, span.length, offsets, sizes))
    problems.extend(coverage_problems(fqn, shape, chunks))
    return TensorEntry(fqn, dtype, shape, requires_grad, tuple(chunks))


def _past(offset: int, size: int, bound: int) -> bool:
    return offset + size > bound


def _chunk_fields(node: Any) -> tuple[Any, Any]:
    state = _state(node, "ChunkStorageMetadata")
    return state.get("offsets"), state.get("sizes")


def coverage_problems(fqn: str, shape: tuple[int, ...], chunks: list[ChunkRecord]) -> list[str]:
    """The chunks must tile the tensor: no element missing, none stored twice.

    Overlaps are looked for among up to MAX_PAIRWISE chunks (a sweep, quadratic at worst);
    beyond that only the element count is checked.
    """
    if len(chunks) == 1 and chunks[0].sizes == shape:  # one chunk, the whole tensor (the caller
        return []  # refused one that is offset: it would reach outside the tensor)
    ordered = sorted(chunks, key=lambda c: c.offsets) if len(chunks) <= MAX_PAIRWISE else []
    for i, chunk in enumerate(ordered):
        for other in ordered[i + 1 :]:
            if shape and other.offsets[0] >= chunk.offsets[0] + chunk.sizes[0]:
                break  # sorted by the first dimension: no later chunk can overlap this one
            if chunk.numel and other.numel and _overlap(chunk, other):
                return [f"{fqn}: chunks at {list(chunk.offsets)} and {list(other.offsets)} "
                        "overlap"]  # fmt: skip
    stored = sum(chunk.numel for chunk in chunks)
    if stored != math.prod(shape):
        return [f"{fqn}: its chunks hold {stored:,} of its {math.prod(shape):,} elements "
                "(a shard is missing)"]  # fmt: skip
    return []


def _overlap(a: ChunkRecord, b: ChunkRecord) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa
        for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def _paths(planner_data: Any) -> dict[str, Path_]:
    if planner_data is None:
        return {}
    if not isinstance(planner_data, dict):
        raise _bad(f"planner_data is a {type(planner_data).__name__}")
    paths: dict[str, Path_] = {}
    for fqn, path in planner_data.items():
        valid = isinstance(path, tuple) and path and all(
            isinstance(p, str) or (type(p) is int and 0 <= p < MAX_LIST_INDEX) for p in path
        )  # fmt: skip
        if not isinstance(fqn, str) or not valid:
            raise _bad(f"planner_data maps {fqn!r:.60} to {path!r:.80}")
        paths[fqn] = path
    return paths


def parse_metadata(root: Any) -> DcpMetadata:
    """Interpret the unpickled ``.metadata`` tree. Raises CorruptCheckpointError."""
    state = _state(root, "Metadata")
    entries_in = state.get("state_dict_metadata")
    if not isinstance(entries_in, dict):
        raise _bad(f"state_dict_metadata is a {type(entries_in).__name__}")
    spans = _storage_index(state.get("storage_data"))
    problems: list[str] = []
    entries: list[TensorEntry | BytesEntry] = []
    valid: dict[int, Any] = {}  # shapes and offsets checked, by identity
    for fqn, node in entries_in.items():
        if not isinstance(fqn, str):
            raise _bad(f"a state dict key {fqn!r:.60}")
        if _is(node, "BytesStorageMetadata"):
            span = spans.get((fqn, None)) or spans.get((fqn, 0))
            if span is None:
                problems.append(f"{fqn}: the value has no storage record")
            entries.append(BytesEntry(fqn, span))
        else:
            entries.append(_tensor_entry(fqn, node, spans, problems, valid))
    version = state.get("version")
    return DcpMetadata(
        entries, _paths(state.get("planner_data")), version if isinstance(version, str) else None,
        problems,
    )  # fmt: skip


def set_element(root: dict[Any, Any], path: Path_, value: Any, fqn: str) -> None:
    """Put ``value`` at ``path``, creating dicts (str keys) and lists (int keys) on the way.

    The same rule as ``torch.distributed.checkpoint._traverse.set_element``, which
    ``dcp_to_torch_save`` uses, so the tree is the state dict torch would rebuild.
    """
    container: Any = root
    for key, following in itertools.pairwise(path):
        default: Any = {} if isinstance(following, str) else []
        if isinstance(container, dict):
            container = container.setdefault(key, default)
        elif isinstance(container, list) and isinstance(key, int):
            _extend(container, key)
            if container[key] is None:
                container[key] = default
            container = container[key]
        else:
            container = None
        if not isinstance(container, (dict, list)):
            break
    last = path[-1]
    if isinstance(container, list) and isinstance(last, int):
        _extend(container, last)
    elif not isinstance(container, dict):
        raise _bad(f"planner_data puts {fqn!r} at {list(path)}, inside another entry")
    container[last] = value


def _extend(items: list[Any], index: int) -> None:
    if len(items) <= index:
        items.extend([None] * (index + 1 - len(items)))


def nested_tree(meta: DcpMetadata, values: dict[str, Any]) -> dict[Any, Any]:
    """The nested state dict: each entry's value at its planner_data path (else at its FQN)."""
    root: dict[Any, Any] = {}
    for entry in meta.entries:
        set_element(root, meta.paths.get(entry.fqn, (entry.fqn,)), values[entry.fqn], entry.fqn)
    return root
