"""The classes checkpoints pickle as plain data records: known, kept as named records.

Each becomes an :class:`~ckpttool.model.records.OpaqueObject` with its state (nothing is
imported or called). The pickle policy (:mod:`ckpttool.pickle.policy`) classes them "safe" for
``scan``; the roles (:mod:`ckpttool.model.roles`) do not warn of them as unknown objects.
"""

from __future__ import annotations

# What a torch.distributed.checkpoint ``.metadata`` pickle names: dataclasses of plain fields,
# a layout lookup, an enum, a path; and the BytesIO that DCP users store values as (its state
# is its bytes; the rest of ``io`` stays dangerous). Known data records, classed "safe" for
# ``scan``; like any class they are never imported or called here: each becomes an
# OpaqueObject with its state, which :mod:`ckpttool.formats.dcp.metadata` interprets.
_DCP = "torch.distributed.checkpoint"
_RECORDS = frozenset(
    {f"{_DCP}.metadata.{name}" for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )}
    | {f"{_DCP}.filesystem._StorageInfo", "torch.serialization._get_layout"}
    | {"pathlib.PosixPath", "pathlib.WindowsPath", "_io.BytesIO", "io.BytesIO"}
    # DeepSpeed's data records in ZeRO checkpoints (ckpttool.frameworks.deepspeed.files reads them):
    # a loss scaler's numbers, the ZeRO stage (an int enum), a (numel, start) pair
    | {"deepspeed.runtime.fp16.loss_scaler.LossScaler",
       "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
       "deepspeed.runtime.zero.config.ZeroStageEnum",
       "deepspeed.utils.tensor_fragment.fragment_address"}
)  # fmt: skip

_DT = "torch.distributed.tensor"
_ST = "torch.distributed._shard.sharded_tensor"
#: torch.distributed classes that checkpoints pickle as plain data records, each with why it is
#: one (module paths as torch 2.13 pickles them; tests/test_scan_callables.py checks them).
#: Their constructors and ``__setstate__`` only store fields (DeviceMesh's looks up process
#: groups that already exist, by name); ckpttool keeps each as a named record.
DISTRIBUTED_RECORDS: dict[str, str] = {
    # DCP's save planner (Megatron's torch_dist stores its plans in the .metadata)
    f"{_DCP}.planner.SavePlan": "a list of WriteItems and the planner's own data",
    f"{_DCP}.planner.WriteItem": "which tensor or bytes item a rank writes: an index and sizes",
    f"{_DCP}.planner.WriteItemType": "an enum: TENSOR, SHARD or BYTE_IO",
    f"{_DCP}.planner.TensorWriteData": "a chunk's offsets and sizes, the tensor's properties",
    # DTensor (FSDP2 / tensor-parallel state dicts): the wrapper and its sharding spec
    f"{_DT}.DTensor": "a sharded tensor: its local tensor plus the spec below",
    f"{_DT}._dtensor_spec.DTensorSpec": "mesh, placements and tensor metadata",
    f"{_DT}._dtensor_spec.TensorMeta": "a NamedTuple: global shape, stride, dtype",
    f"{_DT}._dtensor_spec.ShardOrderEntry": "a NamedTuple: a tensor dim and the mesh dims",
    f"{_DT}.placement_types.Shard": "a placement: the tensor dim that is split",
    f"{_DT}.placement_types.Replicate": "a placement with no fields",
    f"{_DT}.placement_types.Partial": "a placement: the pending reduction's name",
    f"{_DT}.placement_types._StridedShard": "a placement: dim and split factor",
    "torch.distributed.device_mesh.DeviceMesh": "device type, mesh of ranks, process group names",
    "torch.distributed._mesh_layout._MeshLayout": "the mesh's shape and strides (integers)",
    "torch.distributed._mesh_layout._FlatLayout": "one flattened mesh dim: sizes and strides",
    # ShardedTensor (FSDP1's SHARDED_STATE_DICT): local shards with their offsets, global size
    f"{_ST}.api.ShardedTensor": "a sharded tensor: its local shards plus the metadata below",
    f"{_ST}.api.ShardedTensor.ProcessGroupState": "a NamedTuple: ranks and world sizes",
    f"{_ST}.metadata.ShardedTensorMetadata": "every shard's metadata, the global size",
    f"{_ST}.metadata.TensorProperties": "dtype, layout, requires_grad, memory format",
    f"{_ST}.metadata.MEM_FORMAT_ENCODING": "an enum: the memory format",
    f"{_ST}.shard.Shard": "a local shard: its tensor and its metadata",
    "torch.distributed._shard.metadata.ShardMetadata": "a shard's offsets, sizes, placement",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec": "the split dimension and the placements (device strings)",
    "torch.distributed.remote_device._remote_device": "a rank and device, as a string",
}
#: Nested classes a pickle reaches as ``getattr(class, name)`` (a class attribute): the class
#: and the attribute's name. Resolved by name to the data record ``class.name``.
NESTED_RECORDS: dict[str, str] = {f"{_ST}.api.ShardedTensor": "ProcessGroupState"}
#: Every class name kept as a data record (the ones above and :data:`DISTRIBUTED_RECORDS`).
DATA_RECORDS: frozenset[str] = _RECORDS | frozenset(DISTRIBUTED_RECORDS)


def is_data_record(qualname: str) -> bool:
    """A class a pickle names that is a known data record (DCP metadata, DeepSpeed's loss
    scaler...): kept as a named record, never imported, not worth a warning."""
    return qualname in DATA_RECORDS
