"""GGML's block-quantized types decoded to float32 with NumPy, one tensor at a time.

Each function takes a tensor's blocks (``uint8``, one row per block of the type's size) and
writes its values into ``out`` (``(blocks, block elements)`` float32), by the same arithmetic
in the same order as ``gguf.quants`` (gguf-py 0.19.0, the reference the tests compare with bit for bit):
fp16 scales widened to float32, then ``d * q`` (``+ m`` for the types with a minimum). Types
listed in :data:`DECODERS` decode; every other GGML type (the IQ and ternary ones...) is named
by the reader and refused here with what is decoded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ckpttool.errors import InputError
from ckpttool.model.dtypes import BY_NAME
from ckpttool.model.records import TensorRecord

QK_K = 256
_NIBBLES = np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d, x = np.split(blocks, [2], axis=1)
    # int8 to float32 is exact: the same bits as gguf's x.astype(float32) * d, one pass less
    np.multiply(x.view(np.int8), _f16(d), out=out)


def q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    d, qs = np.hsplit(blocks, [2])
    qs = qs.reshape((n, -1, 1, 16)) >> _NIBBLES
    q = (qs & np.uint8(0x0F)).reshape((n, -1)).astype(np.int8) - np.int8(8)
    np.multiply(_f16(d), q.astype(np.float32), out=out)


def q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    d, rest = np.hsplit(blocks, [2])
    m, qs = np.hsplit(rest, [2])
    qs = qs.reshape((n, -1, 1, 16)) >> _NIBBLES
    q = (qs & np.uint8(0x0F)).reshape((n, -1)).astype(np.float32)
    np.add(_f16(d) * q, _f16(m), out=out)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The 32 five-bit values of each block: four low bits in ``qs``, the fifth in ``qh``."""
    n = qs.shape[0]
    shifts = np.arange(32, dtype=np.uint32).reshape((1, 32))
    high = ((qh.view(np.uint32).reshape((n, 1)) >> shifts) & np.uint32(1)).astype(np.uint8)
    low = ((qs.reshape((n, -1, 1, 16)) >> _NIBBLES) & np.uint8(0x0F)).reshape((n, -1))
    return low | (high << np.uint8(4))


def q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d, rest = np.hsplit(blocks, [2])
    qh, qs = np.hsplit(rest, [4])
    q = _five_bits(qh, qs).astype(np.int8) - np.int8(16)
    np.multiply(_f16(d), q.astype(np.float32), out=out)


def q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d, rest = np.hsplit(blocks, [2])
    m, rest = np.hsplit(rest, [2])
    qh, qs = np.hsplit(rest, [4])
    q = _five_bits(qh, qs).astype(np.float32)
    np.add(_f16(d) * q, _f16(m), out=out)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight 6-bit scales and minimums, packed in 12 bytes."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape((n, 3, 4)), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape((n, 8)), mins.reshape((n, 8))


def q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    d, rest = np.hsplit(blocks, [2])
    dmin, rest = np.hsplit(rest, [2])
    scales, qs = np.hsplit(rest, [12])
    sc, m = _k_scale_min(scales)
    d = (_f16(d) * sc.astype(np.float32)).reshape((n, -1, 1))
    dm = (_f16(dmin) * m.astype(np.float32)).reshape((n, -1, 1))
    qs = qs.reshape((n, -1, 1, 32)) >> _NIBBLES
    q = (qs & np.uint8(0x0F)).reshape((n, -1, 32)).astype(np.float32)
    out[...] = (d * q - dm).reshape((n, QK_K))


def q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    d, rest = np.hsplit(blocks, [2])
    dmin, rest = np.hsplit(rest, [2])
    scales, rest = np.hsplit(rest, [12])
    qh, qs = np.hsplit(rest, [QK_K // 8])
    sc, m = _k_scale_min(scales)
    d = (_f16(d) * sc.astype(np.float32)).reshape((n, -1, 1))
    dm = (_f16(dmin) * m.astype(np.float32)).reshape((n, -1, 1))
    ql = qs.reshape((n, -1, 1, 32)) >> _NIBBLES
    qh = qh.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    ql = (ql & np.uint8(0x0F)).reshape((n, -1, 32))
    qh = (qh & np.uint8(0x01)).reshape((n, -1, 32))
    q = (ql | (qh << np.uint8(4))).astype(np.float32)
    out[...] = (d * q - dm).reshape((n, QK_K))


def q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    ql, rest = np.hsplit(blocks, [QK_K // 2])
    qh, rest = np.hsplit(rest, [QK_K // 4])
    scales, d = np.hsplit(rest, [QK_K // 16])
    d = (_f16(d) * scales.view(np.int8).astype(np.float32)).reshape((n, QK_K // 16, 1))
    ql = ql.reshape((n, -1, 1, 64)) >> _NIBBLES
    ql = (ql & np.uint8(0x0F)).reshape((n, -1, 32))
    qh = qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    qh = (qh & np.uint8(0x03)).reshape((n, -1, 32))
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    q = q.reshape((n, QK_K // 16, -1)).astype(np.float32)
    out[...] = (d * q).reshape((n, QK_K))


def q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    scales, rest = np.hsplit(blocks, [QK_K // 16])
    qs, rest = np.hsplit(rest, [QK_K // 4])
    d, dmin = np.hsplit(rest, [2])
    dl = (_f16(d) * (scales & 0xF).astype(np.float32)).reshape((n, QK_K // 16, 1))
    ml = (_f16(dmin) * (scales >> 4).astype(np.float32)).reshape((n, QK_K // 16, 1))
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    q = ((qs.reshape((n, -1, 1, 32)) >> shift) & np.uint8(3)).reshape((n, QK_K // 16, 16))
    out[...] = (dl * q.astype(np.float32) - ml).reshape((n, -1))


#: GGML type -> its decoder (``blocks``, ``out``: the blocks' values written into ``out``, of
#: shape (blocks, block elements)): the types ckpttool dequantizes.
DECODERS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0,
    "Q2_K": q2_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
}  # fmt: skip
#: Rows of blocks decoded at a time: the float32 temporaries stay a few MB per step.
STEP_BLOCKS = 1 << 14


def decode(record: TensorRecord, data: Any) -> np.ndarray:
    """``record``'s values (float32, its shape) from its stored bytes ``data``."""
    decoder = DECODERS.get(record.dtype)
    if decoder is None:
        raise InputError(
            f"{record.key}: ckpttool does not decode {record.dtype} blocks (it decodes "
            f"{', '.join(DECODERS)}); leave the tensor out with --filter"
        )
    kind = BY_NAME[record.dtype]
    count = record.numel // kind.per_byte  # blocks
    raw = np.frombuffer(data, dtype=np.uint8, count=count * kind.itemsize)
    blocks: np.ndarray = raw.reshape((count, kind.itemsize))
    out = np.empty((count, kind.per_byte), dtype=np.float32)
    # a NaN or infinite fp16 scale decodes to NaN/Inf values: data (verify --values counts
    # them), not a warning
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, count, STEP_BLOCKS):
            stop = start + STEP_BLOCKS
            decoder(blocks[start:stop], out[start:stop])
    return out.reshape(record.shape)
