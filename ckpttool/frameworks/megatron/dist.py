"""A Megatron ``torch_dist`` directory as one checkpoint: the DCP tree with its stacked layers
undone, beside ``common.pt``.

megatron-core saves the layers of a ``TransformerBlock`` stacked: ``decoder.layers.{name}`` is
one global tensor whose leading dimension is the layer (``sharded_state_dict`` of each layer
prepends its global layer number as a ``ShardedTensor`` axis, ``prepend_axis_num``), pipeline
stages each writing their layers' rows. Optimizer state in the model space (the non-distributed
optimizer, and the distributed optimizer's ``fully_sharded_model_space`` format) is keyed by the
parameter's key under ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.``, stacked alike.

The tree ckpttool gives: ``common.pt``'s entries (``iteration``, ``args``,
``checkpoint_version``...), ``model`` (each stacked tensor read as one tensor per layer,
``decoder.layers.N.{name}``, a row range of the stored one), ``optimizer`` (the same for
the optimizer's keys) and ``sharded_objects`` (per-layer extra states, ``rng_state``...).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import CkptError, CorruptCheckpointError, InputError, name_file
from ckpttool.formats.base import Parsed, no_span
from ckpttool.formats.registry import as_checkpoint, directory_formats, open_directory_format
from ckpttool.frameworks.base import FrameworkDirectory, open_member
from ckpttool.frameworks.megatron.files import COMMON, DCP_INDEX, Found
from ckpttool.frameworks.tree import DIRECTORY, layout_details
from ckpttool.io.source import join, open_source
from ckpttool.model.dtypes import ITEMSIZE
from ckpttool.model.records import ChunkedStorageRecord, ChunkRecord, TensorRecord

#: ``...layers.{name}`` with no layer number after ``layers.``: a stacked tensor.
STACKED = re.compile(r"^(.*?(?:^|\.)layers)\.(?!\d+(?:\.|$))(.+)$")
OPTIMIZER_PREFIX = "optimizer."
#: The distributed optimizer's flat buffers (``distrib_optimizer.py``: ``dp_reshardable``,
#: ``dp_zero_gather_scatter``): one per gradient bucket, not per parameter.
FLAT_OPTIMIZER = "optimizer.distributed."
#: What ``show`` reads under details.
SUMMARY = "megatron"
#: args entries ``show`` prints, in this order (Megatron-LM's ``arguments.py`` names).
PARALLEL_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "data_parallel_size", "world_size",
)  # fmt: skip
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "seq_length", "max_position_embeddings", "padded_vocab_size", "vocab_size",
    "make_vocab_size_divisible_by", "params_dtype", "use_distributed_optimizer",
    "ckpt_fully_parallel_save",
)  # fmt: skip
COUNTER_ARGS = ("iteration", "consumed_train_samples", "consumed_valid_samples", "train_iters")


@dataclass(frozen=True, slots=True)
class LayerStorageRecord(ChunkedStorageRecord):
    """One layer's rows of a stacked tensor: bytes ``[base, base + nbytes)`` of ``stacked``."""

    stacked: ChunkedStorageRecord | None = None
    base: int = 0


def summary_of(common: dict[str, Any], iteration_from: str) -> dict[str, Any]:
    """iteration, parallel sizes, model and counter args from ``common.pt``/the shard's dict."""
    found = common.get("args")
    args: dict[str, Any] = found if isinstance(found, dict) else {}
    return {
        "iteration": common.get("iteration"),
        "iteration_from": iteration_from,
        "checkpoint_version": common.get("checkpoint_version"),
        "parallel": {name: args[name] for name in PARALLEL_ARGS if name in args},
        "model_args": {name: args[name] for name in MODEL_ARGS if name in args},
        "counters": {name: args[name] for name in COUNTER_ARGS if name in args},
    }


def open_torch_dist(layout: FrameworkDirectory, *, strict: bool, refuse_dangerous: bool) -> Any:
    found = layout.found
    assert isinstance(found, Found)
    if layout.missing:
        raise CorruptCheckpointError(
            f"{layout.directory}: no {layout.missing[0]}: dist_checkpointing writes "
            f"{DCP_INDEX} and {COMMON} before metadata.json, so the save was not Megatron's "
            "or its files were removed"
        )
    directory = layout.directory
    fmt = next(f for f in directory_formats() if f.index_name == DCP_INDEX)
    dcp = open_directory_format(
        fmt, directory, open_source(join(directory, DCP_INDEX)), strict, refuse_dangerous
    )
    common_ckpt = None
    try:
        common_ckpt = open_member(
            join(directory, COMMON), strict=strict, refuse_dangerous=refuse_dangerous
        )
        common = common_ckpt.root
        if not isinstance(common, dict):
            raise CorruptCheckpointError(f"{COMMON}: not a dict (a {type(common).__name__})")
        notes: list[str] = []
        root, stacked = _unstack(dcp.root, common, notes)
        problems = list(dcp.problems) + list(common_ckpt.problems)
        if not strict:  # verify: every item of every data file, as for a DCP directory
            problems += fmt.verify(dcp, None)[0]
    except BaseException as error:
        dcp.close()
        if common_ckpt is not None:
            common_ckpt.close()
        if isinstance(error, CkptError):
            name_file(error, directory)
        raise

    def read(storage: Any, start: int, stop: int) -> bytearray:
        if isinstance(storage, LayerStorageRecord):
            assert storage.stacked is not None
            base = storage.base
            return dcp.read_storage(storage.stacked, base + start, base + stop, storage.key)
        return dcp.read_storage(storage, start, stop)

    def close() -> None:
        dcp.close()
        common_ckpt.close()

    details = layout_details(layout)
    summary = summary_of(common, COMMON)
    summary["stacked"] = stacked
    summary["notes"] = notes
    summary["backend"] = dict(found.backend)
    details[SUMMARY] = summary
    details["files"] = dcp.details.get("files", {})
    parsed = Parsed(format=DIRECTORY, root=root, span=no_span, details=details,
                    problems=problems, read=read,
                    close=close, unchanged=dcp.check_unchanged)  # fmt: skip
    return as_checkpoint(directory, parsed, None, dcp.file_size + common_ckpt.file_size)


def _unstack(
    tree: dict[str, Any], common: dict[str, Any], notes: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the checkpoint's tree, the stacked tensors as stored: key, shape, layers); what could
    not be undone is added to ``notes``."""
    args = common.get("args")
    layers = args.get("num_layers") if isinstance(args, dict) else None
    model: dict[str, Any] = {}
    optimizer: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    stacked: list[dict[str, Any]] = []
    for key, value in tree.items():
        key = str(key)
        if not isinstance(value, TensorRecord):
            objects[key] = value
            continue
        section = optimizer if key.startswith(OPTIMIZER_PREFIX) else model
        match = STACKED.match(key)
        count = value.shape[0] if value.shape else 0
        if (
            match is None
            or not isinstance(value.storage, ChunkedStorageRecord)
            or not count
            or (isinstance(layers, int) and count != layers)
        ):
            section[key] = value
            continue
        stacked.append({"key": key, "shape": list(value.shape), "layers": count,
                        "as": f"{match[1]}.N.{match[2]}"})  # fmt: skip
        for layer in range(count):
            name = f"{match[1]}.{layer}.{match[2]}"
            section[name] = _layer_record(name, value, layer)
    flat = sorted({k.split(".")[2] for k in optimizer if k.startswith(FLAT_OPTIMIZER)})
    if flat:
        notes.append(
            f"optimizer.distributed.{', '.join(flat)}: the distributed optimizer's flat "
            "per-bucket buffers (dp_reshardable / dp_zero_gather_scatter format), shown as "
            "stored: the bucket layout that maps them to parameters is not in the checkpoint "
            "(save with --dist-ckpt-optim-fully-reshardable or the default "
            "fully_sharded_model_space for per-parameter tensors)"
        )
    root: dict[str, Any] = {k: v for k, v in common.items() if k not in ("model", "optimizer")}
    root["model"] = _by_layer(model)
    if optimizer:
        root["optimizer"] = _by_layer(optimizer)
    if objects:
        root["sharded_objects"] = objects
    return root, stacked


def _by_layer(section: dict[str, Any]) -> dict[str, Any]:
    """The unstacked tensors layer by layer (as a model's ``state_dict()`` lists them), where
    the first of them was; the others in stored order."""
    layered: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    at = None
    for key, value in section.items():
        storage = value.storage if isinstance(value, TensorRecord) else None
        if isinstance(storage, LayerStorageRecord):
            if at is None:
                at = len(out)
                out[""] = None  # where the layers go
            layered.setdefault(int(storage.key.rpartition("#")[2]), {})[key] = value
        else:
            out[key] = value
    if at is None:
        return section
    items = list(out.items())
    merged = dict(items[:at])
    for layer in sorted(layered):
        merged.update(layered[layer])
    merged.update(items[at + 1 :])
    return merged


def _layer_record(name: str, stacked: TensorRecord, layer: int) -> TensorRecord:
    storage = stacked.storage
    assert isinstance(storage, ChunkedStorageRecord)
    if stacked.storage_offset or stacked.stride != _contiguous(stacked.shape):
        raise InputError(f"{stacked.key}: a stacked tensor that is not contiguous")
    shape = stacked.shape[1:]
    numel = math.prod(shape)
    nbytes = numel * ITEMSIZE.get(stacked.dtype, 1)
    chunks = tuple(
        ChunkRecord(c.file, c.offset, c.length, c.offsets[1:], c.sizes[1:])
        for c in storage.chunks
        if c.offsets and c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]
    )
    layer_storage = LayerStorageRecord(
        key=f"{storage.key}#{layer}", dtype=storage.dtype, numel=numel, location=storage.location,
        record=storage.record, data_size=nbytes, chunks=chunks, shape=shape,
        placement=storage.placement, stacked=storage, base=layer * nbytes,
    )  # fmt: skip
    return TensorRecord(
        key=name, dtype=stacked.dtype, shape=shape, stride=_contiguous(shape), storage_offset=0,
        storage=layer_storage, requires_grad=stacked.requires_grad, kind=stacked.kind,
    )  # fmt: skip


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
