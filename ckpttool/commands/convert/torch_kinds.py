"""Sparse, quantized and nested tensors kept as they are by ``convert --to pth``.

convert's own ``.pth`` writer (:mod:`ckpttool.formats.torch_zip.writer`) stores plain tensors, one storage
each. These kinds are pickled by torch through its own rebuild functions
(``_rebuild_sparse_tensor``, ``_rebuild_qtensor``, ``_rebuild_nested_tensor``), so a file
holding one is built by torch (each tensor rebuilt by :func:`ckpttool.io.values.read_tensor`)
and written with ``torch.save``: the form ``torch.load(weights_only=True)`` reads. Verification
compares what reads back with the source kind by kind (:func:`same_tensor`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.model.records import TensorRecord

if TYPE_CHECKING:
    import torch

    from ckpttool.checkpoint import Checkpoint


def is_kept_kind(record: TensorRecord) -> bool:
    """A sparse, nested or quantized tensor: what only torch's pickle form can hold."""
    return bool(record.parts) or record.quant is not None


def plain_tensor(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> Any:
    """A contiguous tensor of ``dtype`` and ``shape`` over a copy of its little-endian bytes."""
    import torch

    from ckpttool.io.values import torch_dtype

    target = torch_dtype(dtype)
    if len(data) == 0:
        return torch.empty(shape, dtype=target)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(target).reshape(shape)


def rebuild(ckpt: Checkpoint, record: TensorRecord) -> Any:
    """The tensor torch builds for ``record`` (:func:`ckpttool.io.values.read_tensor`)."""
    from ckpttool.io.values import read_tensor

    with warnings.catch_warnings():  # nested tensors' "prototype stage": not news here
        warnings.simplefilter("ignore", UserWarning)
        return read_tensor(ckpt, record)


def save(handle: BinaryIO, state: dict[str, Any]) -> None:
    """``torch.save`` of ``state`` (a name -> tensor dict; a tensor named twice is shared)."""
    import torch

    with warnings.catch_warnings():  # TypedStorage deprecation inside torch's own pickler
        warnings.simplefilter("ignore", UserWarning)
        torch.save(state, handle)


def same_tensor(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Equal layout, dtype, shape, quantization and stored values (a sparse tensor's
    indices and values as stored, not only its dense values)."""
    import torch

    if want.is_nested or got.is_nested:  # (a nested tensor has no single shape)
        if not (want.is_nested and got.is_nested and want.dtype == got.dtype):
            return False
        parts = list(zip(want.unbind(), got.unbind(), strict=False))
        return len(parts) == want.size(0) == got.size(0) and all(
            torch.equal(a, b) for a, b in parts
        )
    if (want.layout, want.dtype, want.shape) != (got.layout, got.dtype, got.shape):
        return False
    if want.is_quantized != got.is_quantized:
        return False
    if want.is_quantized:
        return _same_quantized(want, got)
    if want.layout == torch.sparse_coo:
        return want.is_coalesced() == got.is_coalesced() and all(
            torch.equal(a, b) for a, b in ((want._indices(), got._indices()),
                                           (want._values(), got._values()))
        )  # fmt: skip
    if want.layout in (torch.sparse_csr, torch.sparse_bsr):
        pairs = [(want.crow_indices(), got.crow_indices()), (want.col_indices(), got.col_indices())]
    elif want.layout in (torch.sparse_csc, torch.sparse_bsc):
        pairs = [(want.ccol_indices(), got.ccol_indices()), (want.row_indices(), got.row_indices())]
    else:
        return bool(torch.equal(want, got))
    pairs.append((want.values(), got.values()))
    return all(torch.equal(a, b) for a, b in pairs)


def _same_quantized(want: torch.Tensor, got: torch.Tensor) -> bool:
    import torch

    if want.qscheme() != got.qscheme() or not torch.equal(want.int_repr(), got.int_repr()):
        return False
    if want.qscheme() == torch.per_tensor_affine:
        return (want.q_scale(), want.q_zero_point()) == (got.q_scale(), got.q_zero_point())
    return (
        want.q_per_channel_axis() == got.q_per_channel_axis()
        and torch.equal(want.q_per_channel_scales(), got.q_per_channel_scales())
        and torch.equal(want.q_per_channel_zero_points(), got.q_per_channel_zero_points())
    )
