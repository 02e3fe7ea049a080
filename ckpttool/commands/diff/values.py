"""Comparing the values of two tensors, streamed chunk by chunk through the reader.

Why chunks: a diff of two multi-GB checkpoints must not hold either file in memory. Each pair of
tensors is read in runs of :data:`CHUNK` elements (a contiguous tensor's run is one ``pread`` of
exactly its bytes), so peak memory is a constant plus, for a non-contiguous view only, that one
tensor. (Before this module is asked, :func:`ckpttool.commands.diff.run.run_diff` settles pairs of small
plain tensors whose bytes are equal, read in blocks by :mod:`ckpttool.io.read_batch`.) torch is never imported: NumPy works on the raw bytes (imported on first use, so that
``diff --quick`` does not pay for it).

What the verdicts mean (documented in docs/diff.md):

* **bitwise equal**: same dtype and the same bytes, element for element (so ``-0.0`` and ``0.0``
  differ, and so do two NaNs with different payloads);
* **within tolerance**: every element pair is close in ``torch.allclose``'s sense,
  ``|a - b| <= atol + rtol * |b|`` with B as the reference, where infinities must be equal and a
  NaN matches only a NaN in the same position (``equal_nan=True``); integer and bool tensors
  must be exactly equal (a tolerance on a step counter would hide real changes).

Different dtypes are compared after casting both to the wider one (:func:`compare_dtype`), or,
with ``rounded``, after rounding the wider float to the narrower one (:func:`narrower_dtype`) the
way ``tensor.to(dtype)`` does (:mod:`ckpttool.model.cast`): the pair is then bitwise equal exactly when
the narrower side is the wider one saved in its dtype.

The change measures (documented in docs/diff.md) ride the same pass, in float64 accumulators:
the sums of squares of A, of B and of B - A and the dot product of A and B, over the element
pairs where both values are finite, and the count of elements whose value changed (-0.0 and
0.0 are equal, two NaNs are equal). float8/float4 are decoded exactly (as ``show --stats``
decodes them) for the measures only: their verdict stays bitwise. A chunk whose bits agree is
not decoded until the pair is found to differ; when it does, the equal chunks before the first
difference are read once more for their norms (``norms=True``, for ``--by-module`` and ``trend``, measures every chunk).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpttool.io.progress import ProgressCallback
from ckpttool.io.values import MINIFLOATS, as_float, numpy_code, read_array
from ckpttool.model.records import TensorRecord, with_fields

if TYPE_CHECKING:
    import numpy as np

    from ckpttool.checkpoint import Checkpoint

# elements per read and per arithmetic step: 4 MB per float64 temporary (a changed chunk makes
# about a dozen; 1 << 20 put trend and diff --by-module above 128 MB of peak RSS, no faster)
CHUNK = 1 << 19

# dtypes whose values NumPy can decode (bfloat16 through values.as_float); others are compared
# as raw bits only (float8, quantized, bit types).
_DECODABLE = frozenset(
    {"float64", "float32", "float16", "bfloat16", "complex128", "complex64",
     "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ValueDiff:
    """How the values of one tensor pair compare (see the module docstring for the rules)."""

    compared_as: str  # dtype both sides were cast to (their common dtype if they agree)
    numel: int
    bitwise_equal: bool  # same bytes, in compared_as (so never for a widening cast)
    mismatched: int  # elements outside tolerance (integers: not equal)
    max_abs_diff: float | None  # over element pairs where neither is NaN; None: not decoded
    max_rel_diff: float | None  # |a - b| / |b| over the same pairs (inf where b == 0 != a)
    nan_positions_differ: bool
    inf_positions_differ: bool
    # rounded: every element of the wider side, rounded to compared_as, has the narrower side's
    # bits, or both are NaN (torch's own kernels give a rounded NaN different payloads)
    equal_after_rounding: bool = False
    # the change measures (module docstring): measured False when the sums do not cover every
    # element (a bitwise-equal pair not decoded, or a dtype with no numeric values)
    measured: bool = False
    elements: int = 0  # decoded elements (float4: two per byte)
    changed: int = 0  # elements whose value changed
    sum_sq_a: float = 0.0  # over pairs where both are finite
    sum_sq_b: float = 0.0
    sum_sq_diff: float = 0.0
    dot: float = 0.0
    nan_a: int = 0  # NaN and Inf elements on each side
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0

    @property
    def norm_a(self) -> float | None:
        """‖A‖ (Frobenius, finite elements); None: not measured."""
        return math.sqrt(self.sum_sq_a) if self.measured else None

    @property
    def norm_b(self) -> float | None:
        return math.sqrt(self.sum_sq_b) if self.measured else None

    @property
    def diff_norm(self) -> float | None:
        """‖B - A‖ over pairs where both are finite (0 for a bitwise-equal pair)."""
        if self.bitwise_equal:
            return 0.0
        return math.sqrt(self.sum_sq_diff) if self.measured else None

    @property
    def relative_change(self) -> float | None:
        """‖B - A‖ / ‖A‖: 0 when nothing changed, inf when A is zero and B is not."""
        diff = self.diff_norm
        if diff is None:
            return None
        if diff == 0:
            return 0.0
        return diff / math.sqrt(self.sum_sq_a) if self.sum_sq_a > 0 else math.inf

    @property
    def cosine_similarity(self) -> float | None:
        """A·B / (‖A‖ ‖B‖), in [-1, 1]; None when either side is zero or not measured."""
        if not self.measured or self.sum_sq_a <= 0 or self.sum_sq_b <= 0:
            return None
        cosine = self.dot / (math.sqrt(self.sum_sq_a) * math.sqrt(self.sum_sq_b))
        return max(-1.0, min(1.0, cosine))

    @property
    def changed_fraction(self) -> float | None:
        """Elements whose value changed, as a fraction (None: not decoded)."""
        if self.bitwise_equal:
            return 0.0
        if not self.measured:
            return None
        return self.changed / self.elements if self.elements else 0.0

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatched / self.numel if self.numel else 0.0

    @property
    def within_tolerance(self) -> bool:
        return self.mismatched == 0


@functools.lru_cache(maxsize=1024)
def bitwise_equal_values(dtype: str, numel: int, rounded: bool = False) -> ValueDiff:
    """The verdict on two tensors of ``numel`` elements whose bits are equal in ``dtype``:
    one shared object per (dtype, numel), not one per tensor of a 100,000-tensor diff."""
    return ValueDiff(dtype, numel, True, 0, 0.0, 0.0, False, False, rounded)


def equal_values_measured(record: TensorRecord, data: bytes | bytearray, first: int) -> ValueDiff:
    """The verdict on a pair whose bytes are equal (``data``, the tensor's elements from
    element ``first``), with its norms measured (``norms``)."""
    import numpy as np

    raw = np.frombuffer(
        data, dtype=numpy_code(record), count=record.numel, offset=first * record.itemsize
    )
    tally = _Tally(0.0, 0.0)
    if not measurable(record.dtype):
        return bitwise_equal_values(record.dtype, record.numel)
    tally.measure_same(_measured(record, raw))
    return ValueDiff(
        record.dtype, record.numel, True, 0, 0.0, 0.0, False, False,
        **tally.measures(),  # type: ignore[arg-type]
    )  # fmt: skip


class SameMeasures:
    """The norms of a pair whose bytes are equal, added up from ``A``'s bytes as they are read,
    in pieces of whole elements (:func:`ckpttool.io.blocks.equal_ranges`'s ``seen``): the
    verdict :func:`equal_values_measured` gives, without reading the tensor a second time."""

    def __init__(self, record: TensorRecord) -> None:
        self.record = record
        self.tally = _Tally(0.0, 0.0)

    def add(self, piece: memoryview) -> None:
        """Add a piece of the tensor's bytes (whole elements; not kept)."""
        import numpy as np

        raw = np.frombuffer(piece, dtype=numpy_code(self.record))
        try:
            self.tally.measure_same(_measured(self.record, raw))
        finally:
            del raw  # the piece's buffer is reused once this returns

    def verdict(self) -> ValueDiff:
        record = self.record
        return ValueDiff(
            record.dtype, record.numel, True, 0, 0.0, 0.0, False, False,
            **self.tally.measures(),  # type: ignore[arg-type]
        )  # fmt: skip


def decodable(dtype: str) -> bool:
    return dtype in _DECODABLE


def measurable(dtype: str) -> bool:
    """Whether the change measures can be computed for this (common) dtype."""
    return (decodable(dtype) and not dtype.startswith("complex")) or dtype in MINIFLOATS


def compare_dtype(a: str, b: str) -> str | None:
    """The dtype two tensors are compared in: the wider of the two (None: no common dtype).

    NumPy's promotion, which never loses values (int64 with float32 gives float64); bfloat16
    with float16 gives float32, with an integer stays bfloat16, as in torch.
    """
    import numpy as np

    if a == b:
        return a
    if not (decodable(a) and decodable(b)):
        return None
    if "bfloat16" in (a, b):
        other = b if a == "bfloat16" else a
        if other.startswith(("int", "uint", "bool")):
            return "bfloat16"
        return str(np.promote_types(np.float32, np.dtype(other)))
    return str(np.promote_types(np.dtype(a), np.dtype(b)))


# Floating dtypes by precision; a wider one rounds into a narrower one (float16 and bfloat16
# hold different values: neither is the rounding of the other).
_PRECISION = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 1}


def narrower_dtype(a: str, b: str) -> str | None:
    """The float dtype the other of ``a``, ``b`` is rounded to under ``rounded`` (None: none)."""
    if a == b or a not in _PRECISION or b not in _PRECISION or _PRECISION[a] == _PRECISION[b]:
        return None
    return a if _PRECISION[a] < _PRECISION[b] else b


def scalar_value(ckpt: Checkpoint, record: TensorRecord) -> bool | int | float | complex | None:
    """The one element of a one-element tensor as a Python number (None: more, or undecoded)."""
    if record.numel != 1 or not decodable(record.dtype):
        return None
    if record.storage is None and record.inline_data is None:
        return None  # a meta tensor: no value to show
    raw = read_array(ckpt, record).reshape(-1)
    value: bool | int | float | complex = _decoded(record, raw)[0].item()
    return value


def raw_chunks(
    ckpt: Checkpoint,
    record: TensorRecord,
    step: int | None = None,
    only: Collection[int] | None = None,
) -> Iterator[np.ndarray]:
    """The tensor's elements in the order of its view, ``step`` (default CHUNK) at a time, raw
    (``only``: just the chunks of these indices, in order).

    A contiguous tensor is read one run at a time (a record narrowed to the run, so the reader
    ``pread`` s exactly those bytes); a strided view is read once and flattened.
    """
    import numpy as np

    step = step or CHUNK
    if record.numel == 0:
        return
    if record.is_contiguous and record.inline_data is None:
        code = numpy_code(record)
        for start in range(0, record.numel, step):
            if only is not None and start // step not in only:
                continue
            count = min(step, record.numel - start)
            run = with_fields(
                record, shape=(count,), stride=(1,), storage_offset=record.storage_offset + start
            )
            data, first = ckpt.read_bytes(run)
            yield np.frombuffer(data, dtype=code, count=count, offset=first * record.itemsize)
        return
    flat = np.ascontiguousarray(read_array(ckpt, record)).reshape(-1)
    for start in range(0, record.numel, step):
        if only is None or start // step in only:
            yield flat[start : start + step]


def square_sum(x: np.ndarray) -> float:
    """sum(x²) of a 1-D chunk of real values, accumulated in float64: NaN or Inf when ``x``
    holds a NaN or an Inf (a square is never negative), so a finite result says every
    element is finite.

    NumPy's own loop (``einsum``), not ``np.dot``: OpenBLAS splits a long dot product across
    threads, which on a busy machine costs ten times the arithmetic (diff --by-module of two
    1.25 GB files with one element changed: 5.7 s against 2.6 s). ``x`` of any real dtype."""
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):  # (inf or NaN: the caller counts)
        # cast to float64 inside the loop, a buffer at a time: no float64 copy of the chunk
        # (an 8 MB temporary per chunk made the allocator fault in fresh pages, and cost more
        # than the arithmetic)
        return float(np.einsum("i,i->", x, x, dtype=np.float64))


def _dot_self(values: np.ndarray) -> float:
    """sum(values²) of a 1-D float64 array, by NumPy's loop (see :func:`square_sum`)."""
    return _dot(values, values)


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """x·y of two 1-D float64 arrays, by NumPy's own loop: every sum of the change measures
    (see :func:`square_sum` for why not ``np.dot``)."""
    import numpy as np

    return float(np.einsum("i,i->", x, y))


def _bits(raw: np.ndarray) -> np.ndarray:
    """The elements as unsigned integers of their width in native byte order (for bit tests)."""

    native = raw if raw.dtype.isnative else raw.astype(raw.dtype.newbyteorder("="))
    return native.view(f"u{native.dtype.itemsize}")


def _decoded(record: TensorRecord, raw: np.ndarray) -> np.ndarray:
    return as_float(record, raw) if record.dtype == "bfloat16" else raw


class _Tally:
    """Running totals over the chunks of one tensor pair."""

    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.mismatched = 0
        self.max_abs: float | None = 0.0
        self.max_rel: float | None = 0.0
        self.nan_differ = False
        self.inf_differ = False
        # the change measures (ValueDiff's fields of the same names)
        self.elements = self.changed = 0
        self.sum_sq_a = self.sum_sq_b = self.sum_sq_diff = self.dot = 0.0
        self.nan_a = self.nan_b = self.inf_a = self.inf_b = 0

    def measure(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add one chunk pair of decoded real values to the change measures."""
        import numpy as np

        x, y = x.astype(np.float64, copy=False), y.astype(np.float64, copy=False)
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        inf_x, inf_y = np.isinf(x), np.isinf(y)
        self.nan_a += int(np.count_nonzero(nan_x))
        self.nan_b += int(np.count_nonzero(nan_y))
        self.inf_a += int(np.count_nonzero(inf_x))
        self.inf_b += int(np.count_nonzero(inf_y))
        with np.errstate(invalid="ignore"):
            unchanged = (x == y) | (nan_x & nan_y)
        self.elements += x.size
        self.changed += int(x.size - np.count_nonzero(unchanged))
        finite = ~(nan_x | nan_y | inf_x | inf_y)
        if not finite.all():
            x, y = x[finite], y[finite]
        delta = y - x
        self.sum_sq_a += _dot(x, x)
        self.sum_sq_b += _dot(y, y)
        self.sum_sq_diff += _dot(delta, delta)
        self.dot += _dot(x, y)

    def measure_same(self, x: np.ndarray) -> None:
        """Add a chunk whose two sides are equal (``x`` decoded) to the change measures.

        One pass when every element is finite (the usual case): the sum of squares is then
        finite too, so NaN and Inf need no count (see :func:`square_sum`)."""
        import numpy as np

        square = square_sum(x)
        if math.isfinite(square):
            self.elements += x.size
            self.sum_sq_a += square
            self.sum_sq_b += square
            self.dot += square
            return
        # a NaN or Inf in the chunk (or a float64 whose square overflows): count and leave out
        x = x.astype(np.float64, copy=False)
        nan, inf = int(np.count_nonzero(np.isnan(x))), int(np.count_nonzero(np.isinf(x)))
        self.nan_a += nan
        self.nan_b += nan
        self.inf_a += inf
        self.inf_b += inf
        self.elements += x.size
        if nan or inf:
            x = x[np.isfinite(x)]
        with np.errstate(over="ignore"):  # a float64 whose square overflows: inf, as before
            square = _dot_self(x)
        self.sum_sq_a += square
        self.sum_sq_b += square
        self.dot += square

    def measures(self) -> dict[str, int | float | bool]:
        """The measures as ValueDiff keywords."""
        return {
            "measured": True, "elements": self.elements, "changed": self.changed,
            "sum_sq_a": self.sum_sq_a, "sum_sq_b": self.sum_sq_b,
            "sum_sq_diff": self.sum_sq_diff, "dot": self.dot,
            "nan_a": self.nan_a, "nan_b": self.nan_b, "inf_a": self.inf_a, "inf_b": self.inf_b,
        }  # fmt: skip

    def add_bits(self, bits_a: np.ndarray, bits_b: np.ndarray) -> None:
        """Undecodable dtypes (float8...): only which elements differ is known."""
        import numpy as np

        self.mismatched += int(np.count_nonzero(bits_a != bits_b))
        self.max_abs = self.max_rel = None

    def add_exact(self, a: np.ndarray, b: np.ndarray) -> None:
        """Integers and bools: any difference is a mismatch."""
        import numpy as np

        self.mismatched += int(np.count_nonzero(a != b))
        self._extremes(np.abs(a.astype(np.float64) - b.astype(np.float64)), b, None)
        self.measure(a, b)

    def add_float(self, a: np.ndarray, b: np.ndarray) -> None:
        import numpy as np

        work = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
        x, y = a.astype(work, copy=False), b.astype(work, copy=False)
        with np.errstate(invalid="ignore", over="ignore"):
            nan_x, nan_y = np.isnan(x), np.isnan(y)
            same = x == y  # equal infinities included; NaN never
            finite_x, finite_y = np.isfinite(x), np.isfinite(y)
            finite = finite_x & finite_y
            diff = np.abs(x - y)
            diff[same] = 0.0
            unchanged = same | (nan_x & nan_y)
            close = unchanged | (finite & (diff <= self.atol + self.rtol * np.abs(y)))
        self.mismatched += int(close.size - np.count_nonzero(close))
        self.nan_differ = self.nan_differ or bool(np.any(nan_x != nan_y))
        self.inf_differ = self.inf_differ or bool(np.any(np.isinf(x) != np.isinf(y)))
        self._extremes(diff, y, ~(nan_x | nan_y))
        if work is not np.float64:
            return  # complex: no change measures
        # the change measures, from the masks above (what measure() computes, in fewer passes)
        size = x.size
        nan_a, nan_b = int(np.count_nonzero(nan_x)), int(np.count_nonzero(nan_y))
        self.nan_a += nan_a
        self.nan_b += nan_b
        self.inf_a += size - int(np.count_nonzero(finite_x)) - nan_a
        self.inf_b += size - int(np.count_nonzero(finite_y)) - nan_b
        self.elements += size
        self.changed += size - int(np.count_nonzero(unchanged))
        if not finite.all():
            x, y, diff = x[finite], y[finite], diff[finite]
        self.sum_sq_a += _dot(x, x)
        self.sum_sq_b += _dot(y, y)
        self.sum_sq_diff += _dot(diff, diff)
        self.dot += _dot(x, y)

    def _extremes(self, diff: np.ndarray, ref: np.ndarray, valid: np.ndarray | None) -> None:
        import numpy as np

        if valid is not None and not valid.all():  # (all valid: no copies of both)
            diff, ref = diff[valid], ref[valid]
        if diff.size == 0 or self.max_abs is None or self.max_rel is None:
            return
        scale = np.abs(ref).astype(np.float64, copy=False)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / scale)  # b == 0 != a: inf
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))


def compare_values(
    ckpt_a: Checkpoint,
    record_a: TensorRecord,
    ckpt_b: Checkpoint,
    record_b: TensorRecord,
    *,
    rtol: float,
    atol: float,
    rounded: bool = False,
    norms: bool = False,
    progress: ProgressCallback | None = None,
) -> ValueDiff | None:
    """Compare two same-shaped tensors; None when their dtypes have no common dtype.

    Same dtype: a chunk whose bits agree costs one comparison and no arithmetic; only chunks
    that differ are decoded and measured (``norms``: every chunk is, so that a bitwise-equal
    pair has its norms too). ``rounded``: two floats of different precision are compared in
    the narrower dtype, the wider side rounded to it first.
    """
    import numpy as np

    narrow = narrower_dtype(record_a.dtype, record_b.dtype) if rounded else None
    common = narrow or compare_dtype(record_a.dtype, record_b.dtype)
    if common is None:
        return None
    same_dtype = narrow is not None or record_a.dtype == record_b.dtype
    exact = common.startswith(("int", "uint", "bool"))
    measures = measurable(common)
    tally = _Tally(rtol, atol)
    bitwise = same_dtype
    rounds_exactly = narrow is not None
    skipped: list[int] = []  # chunks equal bit for bit, not decoded
    chunks_b = raw_chunks(ckpt_b, record_b)
    for index, raw_a in enumerate(raw_chunks(ckpt_a, record_a)):
        raw_b = next(chunks_b)
        if progress is not None:
            progress(raw_a.nbytes + raw_b.nbytes)
        if narrow is not None:
            raw_a, raw_b = (
                _round(record_a.dtype, raw_a, narrow),
                _round(record_b.dtype, raw_b, narrow),
            )
        if same_dtype:
            bits_a, bits_b = _bits(raw_a), _bits(raw_b)
            if np.array_equal(bits_a, bits_b):
                if measures and (norms or not bitwise):  # (bitwise: no difference yet)
                    tally.measure_same(_measured(record_a, raw_a, narrow))
                else:
                    skipped.append(index)
                continue  # identical bits: nothing else to measure
            bitwise = False
            if not decodable(common):
                tally.add_bits(bits_a, bits_b)
                if measures:
                    tally.measure(_measured(record_a, raw_a), _measured(record_b, raw_b))
                continue
        if narrow is not None:
            from ckpttool.model.cast import widen  # (imports NumPy: not at module import)

            a, b = widen(raw_a, narrow), widen(raw_b, narrow)
            if rounds_exactly:
                rounds_exactly = bool(np.all((bits_a == bits_b) | (np.isnan(a) & np.isnan(b))))
        else:
            a, b = _decoded(record_a, raw_a), _decoded(record_b, raw_b)
        if exact:
            tally.add_exact(a.astype(common), b.astype(common))
        else:
            tally.add_float(a, b)
    if bitwise and not (norms and measures):
        return bitwise_equal_values(common, record_a.numel, narrow is not None)
    if skipped and measures:  # the norms of the chunks that were equal, for ‖A‖ and ‖B‖
        for raw_a in raw_chunks(ckpt_a, record_a, only=frozenset(skipped)):
            if narrow is not None:
                raw_a = _round(record_a.dtype, raw_a, narrow)
            tally.measure_same(_measured(record_a, raw_a, narrow))
    return ValueDiff(
        compared_as=common,
        numel=record_a.numel,
        bitwise_equal=bitwise,
        mismatched=tally.mismatched,
        max_abs_diff=tally.max_abs,
        max_rel_diff=tally.max_rel,
        nan_positions_differ=tally.nan_differ,
        inf_positions_differ=tally.inf_differ,
        equal_after_rounding=rounds_exactly,
        **(tally.measures() if measures else {}),  # type: ignore[arg-type]
    )


def _measured(record: TensorRecord, raw: np.ndarray, narrow: str | None = None) -> np.ndarray:
    """A raw chunk as the real values the change measures add up."""
    if narrow is not None:
        from ckpttool.model.cast import widen

        return widen(raw, narrow)
    if record.dtype in MINIFLOATS or record.dtype == "bfloat16":
        return as_float(record, raw)
    return raw


def _round(dtype: str, raw: np.ndarray, target: str) -> np.ndarray:
    """A chunk held as ``stored_dtype(target)``: rounded as ``tensor.to(target)`` if wider."""
    from ckpttool.model.cast import cast_array

    if dtype == target:
        return raw
    values, _ = cast_array(raw, dtype, target)
    return values
