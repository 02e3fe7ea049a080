"""Checkpoints as torch tensors, for other code: :func:`open` (a handle like safetensors'
``safe_open``) and :func:`load_state_dict` (one call: a state dict ``model.load_state_dict``
takes).

Everything the reader opens (:func:`~ckpttool.checkpoint.open_checkpoint`: a file of any
format, a DCP or framework directory, a URL, a framework's ``view=``) is read without running
pickle code, in the view ``convert`` reads unless another is named (the one the layout
declares: :data:`~ckpttool.frameworks.base.DEFAULT_VIEW`), and only the tensors asked for are
read. A tensor is what ``torch.load(path, weights_only=True)`` gives for its key: dtype,
shape, strides and storage offset, and two views of one storage share it within one handle.
Each storage of a local file whose bytes are one range of it (a torch zip, a safetensors file,
a legacy file of little-endian storages) is a slice of one private memory map of the file, as ``torch.load(mmap=True)`` makes: nothing is
copied or read until it is touched, and writing to a tensor never reaches the file. Other
storages (remote files, DCP chunks, a directory's members, consolidated views, big-endian or
packed bytes) are read into memory, by ranges for a remote file.

docs/python.md documents both with examples.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.selection import (
    COMPONENT_OR_SECTION,
    Selection,
    add_recorded_aliases,
    component_section,
    dequantized_subclasses,
    refuse_incomplete,
    refuse_placeholders,
    refuse_without_model,
    select,
)
from ckpttool.errors import (
    CheckpointKeyError,
    CkptError,
    CorruptCheckpointError,
    InputError,
    name_file,
)
from ckpttool.frameworks.base import DEFAULT_VIEW
from ckpttool.model.dtypes import ELEMENTS_PER_BYTE
from ckpttool.model.records import (
    ITEMSIZE,
    StorageRecord,
    TensorRecord,
)

if TYPE_CHECKING:
    import torch


class CheckpointHandle:
    """An opened checkpoint whose tensors are read one at a time (:func:`open`)."""

    def __init__(self, ckpt: Checkpoint, records: dict[str, TensorRecord] | None = None) -> None:
        """``records``: the tensors given, by key (default: every tensor of ``ckpt``)."""
        self._ckpt = ckpt
        if records is None:
            records = {record.key: record for record in ckpt.tensors()}
        self._records = records
        # file storage -> torch.UntypedStorage (by the record's fields: a directory's member
        # files each number their storages from "0")
        self._storages: dict[StorageRecord, Any] = {}
        self._map: Any = None  # the file's private memory map (an UntypedStorage), once made
        self._closed = False

    @property
    def checkpoint(self) -> Checkpoint:
        """The opened :class:`~ckpttool.checkpoint.Checkpoint` (records, format facts)."""
        return self._ckpt

    @property
    def name(self) -> str:
        return self._ckpt.name

    def keys(self) -> list[str]:
        """Every tensor's dotted key (``model.layers.0.weight``, ``optimizer.state.0.exp_avg``),
        in file order."""
        return list(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def record(self, key: str) -> TensorRecord:
        """What the file says of tensor ``key`` (dtype, shape, strides, storage), no bytes read."""
        try:
            return self._records[key]
        except KeyError:
            raise CheckpointKeyError(f"{self.name}: no tensor {key!r} in this checkpoint") from None

    def metadata(self) -> dict[str, Any]:
        """The checkpoint's non-tensor fields (``epoch``, ``step``, ``config``...) as the tree
        holds them, tensors left out (a container left empty by that is left out too); objects
        of classes ckpttool does not rebuild are :class:`~ckpttool.model.records.OpaqueObject`.
        A safetensors file gives its ``__metadata__`` (text to text), as ``safe_open`` does."""
        out: dict[str, Any] = dict(self._ckpt.metadata)
        root = _without_tensors(self._ckpt.root)
        if isinstance(root, dict):
            out.update({str(key): value for key, value in root.items()})
        elif root is not _EMPTY:
            out[""] = root
        return out

    def get_tensor(
        self, key: str, *, device: Any = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Tensor ``key`` as ``torch.load(weights_only=True)`` gives it, then moved to
        ``device`` and cast to ``dtype`` if given (``Tensor.to``: a copy only when they
        change it). Raises :class:`~ckpttool.errors.CkptError` (no such key, bytes missing)."""
        self._check_open()
        tensor = self._tensor(self.record(key))
        return _moved(tensor, device, dtype)

    def _tensor(self, record: TensorRecord) -> torch.Tensor:
        """The tensor of ``record``; errors name the file (as the command line's do). A
        0-element placeholder for values the file does not hold (a DeepSpeed ZeRO-3 rank's
        model states) is refused, never given as the weight."""
        if record.numel == 0:
            refuse_placeholders(self._ckpt, [record.key])
        try:
            return self._build(record)
        except CkptError as error:
            from ckpttool.io.source import shown_name

            raise name_file(error, shown_name(self.name)) from None

    def get_slice(self, key: str) -> TensorSlice:
        """Part of tensor ``key``: ``handle.get_slice(key)[10:20]`` reads only the bytes of rows
        10 to 19 when the tensor is contiguous (other slices read the tensor, then index it)."""
        self._check_open()
        return TensorSlice(self, self.record(key))

    def close(self) -> None:
        """Close the file. Tensors already returned stay valid (a memory map lives as long as
        a tensor uses it)."""
        if not self._closed:
            self._closed = True
            self._ckpt.close()
            self._storages.clear()
            self._map = None

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ckpttool.CheckpointHandle {self.name!r} ({len(self._records)} tensors)>"

    def _check_open(self) -> None:
        if self._closed:
            raise InputError(f"{self.name}: the checkpoint handle is closed")

    # -- building tensors -------------------------------------------------------------------

    def _build(self, record: TensorRecord) -> torch.Tensor:
        import torch

        from ckpttool.io.values import read_tensor, torch_dtype

        if record.layout != "strided" or record.quant is not None or record.inline_data is not None:
            # sparse, nested, quantized: rebuilt from their parts as torch.load does
            return _as_loaded(record, read_tensor(self._ckpt, record))
        dtype = torch_dtype(record.dtype)
        if record.storage is None:
            if record.dtensor is not None:
                self._ckpt.read_bytes(record)  # raises: one rank's piece, naming the file
            return _as_loaded(
                record,
                torch.empty_strided(record.shape, record.stride, dtype=dtype, device="meta"),
            )
        storage = self._storage(record.storage, record.key)
        tensor = torch.empty((0,), dtype=dtype)
        if record.dtype in ELEMENTS_PER_BYTE or record.storage.dtype != record.dtype:
            need = record.stored_extent_bytes
        else:
            need = 0
            if all(record.shape):
                last = record.storage_offset + sum(
                    (size - 1) * step for size, step in zip(record.shape, record.stride)
                )
                need = (last + 1) * record.itemsize
        if need > storage.nbytes():
            raise CorruptCheckpointError(f"{record.key}: extends past its storage's bytes")
        tensor.set_(storage, record.storage_offset, record.shape, record.stride)
        return _as_loaded(record, tensor)

    def _storage(self, storage: StorageRecord, key: str) -> Any:
        """One torch storage per file storage: the views of it share it."""
        found = self._storages.get(storage)
        if found is None:
            found = self._storages[storage] = self._make_storage(storage, key)
        return found

    def _make_storage(self, storage: StorageRecord, key: str) -> Any:
        import torch

        ckpt = self._ckpt
        nbytes = storage.nbytes
        span = self._mapped_span(storage)
        if span is not None:
            offset, length = span
            if nbytes > length:
                raise CorruptCheckpointError(f"{key}: extends past its storage's bytes")
            return self._file_map()[offset : offset + nbytes]
        data = ckpt.read_storage(storage, 0, nbytes, key) if nbytes else bytearray()
        if storage.byteorder == "big" and nbytes:
            import numpy as np

            from ckpttool.io.values import _RAW_WIDTH

            width = ITEMSIZE.get(storage.dtype, 1)
            if width > 1:
                swapped = np.frombuffer(data, dtype=_RAW_WIDTH[width]).byteswap()
                data = bytearray(swapped.tobytes())
        if not data:
            return torch.UntypedStorage(0)
        return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()

    def _mapped_span(self, storage: StorageRecord) -> tuple[int, int] | None:
        """(offset, length) in the local file of a storage that can be a slice of its memory
        map, else None."""
        ckpt = self._ckpt
        if (
            ckpt._handle is None
            or ckpt._parsed.read is not None
            or hasattr(ckpt._handle, "read_range")
            or getattr(getattr(ckpt._handle, "raw", None), "read_range", None) is not None
            or storage.byteorder == "big"
            or not os.path.isfile(ckpt.name)
            or ckpt.file_size <= 0
        ):
            return None
        offset, length = ckpt.storage_span(storage)
        # an element at an address not a multiple of its size is read as a copy instead
        if offset % min(ITEMSIZE.get(storage.dtype, 1), 8):
            return None
        return offset, length

    def _file_map(self) -> Any:
        import torch

        if self._map is None:
            size = os.path.getsize(self._ckpt.name)
            self._map = torch.UntypedStorage.from_file(self._ckpt.name, shared=False, nbytes=size)
        return self._map


class TensorSlice:
    """A tensor of a :class:`CheckpointHandle`, indexed without reading it whole
    (``safe_open``'s ``get_slice``)."""

    def __init__(self, handle: CheckpointHandle, record: TensorRecord) -> None:
        self._handle = handle
        self._record = record

    def get_shape(self) -> list[int]:
        return list(self._record.shape)

    def get_dtype(self) -> str:
        return self._record.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows = self._rows(index)
        if rows is None:
            return self._handle.get_tensor(self._record.key)[index].clone()
        start, stop, rest = rows
        try:
            return self._read_rows(start, stop)[rest].clone()
        except CkptError as error:
            from ckpttool.io.source import shown_name

            raise name_file(error, shown_name(self._handle.name)) from None

    def _rows(self, index: Any) -> tuple[int, int, Any] | None:
        """The leading rows ``index`` needs, and the index to apply to them, when only they
        need reading; None: read the tensor."""
        record = self._record
        if (
            record.layout != "strided"
            or record.quant is not None
            or record.inline_data is not None
            or record.storage is None
            or record.dtype in ELEMENTS_PER_BYTE
            or record.storage.dtype != record.dtype
            or record.storage.byteorder == "big"
            or not record.shape
            or not _contiguous(record)
        ):
            return None
        items = index if isinstance(index, tuple) else (index,)
        first, rest = items[0], items[1:]
        rows = record.shape[0]
        if isinstance(first, int) and not isinstance(first, bool):
            row = first + rows if first < 0 else first
            if not 0 <= row < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 of size {rows}")
            return row, row + 1, (0, *rest)
        if isinstance(first, slice):
            start, stop, step = first.indices(rows)
            if step != 1:
                return None
            stop = max(start, stop)
            return start, stop, (slice(None), *rest)
        return None

    def _read_rows(self, start: int, stop: int) -> torch.Tensor:
        import torch

        from ckpttool.io.values import torch_dtype

        record = self._record
        handle = self._handle
        handle._check_open()
        assert record.storage is not None
        shape = (stop - start, *record.shape[1:])
        dtype = torch_dtype(record.dtype)
        row = record.stride[0] if len(record.shape) > 0 else 1
        if stop == start:
            return torch.empty(shape, dtype=dtype)
        first = (record.storage_offset + start * row) * record.itemsize
        last = (record.storage_offset + stop * row) * record.itemsize
        data = handle._ckpt.read_storage(record.storage, first, last, record.key)
        return torch.frombuffer(data, dtype=dtype).view(shape)


def _contiguous(record: TensorRecord) -> bool:
    expected = 1
    for size, step in zip(reversed(record.shape), reversed(record.stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _as_loaded(record: TensorRecord, tensor: torch.Tensor) -> torch.Tensor:
    """A saved ``nn.Parameter`` comes back one, ``requires_grad`` as saved (torch.load)."""
    import torch

    if record.kind == "parameter":
        return torch.nn.Parameter(tensor, requires_grad=record.requires_grad)
    if record.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor


def _moved(tensor: torch.Tensor, device: Any, dtype: torch.dtype | None) -> torch.Tensor:
    import torch

    if tensor.is_meta:  # no values to move: a meta tensor stays one (as torch.load's)
        device = None
    if (device is None or torch.device(device) == tensor.device) and (
        dtype is None or dtype == tensor.dtype
    ):
        return tensor
    with torch.no_grad():
        moved = tensor.to(device=device, dtype=dtype)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved.requires_grad_(tensor.requires_grad) if moved.is_floating_point() else moved


_EMPTY = object()


def _without_tensors(node: Any) -> Any:
    """``node`` with its tensors and containers left empty by them taken out (_EMPTY: nothing
    left)."""
    if isinstance(node, TensorRecord):
        return _EMPTY
    if isinstance(node, dict):
        kept = {k: v for k, v in ((k, _without_tensors(v)) for k, v in node.items())}
        kept = {k: v for k, v in kept.items() if v is not _EMPTY}
        return kept if kept or not node else _EMPTY
    if isinstance(node, (list, tuple)):
        items = [v for v in (_without_tensors(v) for v in node) if v is not _EMPTY]
        if node and not items:
            return _EMPTY
        return type(node)(items) if type(node) in (list, tuple) else items
    return node  # a scalar, text, or an object ckpttool does not rebuild (OpaqueObject)


def open(
    path_or_url: str | os.PathLike[str], *, view: str | None = None, component: str | None = None
) -> CheckpointHandle:
    """Open a checkpoint (a file, a directory or a URL) for reading tensors one at a time,
    safely: its pickle is walked, never run. By default (``view=None``) a directory opens as
    ``convert`` and ``diff`` read it, in the view its layout declares
    (:attr:`~ckpttool.frameworks.base.Framework.default_view`: DeepSpeed ZeRO's consolidated
    fp32 weights, any other layout's files); ``view`` names another (``"files"``: the files as
    stored, as ``show`` lists them; ``"weights"``: a framework's consolidated weights). Use it as
    a context manager. ``component`` names one part of a multi-component folder (a diffusers
    pipeline's ``"unet"``, a sentence-transformers module): only its tensors, keyed as its own
    files store them (``--component``). Raises :class:`~ckpttool.errors.CkptError` subclasses
    with the command line's messages.

    Named as safetensors' ``safe_open``, it is ``ckpttool.open`` to callers; it shadows the
    builtin in this module only (which never calls the builtin), and no other module of the
    package imports it by name."""
    ckpt = open_checkpoint(path_or_url, view=DEFAULT_VIEW if view is None else view)
    if component is None:
        return CheckpointHandle(ckpt)
    try:
        picked = select(ckpt, section=component_section(ckpt, component)).tensors
    except BaseException:
        ckpt.close()
        raise
    return CheckpointHandle(ckpt, dict(picked))


def load_state_dict(
    path_or_url: str | os.PathLike[str],
    *,
    section: str | None = "model",
    keys: Sequence[str] | None = None,
    device: Any = "cpu",
    dtype: torch.dtype | None = None,
    strip_prefix: str | Sequence[str] | None = None,
    ignore_wrappers: bool = False,
    view: str | None = None,
    component: str | None = None,
    dequantize: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's weights as a plain state dict that ``model.load_state_dict`` accepts.

    ``section="model"`` (the default) is the model's weights wherever the checkpoint's layout
    keeps them, as ``diff`` and ``convert`` find them, in the same view (:func:`open`'s):
    ``model`` of a resume checkpoint, ``state_dict`` of a Lightning one, the whole file of a
    state dict or safetensors file, the weights files of a Hugging Face directory, DeepSpeed
    ZeRO's consolidated fp32 weights. Another name is that subtree (``"optimizer"``);
    None: every tensor of the file, by its dotted key. Keys are relative to the section, with
    ``strip_prefix`` (one prefix or several) removed, and DDP/``torch.compile``'s ``module.``
    and ``_orig_mod.`` too with ``ignore_wrappers``. ``keys`` picks some of them (a key that is
    not there raises). Tied weights a safetensors file stored once and declares in its
    metadata are given back under both names, as ``convert`` gives them back. Tensors are
    :meth:`CheckpointHandle.get_tensor`'s (memory-mapped where the file allows it), moved to
    ``device`` and cast to ``dtype`` when given. ``component`` names one part of a
    multi-component folder instead of a section (:func:`open`'s).

    The model is found by its structure where no name says where it is (a learner's
    ``{'model', 'opt'}``, Composer's ``state.model`` beside its RNG state): a file that holds
    only training state (an optimizer, RNG, scheduler state: torchtune's ``recipe_state.pt``)
    raises :class:`~ckpttool.errors.LayoutError` with the default section. ``dequantize``:
    quantized tensors as ``convert --dequantize`` writes them, by the same code: a torchao
    tensor subclass as its dequantized tensor under its own name (``0.weight``, not its inner
    ``0.weight.qdata``, ``.scale``, ``.zero_point``), in its logical dtype; a torch quantized
    tensor (``qint8``...) and a GGUF block-quantized one as their float32 values.
    """
    strip = (strip_prefix,) if isinstance(strip_prefix, str) else tuple(strip_prefix or ())
    with open(path_or_url, view=view) as handle:
        ckpt = handle.checkpoint
        refuse_incomplete(ckpt)  # as convert: a lost file's tensors would be missing
        if component is not None:
            if section not in ("model", None):
                raise InputError(COMPONENT_OR_SECTION)
            section = component_section(ckpt, component)
        if section == "model":
            selected = select(ckpt, strip=strip, ignore_wrappers=ignore_wrappers)
        elif section is None:
            selected = select(
                ckpt, strip=strip, ignore_wrappers=ignore_wrappers, auto_section=False
            )
        else:
            selected = select(ckpt, section=section, strip=strip, ignore_wrappers=ignore_wrappers)
        if section == "model" and selected.section is None and selected.weights is None:
            refuse_without_model(
                ckpt, selected.layout, "no state dict to load",
                "pass section= to take its tensors anyway (section=None: every tensor)",
            )  # fmt: skip
        records = dict(selected.tensors)
        if dequantize:
            from ckpttool.io.values import dense_record

            records = dequantized_subclasses(ckpt, records)[0]
        prefixes = Selection(strip=strip, ignore_wrappers=ignore_wrappers).prefixes
        add_recorded_aliases(ckpt, records, prefixes, [])
        if keys is not None:
            missing = [key for key in keys if key not in records]
            if missing:
                shown = ", ".join(repr(key) for key in missing[:5])
                more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
                raise CheckpointKeyError(
                    f"{ckpt.name}: no tensor {shown}{more} in the selected weights"
                )
            records = {key: records[key] for key in keys}
        refuse_placeholders(ckpt, [record.key for record in records.values()])  # all, at once
        out: dict[str, torch.Tensor] = {}
        for key, record in records.items():
            if dequantize and record.quant is not None:
                record = dense_record(ckpt, record)  # (convert's write reads it so too)
            tensor = handle._tensor(record)
            if isinstance(tensor, _parameter_class()):
                tensor = tensor.data
            out[key] = _moved(tensor, device, dtype)
        return out


def _parameter_class() -> type:
    import torch

    return torch.nn.Parameter


__all__ = ["CheckpointHandle", "TensorSlice", "load_state_dict", "open"]
