"""The values side of ``--map`` (``edit``, ``convert``, ``diff``): the records of the tensors a
map's rules compute (transpose, concat, split, the rotary q/k permutations) and the producers
of their bytes, and a checkpoint that reads them as if the file held them.

A computed tensor is a record over a storage of its own whose key starts with
:data:`MAP_PREFIX`; its bytes are made when first read, from its sources' elements (one tensor
at a time: the last one made is kept, so that reading it in chunks computes it once). The
operations only move elements, so they work on the elements' bits (unsigned integers of the
element size): any dtype and byte order, nothing rounded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.errors import InputError
from ckpttool.io.source import is_url
from ckpttool.model.edits import plain_record
from ckpttool.model.mapping import MapSpec, Step, plan
from ckpttool.model.records import ITEMSIZE, StorageRecord, TensorRecord

#: Storage keys of the tensors a map computes (never a key a file uses).
MAP_PREFIX = "\0map\0"
#: A record's elements as a NumPy array of unsigned integers of its element size, shaped and
#: strided as the tensor.
Values = Callable[[TensorRecord], Any]
Produce = Callable[[], bytes]


def mapped_records(
    step: Step,
    records: list[TensorRecord],
    spec: MapSpec,
    derived: dict[str, Produce],
    values: Values,
    decode: Callable[[TensorRecord], Any] | None = None,
) -> list[TensorRecord]:
    """The records ``step`` (not a rename) makes from ``records``, each over a new storage whose
    producer is added to ``derived``; shapes are checked now, before anything is read.
    ``decode``: how tensors quantized in blocks (GGUF's Q8_0...) give their float32 values;
    with it, such sources make float32 tensors (without it they are refused)."""
    rule = step.rule
    blocks = [r.quant is not None and r.quant.in_blocks for r in records]
    if decode is not None and all(blocks):
        values = _decoded(decode)
        dtype = "float32"
    else:
        dtypes = {r.dtype for r in records}
        if len(dtypes) != 1 or any(not plain_record(r) for r in records):
            raise InputError(
                f"--map {spec.name}: {', '.join(step.sources)} must be plain tensors of one "
                "dtype" + (" (or, decoded, all quantized in blocks: with --dequantize)"
                           if any(blocks) else "")
            )  # fmt: skip
        dtype = records[0].dtype
    shapes: list[tuple[int, ...]] = [tuple(r.shape) for r in records]
    if rule.op == "transpose":
        if len(shapes[0]) != 2:
            raise InputError(f"--map {spec.name}: transpose takes a 2-D tensor, not {shapes[0]}")
        out_shapes: list[tuple[int, ...]] = [shapes[0][::-1]]
    elif rule.op in ("rope_to_hf", "rope_to_meta"):
        heads = spec.params[rule.heads or ""]
        if len(shapes[0]) not in (1, 2) or shapes[0][0] % (2 * heads):
            raise InputError(
                f"--map {spec.name}: {step.sources[0]} {list(shapes[0])} does not split into "
                f"{heads} heads of pairs"
            )
        out_shapes = [shapes[0]]
    elif rule.op == "split_qkv":
        q, kv, others = _qkv_rows(step, shapes[0], spec)
        out_shapes = [(q, *others), (kv, *others), (kv, *others)]
    elif rule.op == "concat_qkv":
        out_shapes = [_qkv_shape(step, shapes, spec)]
    elif rule.op == "concat":
        dim = rule.dim
        rest = {s[:dim] + s[dim + 1 :] for s in shapes}
        if len(rest) != 1 or any(len(s) <= dim for s in shapes):
            raise InputError(f"--map {spec.name}: {step.sources} do not concatenate on dim {dim}")
        total = sum(s[dim] for s in shapes)
        out_shapes = [(*shapes[0][:dim], total, *shapes[0][dim + 1 :])]
    else:  # split
        dim = rule.dim
        sizes = _sizes(rule, shapes[0], spec)
        if (
            len(shapes[0]) <= dim or sum(sizes) != shapes[0][dim]
            or len(sizes) != len(step.targets)
        ):  # fmt: skip
            raise InputError(
                f"--map {spec.name}: {step.sources[0]} {list(shapes[0])} does not split into "
                f"{sizes} on dim {dim}"
            )
        out_shapes = [(*shapes[0][:dim], n, *shapes[0][dim + 1 :]) for n in sizes]
    byteorder = (
        "little"
        if dtype != records[0].dtype or records[0].storage is None
        else (records[0].storage.byteorder)
    )
    made = []
    for index, (target, shape) in enumerate(zip(step.targets, out_shapes)):
        key = f"{MAP_PREFIX}{target}"
        numel = math.prod(shape)
        storage = StorageRecord(key, dtype, numel, "cpu", key, numel * ITEMSIZE[dtype], byteorder)
        derived[key] = _producer(rule, records, index, spec, values)
        # named by where its values are (one source), or by what it is (a concatenation)
        name = target if rule.op in ("concat", "concat_qkv") else step.sources[0]
        made.append(TensorRecord(name, dtype, shape, contiguous(shape), 0, storage))
    return made


def _producer(
    rule: Any, records: list[TensorRecord], index: int, spec: MapSpec, values: Values
) -> Produce:
    def produce() -> bytes:
        import numpy as np

        arrays = [values(r) for r in records]
        if rule.op == "transpose":
            out = arrays[0].T
        elif rule.op in ("rope_to_hf", "rope_to_meta"):
            w = arrays[0]
            heads = spec.params[rule.heads]
            rows = w.shape[0]
            flat = w.reshape(rows, -1)
            if rule.op == "rope_to_hf":  # rows (head, pair, 2) -> (head, 2, pair)
                out = flat.reshape(heads, rows // heads // 2, 2, -1).transpose(0, 2, 1, 3)
            else:  # rows (head, 2, pair) -> (head, pair, 2)
                out = flat.reshape(heads, 2, rows // heads // 2, -1).transpose(0, 2, 1, 3)
            out = out.reshape(w.shape)
        elif rule.op == "split_qkv":  # rows (group, [q heads, k, v], head_dim)
            w = arrays[0]
            heads, groups = spec.params[rule.heads], spec.params[rule.groups]
            grouped = w.reshape(groups, heads // groups + 2, -1, *w.shape[1:])
            per = heads // groups
            part = [grouped[:, :per], grouped[:, per : per + 1], grouped[:, per + 1 :]][index]
            out = part.reshape(-1, *w.shape[1:])
        elif rule.op == "concat_qkv":
            heads, groups = spec.params[rule.heads], spec.params[rule.groups]
            rest = arrays[0].shape[1:]
            parts = [a.reshape(groups, -1, arrays[1].shape[0] // groups, *rest) for a in arrays]
            out = np.concatenate(parts, axis=1).reshape(-1, *rest)
        elif rule.op == "concat":
            out = np.concatenate(arrays, axis=rule.dim)
        else:
            sizes = _sizes(rule, arrays[0].shape, spec)
            bounds = np.cumsum([0, *sizes])
            out = np.take(arrays[0], range(bounds[index], bounds[index + 1]), axis=rule.dim)
        return np.ascontiguousarray(out).tobytes()

    return produce


def _sizes(rule: Any, shape: tuple[int, ...], spec: MapSpec) -> list[int]:
    """A split's sizes along its dim: its rule's (ints or params' values), or equal parts."""
    if not rule.sizes:
        parts = len(rule.targets)
        whole = shape[rule.dim] if len(shape) > rule.dim else 0
        return [whole // parts] * parts if whole % parts == 0 else [whole]
    return [spec.params[s] if isinstance(s, str) else s for s in rule.sizes]


def _qkv_rows(
    step: Step, shape: tuple[int, ...], spec: MapSpec
) -> tuple[int, int, tuple[int, ...]]:
    """A fused QKV tensor's rows for q and for each of k and v, and its other dims; an error
    unless its rows are ``groups`` x (``heads / groups`` + 2) heads of one size."""
    heads, groups = spec.params[step.rule.heads or ""], spec.params[step.rule.groups or ""]
    rows = shape[0] if shape else 0
    per = heads // groups if heads % groups == 0 else 0
    if not per or not rows or rows % (groups * (per + 2)):
        raise InputError(
            f"--map {spec.name}: {step.sources[0]} {list(shape)} does not split into {groups} "
            f"query groups of {per or heads / groups} query heads, a key and a value head"
        )
    head = rows // (groups * (per + 2))
    return heads * head, groups * head, tuple(shape[1:])


def _qkv_shape(step: Step, shapes: list[tuple[int, ...]], spec: MapSpec) -> tuple[int, ...]:
    """``concat_qkv``'s shape from q's, k's and v's (checked)."""
    heads, groups = spec.params[step.rule.heads or ""], spec.params[step.rule.groups or ""]
    q, k, v = shapes
    ok = (
        len(q) >= 1 and k == v and q[1:] == k[1:] and heads % groups == 0
        and k[0] % groups == 0 and q[0] == k[0] // groups * heads
    )  # fmt: skip
    if not ok:
        raise InputError(
            f"--map {spec.name}: {', '.join(step.sources)} {[list(s) for s in shapes]} are not "
            f"{heads} query heads and {groups} key and value heads of one size"
        )
    return (q[0] + 2 * k[0], *q[1:])


def _decoded(decode: Callable[[TensorRecord], Any]) -> Values:
    """:data:`Values` of tensors quantized in blocks: their float32 values' bits."""

    def values(record: TensorRecord) -> Any:
        import numpy as np

        return np.ascontiguousarray(decode(record), dtype="<f4").view("<u4")

    return values


def strided(record: TensorRecord, data: bytes | bytearray, first: int) -> Any:
    """``record``'s elements in ``data`` (whose element ``first`` is its first) as unsigned
    integers of its element size, shaped and strided as the tensor (a view, not a copy)."""
    import numpy as np

    held = np.dtype(f"<u{record.itemsize}")
    return np.lib.stride_tricks.as_strided(
        np.frombuffer(data, dtype=held, offset=first * record.itemsize),
        shape=record.shape,
        strides=[s * record.itemsize for s in record.stride],
    )


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


@dataclass
class DerivedCheckpoint(Checkpoint):
    """A checkpoint that also reads the storages ``derived`` computes (a map's tensors), as if
    the file held them; everything else is the checkpoint it was made from (same file handle:
    closing that one is enough)."""

    derived: dict[str, Produce] = field(default_factory=dict, repr=False)
    _made: tuple[str, bytes] | None = field(default=None, repr=False)  # the last one made

    @property
    def parallel_reads(self) -> bool:
        """One thread at a time once a map computes tensors (:attr:`_made` is shared)."""
        return not self.derived and super().parallel_reads

    def read_storage(
        self, storage: StorageRecord, start: int, stop: int, key: str = ""
    ) -> bytearray:
        producer = self.derived.get(storage.key)
        if producer is None:
            return super().read_storage(storage, start, stop, key)
        if self._made is None or self._made[0] != storage.key:
            self._made = None  # the previous one is freed before the next is made
            self._made = (storage.key, producer())
        return bytearray(self._made[1][start:stop])

    def file_span(self, record: TensorRecord) -> tuple[int, int] | None:
        if record.storage is not None and record.storage.key in self.derived:
            return None
        return super().file_span(record)

    def prefetch(self, record: TensorRecord) -> None:
        if record.storage is None or record.storage.key not in self.derived:
            super().prefetch(record)

    def resolve_spans(self, storages: list[StorageRecord]) -> None:
        super().resolve_spans([s for s in storages if s.key not in self.derived])

    def element_values(self, record: TensorRecord) -> Any:
        """:data:`Values` of a record of this checkpoint."""
        data, first = self.read_bytes(record)
        return strided(record, data, first)


def with_derived(ckpt: Checkpoint, root: Any = None) -> DerivedCheckpoint:
    """``ckpt`` as a :class:`DerivedCheckpoint` (``root``: with that tree instead, such as the
    one ``--use-ema`` makes); ``ckpt`` itself stays the one to close."""
    if isinstance(ckpt, DerivedCheckpoint) and root is None:
        return ckpt
    made = DerivedCheckpoint(**{f.name: getattr(ckpt, f.name) for f in fields(Checkpoint)})
    if root is not None:
        made.root, made._all_tensors = root, None
    return made


def map_named(
    named: dict[str, TensorRecord],
    spec: MapSpec,
    ckpt: DerivedCheckpoint,
    *,
    keep_unmatched: bool = False,
    decode: bool = False,
) -> tuple[dict[str, TensorRecord], list[Step], list[str]]:
    """``named`` (output name -> record) with ``spec`` applied: renamed records as they are,
    computed ones readable through ``ckpt``; the steps taken and the names no rule matched
    (kept in place with ``keep_unmatched`` or a map that says ``"unmatched": "keep"``, left out
    with ``"drop"``, an error with ``"error"``). The order is ``named``'s. ``decode``: a
    permutation (or other computed op) of tensors quantized in blocks works on their decoded
    float32 values (else it is refused)."""
    if keep_unmatched:
        spec = replace(spec, unmatched="keep")
    steps, unmatched = plan(list(named), spec)
    first = {step.sources[0]: step for step in steps}
    kept = set(unmatched) if spec.unmatched == "keep" else set()
    out: dict[str, TensorRecord] = {}
    for name, record in named.items():
        if name in kept:
            out[name] = record
            continue
        step = first.get(name)
        if step is None:
            continue  # a later source of a step, or dropped
        records = [named[k] for k in step.sources]
        if step.rule.op == "rename":
            out[step.targets[0]] = records[0]
            continue
        made = mapped_records(
            step, records, spec, ckpt.derived, ckpt.element_values,
            ckpt.dequantize if decode else None,
        )  # fmt: skip
        out.update(zip(step.targets, made))
    return out, steps, unmatched


def config_dirs(paths: Iterable[str | Any]) -> list[Path]:
    """Where a map's params may be found for checkpoints at ``paths``: a directory itself (a
    model directory holds its ``config.json``), a file's directory; not a URL's."""
    out = []
    for path in paths:
        if is_url(str(path)):
            continue
        local = Path(path)
        out.append(local if local.is_dir() else local.parent)
    return out


#: Where a format or framework keeps the key/values a checkpoint declares about its model,
#: which a map's params may come from: GGUF's metadata (``llama.attention.head_count``...),
#: Megatron's args (``num_attention_heads``, ``num_query_groups``...).
DECLARED_KEYS = (("gguf_metadata",), ("megatron", "model_args"))


def declared_facts(*ckpts: Checkpoint) -> list[Mapping[str, Any]]:
    """The key/values ``ckpts`` declare about their models, for a map's params."""
    out = []
    for ckpt in ckpts:
        for path in DECLARED_KEYS:
            facts: Any = ckpt.details
            for key in path:
                facts = facts.get(key) if isinstance(facts, Mapping) else None
            if isinstance(facts, Mapping):
                out.append(facts)
    return out


def step_counts(steps: list[Step]) -> str:
    """``"9 renamed, 2 rope_to_hf"``: how many steps of each operation."""
    counts: dict[str, int] = {}
    for step in steps:
        op = "renamed" if step.rule.op == "rename" else step.rule.op
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{n} {op}" for op, n in counts.items()) or "nothing mapped"
