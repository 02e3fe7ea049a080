"""Typed records that describe a checkpoint without holding its tensor bytes.

A checkpoint is read into an object tree made of plain Python values (dict, list, tuple, set,
int, float, str, bytes, bool, None) and four record types defined here:

* :class:`TensorRecord` for every tensor (and NumPy array) the file contains,
* :class:`OpaqueObject` for any other object the pickle would have built (a config class, a
  model class): its class name and the plain data it carries, never imported,
* :class:`GlobalRef` for a reference to a class or function that is stored as a value,
* :class:`BackReference` where an object refers to one that contains it (a parent link).

:class:`RecordReader` is what reads a record's bytes (an opened
:class:`~ckpttool.formats.base.Checkpoint`), as :mod:`ckpttool.io` sees it from below.

Everything else (reading values, layout recognition, rendering) works on these records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol

# the dtype facts are the one table's (model/dtypes.py): these names stay for their many users
from ckpttool.errors import LayoutError
from ckpttool.model.dtypes import ELEMENTS_PER_BYTE, FLOATING_DTYPES, ITEMSIZE

#: torch counts elements, sizes, strides and offsets in int64; a file claiming more is broken
#: (and a number with thousands of digits could not even be printed).
INT64_MAX = 2**63 - 1


def fits_int64(*values: int) -> bool:
    """Whether each of these non-negative ints fits torch's int64."""
    return not values or max(values) <= INT64_MAX


def numel_fits_int64(shape: tuple[int, ...] | list[int]) -> bool:
    """Whether a shape's dimensions and its element count fit int64 (stops early on huge ones)."""
    if not shape:
        return True
    if max(shape) > INT64_MAX:
        return False
    if 0 in shape:
        return True
    if len(shape) <= 4:  # a product of at most 4 int64s is a small int
        return math.prod(shape) <= INT64_MAX
    product = 1
    for size in shape:
        product *= size
        if product > INT64_MAX:
            return False
    return True


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """One block of tensor bytes in the file; several tensors may view the same storage."""

    key: str  # the storage's name in the file: zip record "data/<key>", legacy key, tensor name
    dtype: str  # element type the storage was saved with ("float32"; "uint8" if untyped)
    numel: int  # number of elements the file claims the storage has
    location: str  # device it was saved from: "cpu", "cuda:0", ... (never used to load)
    # where its bytes live: zip member name, "legacy:<key>", "inline", "safetensors" or "dcp"
    # (the file's data found by the key), ...
    record: str
    data_size: int  # bytes actually present in the file for it (checked against numel)
    byteorder: str = "little"

    def __hash__(self) -> int:
        # Equal storages have equal keys. Hashing every field (the generated hash) was a tenth
        # of listing 100,000 tensors: records are grouped by storage several times.
        return hash(self.key)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE.get(self.dtype, 1)


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One stored piece of a tensor that was saved in pieces (a DCP shard of one rank)."""

    file: str  # data file holding it, relative to the checkpoint directory ("__0_0.distcp")
    offset: int  # where the piece's own small torch.save archive starts in that file
    length: int  # bytes of that archive
    offsets: tuple[int, ...]  # index of the piece's first element in the whole tensor
    sizes: tuple[int, ...]  # the piece's shape

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class ChunkedStorageRecord(StorageRecord):
    """The storage of a tensor stored as chunks in several files (torch.distributed.checkpoint).

    It stands for the whole tensor, contiguous, as if it had been saved in one piece: reading a
    range of it assembles the range from the chunks that cover it (``Checkpoint.read_bytes``).
    """

    chunks: tuple[ChunkRecord, ...] = ()
    shape: tuple[int, ...] = ()  # the whole tensor's, which the chunks' offsets index
    # how the chunks were placed, when a sharding spec says ("Shard(dim=0) over mesh [2]")
    placement: str = ""


#: The scheme of GGUF's block-quantized tensors (dtype "Q8_0", "Q4_K"...): each block of the
#: tensor's bytes carries its own scales; the format that read the file decodes them
#: (``Checkpoint.dequantize``), torch cannot hold them.
GGML_BLOCKS = "ggml_blocks"


@dataclass(frozen=True)
class QuantInfo:
    """How a quantized tensor's stored integers map to real values: (q - zero_point) * scale
    (torch's schemes), or per block of its bytes (:data:`GGML_BLOCKS`: no scale here)."""

    # "per_tensor_affine", "per_channel_affine", "per_channel_affine_float_qparams", GGML_BLOCKS
    qscheme: str
    # one number, or one per channel (per_channel_*: a tensor, or a list in old files)
    scale: float | tuple[float, ...] | TensorRecord = 0.0
    zero_point: float | tuple[float, ...] | TensorRecord = 0.0
    axis: int | None = None  # the channel dimension of per_channel_* schemes

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    @property
    def in_blocks(self) -> bool:
        """GGUF's block quantization: decoded by its format, not by torch."""
        return self.qscheme == GGML_BLOCKS

    def describe(self) -> str:
        """For notes: "per_tensor_affine scale 0.1 zero_point 2", "per_channel_affine axis 0"."""
        if self.in_blocks:
            return "in GGML blocks (each block holds its scales)"
        if self.axis is not None or not isinstance(self.scale, (int, float)):
            return f"{self.qscheme} axis {self.axis}"
        assert isinstance(self.zero_point, (int, float))
        return f"{self.qscheme} scale {self.scale:g} zero_point {self.zero_point:g}"


#: Names of a sparse or nested tensor's parts, by layout (torch's own accessor names).
PART_NAMES: dict[str, tuple[str, ...]] = {
    "sparse_coo": ("indices", "values"),
    "sparse_csr": ("crow_indices", "col_indices", "values"),
    "sparse_csc": ("ccol_indices", "row_indices", "values"),
    "sparse_bsr": ("crow_indices", "col_indices", "values"),
    "sparse_bsc": ("ccol_indices", "row_indices", "values"),
    "nested": ("buffer", "nested_sizes", "nested_strides", "storage_offsets"),
}


@dataclass(frozen=True, slots=True)
class DTensorInfo:
    """What a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism) holds in a
    ``torch.save`` file: one rank's piece of the tensor, not the tensor. The record it belongs
    to has the global dtype and shape and no storage; the piece is an ordinary record."""

    local: TensorRecord  # this rank's ``_local_tensor`` (its bytes are in the file)
    placements: tuple[str, ...]  # per mesh dimension: "Shard(dim=0)", "Replicate()"...
    # the device mesh as the spec pickles it: its shape, dimension names (None: unnamed) and
    # this rank's coordinate in it (None: the pickle does not say)
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] | None = None
    coordinate: tuple[int, ...] | None = None
    # per mesh dimension, as data: ("shard", dim), ("strided_shard", dim, split_factor),
    # ("replicate",), ("partial", reduce_op) or ("unknown", class name)
    kinds: tuple[tuple[Any, ...], ...] = ()
    global_stride: tuple[int, ...] | None = None  # TensorMeta's stride (the record's shape is
    # the global shape)
    # "DTensor", or "ShardedTensor" (FSDP1): then ``kinds`` is (("offsets", offsets),), where
    # the local shard starts in the global tensor, and the mesh is the world (rank = coordinate)
    cls: str = "DTensor"

    def describe(self) -> str:
        """For notes: "DTensor Shard(dim=0), local [4, 4]"."""
        return f"{self.cls} {', '.join(self.placements) or '?'}, local {list(self.local.shape)}"

    def split(self) -> str:
        """How the tensor is split, for ``show``: "Shard(dim=0) over mesh [2]" or
        "(Replicate(), Shard(dim=0)) over mesh [2, 2] (dp_replicate, dp_shard)";
        "ShardedTensor, each rank's shard at its offsets" (FSDP1)."""
        if self.cls != "DTensor":
            return f"{self.cls}, each rank's shard at its offsets"
        places = (
            self.placements[0] if len(self.placements) == 1 else f"({', '.join(self.placements)})"
        )
        mesh = f" over mesh {list(self.mesh_shape)}" if self.mesh_shape else ""
        names = f" ({', '.join(self.mesh_dim_names)})" if self.mesh_dim_names else ""
        return f"{places}{mesh}{names}"


@dataclass(slots=True)
class TensorRecord:
    """A tensor (or NumPy array) as described by the file: everything but its values.

    Treated as immutable (copies are made with ``with_key``/``with_fields``), but not a frozen
    dataclass: a frozen one sets each of its 13 fields through ``object.__setattr__``, which was
    a tenth of the time of reading a tensor call. Group records by storage, never by record.

    Hashable by identity only, as a torch tensor is: ``torch.save(optimizer)`` pickles a dict
    keyed by the parameters (its ``state``), which a pickle builds with the records as keys.
    """

    __hash__ = object.__hash__  # identity, as torch.Tensor's; equality stays field by field

    key: str  # dotted path from the top of the object tree ("" until the tree is flattened)
    dtype: str  # torch dtype name without "torch." ("float16"); NumPy arrays use the same names
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    storage_offset: int  # in elements of ``dtype``
    storage: StorageRecord | None  # None for meta tensors (no data)
    requires_grad: bool = False
    kind: str = "tensor"  # "tensor", "parameter", "ndarray" or "storage" (saved on its own)
    inline_data: bytes | None = field(default=None, repr=False, compare=False)
    # torch's layout without "torch.": "strided", or "sparse_coo", "sparse_csr", "sparse_csc",
    # "sparse_bsr", "sparse_bsc", "nested". A sparse or nested tensor has no storage of its
    # own (storage None, stride ()): its bytes are its ``parts`` (named by PART_NAMES[layout]),
    # each an ordinary strided record.
    layout: str = "strided"
    parts: tuple[TensorRecord, ...] = ()
    quant: QuantInfo | None = None  # a quantized tensor's scheme (its dtype is qint8, ...)
    is_coalesced: bool | None = None  # sparse COO: as torch.save recorded it
    # a DTensor's piece in this file (the record itself, the global tensor, has no storage)
    dtensor: DTensorInfo | None = None

    def __str__(self) -> str:
        """The record as a key of a dict (``torch.save(optimizer)``'s ``state``, keyed by
        parameters): which storage and offset it views, which names it among its siblings."""
        if self.storage is None:
            return f"<{self.kind} {self.dtype}{list(self.shape)}>"
        return f"<{self.kind} {self.storage.key}:{self.storage_offset}>"

    @property
    def is_sparse(self) -> bool:
        return self.layout.startswith("sparse_")

    @property
    def nnz(self) -> int:
        """Specified elements of a sparse tensor (blocks count their elements)."""
        if not self.is_sparse or not self.parts:
            return self.numel
        values = self.parts[-1]
        return values.shape[0] if values.shape else 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 1)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def stored_nbytes(self) -> int:
        """Bytes the file holds for it: a sparse or nested tensor's parts, a packed dtype's
        shared bytes (``nbytes`` is the dense size)."""
        if self.parts:
            return sum(part.stored_nbytes for part in self.parts)
        return -(-self.numel // ELEMENTS_PER_BYTE.get(self.dtype, 1)) * self.itemsize

    @property
    def extent(self) -> int:
        """Number of storage elements from the storage's start to one past the last element."""
        if self.numel == 0:
            return self.storage_offset
        return self.storage_offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))

    @property
    def stored_extent_bytes(self) -> int:
        """Bytes of storage from its start to past the last element (packed dtypes share)."""
        per_byte = ELEMENTS_PER_BYTE.get(self.dtype, 1)
        return -(-self.extent // per_byte) * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def is_floating(self) -> bool:
        return self.dtype in FLOATING_DTYPES

    @property
    def location(self) -> str:
        if self.storage is None and self.parts:
            return self.parts[-1].location
        if self.storage is None and self.dtensor is not None:
            return self.dtensor.local.location
        return self.storage.location if self.storage is not None else "meta"

    @property
    def is_meta(self) -> bool:
        """No values in the file: a meta tensor (or a subclass saved without its data, such as a
        DTensor, whose file holds only one rank's piece: ``dtensor``)."""
        return self.storage is None and self.inline_data is None and not self.parts

    def same_storage(self, other: TensorRecord) -> bool:
        return self.storage is not None and self.storage == other.storage


class RecordReader(Protocol):
    """What reads a record's bytes: an opened :class:`~ckpttool.formats.base.Checkpoint`,
    described on the floor below both it and its readers in :mod:`ckpttool.io`
    (:mod:`~ckpttool.io.read_batch`, :mod:`~ckpttool.io.values`)."""

    def plan_reads(self, records: Sequence[TensorRecord]) -> bool:
        """A hint: the bytes of ``records`` will be read, in this order."""
        ...

    def file_span(self, record: TensorRecord) -> tuple[int, int] | None:
        """(offset, length) of ``record``'s bytes when they are one range of one file."""
        ...

    def read_bytes(self, record: TensorRecord) -> tuple[bytes | bytearray, int]:
        """The bytes covering ``record``'s elements and the element offset of its first one."""
        ...

    def read_file(self, offset: int, length: int) -> bytearray:
        """``length`` bytes at ``offset`` of the one file (fewer only at its end)."""
        ...

    def dequantize(self, record: TensorRecord) -> Any:
        """A block-quantized tensor's values, decoded by its format (a float32 NumPy array)."""
        ...


def rebuildable_storage(record: TensorRecord) -> StorageRecord:
    """The storage a torch writer rebuilds ``record`` from, as a view of it (offset, strides):
    a plain strided tensor of a byte-sized dtype, not inline, not assembled from parts, not
    quantized and not a DTensor. Anything else is a :class:`LayoutError` naming the tensor."""
    storage = record.storage
    if (
        storage is None
        or record.inline_data is not None
        or record.parts
        or record.quant is not None
        or record.dtensor is not None
        or record.layout != "strided"
        or record.dtype not in ITEMSIZE
    ):
        raise LayoutError(f"{record.key}: cannot rebuild a {record.dtype} {record.layout} tensor")
    return storage


def without_values(records: list[TensorRecord]) -> list[str]:
    """Why ``records`` have no values in the file, one phrase per cause ("3 are DTensor
    shards...", "2 are meta tensors..."), each naming an example and what to do; empty when
    every record has values. ``convert`` refuses such tensors with these words; ``show`` warns
    with them."""
    shards = [r for r in records if r.is_meta and r.dtensor is not None]
    meta = [r for r in records if r.is_meta and r.dtensor is None]
    reasons = []
    if shards:
        first = shards[0]
        assert first.dtensor is not None
        reasons.append(
            f"{len(shards)} {'is a DTensor shard' if len(shards) == 1 else 'are DTensor shards'}"
            f" (FSDP2 or tensor parallelism; e.g. {first.key!r}: global {list(first.shape)}, "
            f"{first.dtensor.describe()}): this file holds one rank's piece of each, and the "
            "full tensors exist only once every rank's file is assembled: give ckpttool the "
            "directory of all the rank files, which it reads as one checkpoint, or save full "
            "tensors (get_model_state_dict with StateDictOptions(full_state_dict=True), or "
            "torch.distributed.checkpoint, which ckpttool reads whole)"
        )
    if meta:
        reasons.append(
            f"{len(meta)} {'is a meta tensor' if len(meta) == 1 else 'are meta tensors'} saved "
            f"without data (e.g. {meta[0].key!r}: a model built on the meta device, or a tensor "
            "subclass saved without its values); save the model after its weights are loaded"
        )
    return reasons


def storage_region(record: TensorRecord) -> tuple[Any, ...] | None:
    """Which stored elements a tensor views: tensors with the same region hold the same values.

    Tied weights (``lm_head.weight is embed_tokens.weight``) and a transpose of the same weight
    have one region; slices of one fused storage (q, k, v of a ``qkv`` weight) have one each.
    The region is the storage, the first element and the (stride, size) of each dimension in
    any order, so a permuted view of the same elements matches. None: the tensor has no shared
    storage to be tied through (a meta tensor, bytes inlined in the pickle).
    """
    if record.storage is None or record.inline_data is not None:
        return None
    dims = sorted((stride, size) for size, stride in zip(record.shape, record.stride) if size != 1)
    return (record.storage, record.storage_offset, tuple(dims))


def stored_records(records: list[TensorRecord]) -> list[TensorRecord]:
    """The records whose bytes are in the file: each tensor, a sparse/nested one by its parts
    (named ``<key>.<part>``), a quantized one's per-channel scales and zero points added, a
    DTensor by this rank's piece (``<key>._local_tensor``)."""
    out: list[TensorRecord] = []
    for record in records:
        if record.dtensor is not None:
            out.append(with_key(record.dtensor.local, f"{record.key}._local_tensor"))
        elif record.parts:
            names = PART_NAMES[record.layout]
            out.extend(
                with_key(part, f"{record.key}.{name}") for name, part in zip(names, record.parts)
            )
        else:
            out.append(record)
        if record.quant is not None:
            for name in ("scale", "zero_point"):
                value = getattr(record.quant, name)
                if isinstance(value, TensorRecord):
                    out.append(with_key(value, f"{record.key}.q_{name}s"))
    return out


class StorageViews(NamedTuple):
    """Which of some records view which storage (:func:`storage_views`)."""

    first: dict[StorageRecord, TensorRecord]  # each storage's first viewer, in file order
    shared: dict[StorageRecord, list[TensorRecord]]  # storages viewed more than once: by all
    loose: list[TensorRecord]  # records with no storage to share (meta, bytes in the pickle)


def storage_views(records: list[TensorRecord]) -> StorageViews:
    """``records`` grouped by the storage they view: once for :func:`count_once` and
    :func:`storage_groups` (a listing asks both of 100,000 records)."""
    first_viewer: dict[StorageRecord, TensorRecord] = {}
    shared: dict[StorageRecord, list[TensorRecord]] = {}
    loose: list[TensorRecord] = []
    for record in records:
        storage = record.storage
        if storage is None or record.inline_data is not None:
            loose.append(record)
            continue
        known = len(first_viewer)
        first = first_viewer.setdefault(storage, record)  # one hash: StorageRecord's is Python's
        if len(first_viewer) == known:  # a storage seen before
            group = shared.get(storage)
            if group is None:
                shared[storage] = [first, record]
            else:
                group.append(record)
    return StorageViews(first_viewer, shared, loose)


def count_once(
    records: list[TensorRecord], views: StorageViews | None = None
) -> tuple[int, dict[str, int]]:
    """Elements and bytes by dtype of ``records``, each stored element counted once.

    This is the one counting rule of parameters and bytes. Tensors that view the same storage
    region (tied weights, a transpose) count once; views of one storage never count more than
    the storage holds (overlapping slices). Tensors without a storage count as they are,
    except that a meta tensor (no storage, no inline bytes) has elements but stores no bytes.
    A sparse or nested tensor counts its elements as torch's ``numel()`` does and the bytes of
    its stored parts (indices and values). ``views``: ``storage_views(records)``, if known.
    """
    sparse = [r for r in records if r.parts]
    if sparse:
        dense_elements, dense_bytes = count_once([r for r in records if not r.parts])
        _, part_bytes = count_once(stored_records(sparse))
        for dtype, nbytes in part_bytes.items():
            dense_bytes[dtype] = dense_bytes.get(dtype, 0) + nbytes
        numel = sum(r.parts[0].numel if r.layout == "nested" else r.numel for r in sparse)
        return dense_elements + numel, dense_bytes
    if views is None:
        views = storage_views(records)
    elements = 0
    by_dtype: dict[str, int] = {}
    prod = math.prod
    for record in views.loose:
        elements += prod(record.shape)
        if record.storage is not None or record.inline_data is not None:
            by_dtype[record.dtype] = by_dtype.get(record.dtype, 0) + record.stored_nbytes
    viewers = views.shared
    packing: dict[str, tuple[int, int]] = {}  # dtype: (elements per byte, bytes per element)
    for storage, first in views.first.items():
        group = viewers.get(storage)
        if group is None:  # one record views this storage (almost every storage)
            dtype = first.dtype
            per_byte_itemsize = packing.get(dtype)
            if per_byte_itemsize is None:
                per_byte_itemsize = packing[dtype] = _packing(dtype)
            per_byte, itemsize = per_byte_itemsize
            numel = prod(first.shape)
            nbytes = -(-numel // per_byte) * itemsize
            storage_nbytes = storage.nbytes
            if nbytes > storage_nbytes:  # it claims more than the storage holds
                elements += storage_nbytes // itemsize
                by_dtype[dtype] = by_dtype.get(dtype, 0) + storage_nbytes
            else:
                elements += numel
                by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
            continue
        distinct = _distinct_regions(group)
        nbytes = sum(r.stored_nbytes for r in distinct)
        if nbytes > storage.nbytes:  # overlapping views: the storage is all there is
            first = distinct[0]
            elements += storage.nbytes // first.itemsize
            by_dtype[first.dtype] = by_dtype.get(first.dtype, 0) + storage.nbytes
            continue
        for record in distinct:
            elements += record.numel
            by_dtype[record.dtype] = by_dtype.get(record.dtype, 0) + record.stored_nbytes
    return elements, by_dtype


def _packing(dtype: str) -> tuple[int, int]:
    """(elements per stored byte, bytes per element) of a dtype, as ``stored_nbytes`` uses them."""
    return ELEMENTS_PER_BYTE.get(dtype, 1), ITEMSIZE.get(dtype, 1)


def _distinct_regions(viewing: list[TensorRecord]) -> list[TensorRecord]:
    """The first of ``viewing`` (views of one storage) for each region they view."""
    regions: dict[tuple[Any, ...] | None, TensorRecord] = {}
    for record in viewing:
        regions.setdefault(storage_region(record), record)
    return list(regions.values())


def shared_storages(records: list[TensorRecord]) -> list[list[str]]:
    """The keys of each storage that several of ``records`` view (tied weights), file order."""
    return [[record.key for record in group] for group in storage_groups(records)]


def storage_groups(
    records: list[TensorRecord], views: StorageViews | None = None
) -> list[list[TensorRecord]]:
    """The records that view each storage several of ``records`` view, in file order (of
    each storage's first viewer, then of the records). Inline bytes view no shared storage.
    ``views``: ``storage_views(records)``, if known."""
    if views is None:
        views = storage_views(records)
    shared = views.shared
    if not shared:
        return []
    return [shared[storage] for storage in views.first if storage in shared]


@dataclass(frozen=True)
class GlobalRef:
    """A class or function named by the pickle. Never imported; only its name is kept."""

    module: str
    name: str

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def __str__(self) -> str:
        return f"<global {self.qualname}>"


class TorchDtypeText(str):
    """A torch dtype the pickle named (``torch.float16``), held in the tree as its text; a
    writer writes the dtype back, not a string."""

    __slots__ = ()


class NumpyDtypeText(str):
    """A NumPy dtype the pickle built (``numpy.dtype('<f4')``: byte order, then the type's
    code), held in the tree as that text; a writer writes the dtype back, not a string."""

    __slots__ = ()

    @property
    def order_and_code(self) -> tuple[str, str]:
        """The byte order ("<", ">", or "|" where the order means nothing) and the code."""
        inner = self[len("numpy.dtype('") : -len("')")]
        code = inner[1:]
        return ("|" if code in _ONE_BYTE_CODES else inner[:1]), code


#: NumPy type codes of one-byte types, whose byte order NumPy pickles as "|".
_ONE_BYTE_CODES = frozenset({"?", "b", "B", "b1", "i1", "u1"})


@dataclass(frozen=True, slots=True)
class BackReference:
    """Where an object refers back to one that contains it (an omegaconf node's ``_parent``, a
    list holding itself): a leaf naming the object's type. The object itself is in the tree
    where it was first reached; expanding it again here would never end."""

    target: str  # the type of the object referred to: "dict", "omegaconf.dictconfig.DictConfig"

    def __str__(self) -> str:
        return f"<back-reference to {self.target}>"


class OpaqueObject:
    """An object of a class ckpttool does not reconstruct: its name and the data it carries."""

    __slots__ = ("args", "cls", "dictitems", "listitems", "new", "state")

    def __init__(
        self, cls: str, args: Any = (), state: Any = None, new: bool | None = None
    ) -> None:
        self.cls = cls  # "__main__.TrainConfig", "mymodel.Config", ...
        self.args = args  # what the pickle passed to the class (or its reconstructor)
        self.state = state  # what BUILD would have set (usually the instance __dict__)
        self.dictitems: dict[Any, Any] = {}  # items SETITEMS added (dict subclasses)
        self.listitems: list[Any] = []  # items APPENDS added (list subclasses)
        # how the pickle built it, for a writer to build it alike: ``NEWOBJ``'s
        # ``cls.__new__(cls, *args)`` (True), ``REDUCE``'s ``cls(*args)`` (False; a custom
        # ``__reduce__``: numpy's ``__generator_ctor``), or not said (None: ``INST``/``OBJ``)
        self.new = new

    def fields(self) -> dict[str, Any]:
        """The plain data this object carries, by name, for display and flattening."""
        out: dict[str, Any] = {}
        if isinstance(self.state, dict):
            out.update({str(k): v for k, v in self.state.items()})
        elif isinstance(self.state, tuple) and len(self.state) == 2:
            # (dict state, slot state), as copyreg produces for classes with __slots__
            for part in self.state:
                if isinstance(part, dict):
                    out.update({str(k): v for k, v in part.items()})
        elif self.state is not None:
            out["__state__"] = self.state
        if self.args not in ((), None):
            out.setdefault("__args__", self.args)
        if self.dictitems:
            out.update({str(k): v for k, v in self.dictitems.items()})
        if self.listitems:
            out["__items__"] = self.listitems
        return out

    def built_new(self) -> bool:
        """Whether a writer builds it with ``NEWOBJ`` (``cls.__new__(cls, *args)``, as
        copyreg's protocol 2 writes an instance) rather than ``REDUCE`` (``cls(*args)``, as an
        Enum member or a custom ``__reduce__`` is written): as the pickle built it, or, not said,
        where state or items follow."""
        if self.new is not None:
            return self.new
        return self.state is not None or bool(self.dictitems or self.listitems)

    def empty_copy(self) -> OpaqueObject:
        """An object of the same kind and class, without arguments, state or items yet (what
        a copy of the tree fills)."""
        return OpaqueObject(self.cls, new=self.new)

    def rebuilt(self, args: Any, state: Any) -> OpaqueObject:
        """An object of the same kind and class with these arguments and state (no items)."""
        out = self.empty_copy()
        out.args, out.state = args, state
        return out

    def __repr__(self) -> str:
        return f"<{self.cls} object>"


class CalledObject(OpaqueObject):
    """What a pickle builds by calling an object it built itself rather than a global: how
    cloudpickle and dill write a bound method (``_builtin_type('MethodType')(func, obj)``) or a
    function by value (``_builtin_type('CodeType')(...)``). Nothing is called: ``args[0]`` is
    the object called (an :class:`OpaqueObject`), ``args[1:]`` its arguments; ``cls`` names
    what was called (``"cloudpickle.cloudpickle._builtin_type(...)"``); ``new`` as for any
    object."""

    __slots__ = ()

    def empty_copy(self) -> CalledObject:
        return CalledObject(self.cls, new=self.new)


class TensorSubclassObject(OpaqueObject):
    """A wrapper tensor subclass (torchao's ``Int8Tensor``, ``Float8Tensor``,
    ``AffineQuantizedTensor``...) pickled as ``_rebuild_wrapper_subclass`` plus its state: the
    tensor torch would rebuild has no storage of its own; its inner tensors (``qdata``,
    ``scale``, ``zero_point``...) are in the state, each an ordinary record named
    ``<key>.<inner name>``. ``dtype`` and ``shape`` are the logical tensor's."""

    __slots__ = ("dtype", "requires_grad", "shape")

    def __init__(
        self, cls: str, state: dict[Any, Any], dtype: str, shape: tuple[int, ...],
        requires_grad: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(cls, (), state)
        self.dtype = dtype
        self.shape = shape
        self.requires_grad = requires_grad

    def empty_copy(self) -> TensorSubclassObject:
        return TensorSubclassObject(self.cls, {}, self.dtype, self.shape, self.requires_grad)

    def inner_tensors(self) -> dict[str, TensorRecord]:
        """The inner tensors by their name in the state (``qdata``, ``scale``...)."""
        return {k: v for k, v in self.fields().items() if isinstance(v, TensorRecord)}

    def nested(self) -> list[tuple[str, TensorSubclassObject]]:
        """The subclasses its state holds (torchao's AffineQuantizedTensor its ``tensor_impl``,
        LinearActivationQuantizedTensor its ``original_weight_tensor``), by name."""
        return [(k, v) for k, v in self.fields().items() if isinstance(v, TensorSubclassObject)]

    def fact(self, name: str) -> Any:
        """A fact of its state (``block_size``...), or of the subclasses it wraps (None)."""
        holder: TensorSubclassObject | None = self
        while holder is not None:
            facts = holder.fields()
            if facts.get(name) is not None:
                return facts[name]
            inner = holder.nested()
            holder = inner[0][1] if len(inner) == 1 else None
        return None

    def describe(self) -> str:
        """For notes: "torchao Int8Tensor, float32 [8, 16], block_size [1, 16]"."""
        name = self.cls.rpartition(".")[2]
        library = self.cls.partition(".")[0]
        block = self.fact("block_size")
        text = f"{library} {name}, {self.dtype} {list(self.shape)}"
        if isinstance(block, (list, tuple)):
            text += f", block_size {list(block)}"
        low, high = self.fact("quant_min"), self.fact("quant_max")
        if isinstance(low, (int, float)) and isinstance(high, (int, float)):
            text += f", quant range [{low}, {high}]"
        return text

    def __repr__(self) -> str:
        return f"<{self.cls} {self.dtype}{list(self.shape)}>"


def tensor_subclasses(
    node: Any, prefix: str = "", *, outermost: bool = False
) -> dict[str, TensorSubclassObject]:
    """Every wrapper tensor subclass under ``node`` by its dotted key, outer ones first
    (``outermost``: not those another one wraps)."""
    found: dict[str, TensorSubclassObject] = {}
    if not holds_instance(node, TensorSubclassObject):  # most files: no key made for any node
        return found
    stack: list[tuple[str, Any]] = [(prefix, node)]
    while stack:
        key, current = stack.pop()
        if isinstance(current, TensorSubclassObject):
            found[key] = current
            if outermost:
                continue
        if is_container(current):
            stack.extend(
                (join_key(key, name), child)
                for name, child in reversed(list(children(current)))
                if is_container(child)
            )
    return found


def holds_instance(node: Any, kind: type) -> bool:
    """Whether ``node``, or a node under it, is a ``kind``: the containers :func:`children`
    descends into, walked without a name or a step per plain leaf (a table of 150,000 small
    objects is half a million leaves: bench/object_table.py)."""
    plain = _PLAIN_LEAVES
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, kind):
            return True
        values = container_values(current)
        if values is not None:
            stack.extend([value for value in values if value.__class__ not in plain])
    return False


def container_values(node: Any) -> Iterable[Any] | None:
    """What the container ``node`` holds, in file order (a dict's values, a list's or tuple's
    items, an opaque object's fields), without a generator; None for a leaf. The exact
    classes are tested first: the passes over every node of a large table call it once per
    container."""
    cls = node.__class__
    if cls is dict:
        return node.values()
    if cls is list or cls is tuple:
        return node
    if isinstance(node, OpaqueObject):
        return node.fields().values()
    if isinstance(node, dict):
        return node.values()
    if isinstance(node, (list, tuple)):
        return node
    return None


def children(node: Any) -> Iterator[tuple[str, Any]]:
    """The (name, child) pairs under a container node, in file order (nothing under a leaf).

    Made by ``zip``/``map`` over the container, not a generator: layout questions list the
    children of dicts of 100,000 tensors."""
    if isinstance(node, dict):
        return zip(map(str, node), node.values())
    if isinstance(node, (list, tuple)):
        return zip(map(str, range(len(node))), node)
    if isinstance(node, OpaqueObject):
        return iter(node.fields().items())
    return iter(())


def is_container(node: Any) -> bool:
    return isinstance(node, (dict, list, tuple, OpaqueObject))


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def walk(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every (dotted key, leaf) under ``node``; tensors are leaves. Iterative, file order."""
    stack: list[tuple[str, Any]] = [(prefix, node)]
    while stack:
        key, current = stack.pop()
        if is_container(current):
            stack.extend(reversed([(join_key(key, n), c) for n, c in children(current)]))
        else:
            yield key, current


def paths_of(node: Any, key: str, most: int = 2) -> list[str]:
    """Up to ``most`` paths in ``node`` to the tensors whose dotted key is ``key``, written as
    subscripts (``['a.b']['c']``): what tells apart two paths that flatten to the same key
    (``{'a.b': {'c': t}}`` and ``{'a': {'b.c': t}}``). Only the branches that can lead to
    ``key`` are walked."""
    found: list[str] = []
    stack: list[tuple[str, str, Any]] = [("", "", node)]
    while stack and len(found) < most:
        dotted, path, current = stack.pop()
        if not is_container(current):
            if dotted == key and isinstance(current, TensorRecord):
                found.append(path)
            continue
        if isinstance(current, dict):
            named: Iterator[tuple[Any, Any]] = iter(current.items())
        elif isinstance(current, (list, tuple)):
            named = enumerate(current)
        else:
            named = iter(current.fields().items())
        following = []
        for name, child in named:
            below = join_key(dotted, str(name))
            if key == below or key.startswith(below + "."):
                following.append((below, f"{path}[{name!r}]", child))
        stack.extend(reversed(following))
    return found


def nodes(node: Any) -> Iterator[Any]:
    """Every node under ``node``, containers included, without building keys (for questions
    like "which classes" or "which dtypes", where names are not needed). Iterative, depth
    first, each container before what it holds."""
    yield node
    if not isinstance(node, (dict, list, tuple, OpaqueObject)):
        return
    stack: list[Iterator[Any]] = [_child_values(node)]
    while stack:
        for child in stack[-1]:
            yield child
            if isinstance(child, TensorRecord):  # most nodes of a checkpoint
                continue
            if isinstance(child, (dict, list, tuple, OpaqueObject)):
                stack.append(_child_values(child))
                break
        else:
            stack.pop()


_CONTAINERS = (dict, list, tuple, OpaqueObject)


def object_classes(node: Any) -> set[str]:
    """The classes of the opaque objects under ``node`` (itself included): the ``cls`` of each
    :class:`OpaqueObject` that :func:`nodes` yields, without a step per leaf (a table of 150,000
    small objects is half a million leaves: bench/object_table.py)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, OpaqueObject):
            found.add(current.cls)
        values = container_values(current)
        if values is not None:
            stack.extend([value for value in values if isinstance(value, _CONTAINERS)])
    return found


def _child_values(node: Any) -> Iterator[Any]:
    """What a container holds, in file order (an object's fields as ``fields()`` gives them)."""
    if isinstance(node, dict):
        return iter(node.values())
    if isinstance(node, (list, tuple)):
        return iter(node)
    return iter(node.fields().values())


def tensors(node: Any, prefix: str = "", *, in_place: bool = False) -> list[TensorRecord]:
    """All tensor records under ``node`` with their ``key`` set to their dotted path.

    A record that already has that key is the tree's own (records are not changed once made:
    ``with_fields`` copies); any other is a copy with the key, unless ``in_place``: then a
    record the tree holds with no key yet gets its key set where it is, and only one met again
    (a tied weight's second name) or under an empty name is copied. The reader flattens a
    freshly parsed tree so: at 100,000 tensors the copies were 14 MB per file, and the tree's
    records were never read by key; listing a section of it later copies none.
    """
    if isinstance(node, TensorRecord):
        return [_keyed(node, prefix)]
    keyed = _keyed_in_place if in_place else _keyed
    return [keyed(record, key) for key, record in _keyed_leaves(node, prefix)]


def tensor_keys(node: Any, prefix: str = "") -> list[str]:
    """The keys :func:`tensors` gives the records under ``node``, without copying a record."""
    if isinstance(node, TensorRecord):
        return [prefix]
    return [key for key, _ in _keyed_leaves(node, prefix)]


def _keyed_leaves(node: Any, prefix: str) -> Iterator[tuple[str, TensorRecord]]:
    """(dotted key, record) of every tensor record under the container ``node``: :func:`walk`
    with its leaves filtered, making no key for what is not a tensor's."""
    if not is_container(node):
        return
    # (the container's key, an iterator over its (name, child) pairs); depth-first, file order
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [(prefix, _named_children(node))]
    while stack:
        key, items = stack[-1]
        for name, child in items:
            if child.__class__ in _PLAIN_LEAVES:  # most leaves of a table of small objects
                continue
            if isinstance(child, TensorRecord):
                name = name if type(name) is str else str(name)
                yield (f"{key}.{name}" if key else name), child
            elif isinstance(child, (dict, list, tuple, OpaqueObject)):
                name = name if type(name) is str else str(name)
                stack.append((f"{key}.{name}" if key else name, _named_children(child)))
                break
        else:
            stack.pop()


#: Leaves that are neither tensors nor containers, by exact class (bench/object_table.py)
_PLAIN_LEAVES = frozenset({int, float, str, bool, type(None), bytes})


def _named_children(node: Any) -> Iterator[tuple[Any, Any]]:
    """:func:`children` of a container with names not yet made text (``str`` of an index is
    made only for what is kept)."""
    if isinstance(node, dict):
        return iter(node.items())
    if isinstance(node, (list, tuple)):
        return enumerate(node)
    return iter(node.fields().items())


_FIELD_NAMES = tuple(f.name for f in fields(TensorRecord))


def _keyed(record: TensorRecord, key: str) -> TensorRecord:
    return record if record.key == key else with_key(record, key)


def _keyed_in_place(record: TensorRecord, key: str) -> TensorRecord:
    if record.key == key:  # made with its key (safetensors names its records)
        return record
    if record.key or not key:  # met before under another name, or a name that keys nothing
        return with_key(record, key)
    record.key = key
    return record


def with_key(record: TensorRecord, key: str) -> TensorRecord:
    """A copy of ``record`` with another key (``dataclasses.replace`` without its slow path:
    listing a large checkpoint re-keys every record, 100,000 of them for as many tensors).
    Every field, positionally: tests/test_records.py checks that these are all, in order."""
    r = record
    return TensorRecord(
        key, r.dtype, r.shape, r.stride, r.storage_offset, r.storage, r.requires_grad, r.kind,
        r.inline_data, r.layout, r.parts, r.quant, r.is_coalesced, r.dtensor,
    )  # fmt: skip


def with_fields(record: TensorRecord, **changes: Any) -> TensorRecord:
    """``dataclasses.replace(record, **changes)`` without its slow path (it re-runs
    ``__init__`` through keyword arguments): reading a tensor narrows its record once per
    chunk, once per tensor at least. ``changes`` must name fields of a record."""
    copy = with_key(record, record.key)
    for name, value in changes.items():
        if name not in _FIELD_NAMES:
            raise TypeError(f"TensorRecord has no field {name!r}")
        setattr(copy, name, value)
    return copy


def get_path(node: Any, dotted: str) -> Any:
    """The node at a dotted path (``optimizer.state``), or KeyError."""
    current = node
    for part in dotted.split(".") if dotted else []:
        for name, child in children(current):
            if name == part:
                current = child
                break
        else:
            raise KeyError(dotted)
    return current
