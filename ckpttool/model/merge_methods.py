"""The arithmetic of ``ckpttool merge``, one tensor at a time: pure functions on flat arrays,
following mergekit's own methods as written in its source (arcee-ai/mergekit, commit
0031a40ae4692ee2da83448668048a51bf8bbf4b: ``merge_methods/linear.py``, ``slerp.py``,
``generalized_task_arithmetic.py``, and ``sparsify.py``'s ``magnitude``). docs/merge.md.

The inputs of a method are taken one at a time (an iterable: the caller reads each input's
tensor when it is asked for it) and added into float64 accumulators in place, widened a
:data:`CHUNK` at a time: no float64 copy of an input is made where the formula does not keep
one. What each method holds at once, in float64 copies of the tensor (``E`` bytes each): linear
1 (the sum), task arithmetic 2 (the base, the mixed task vector), SLERP 1 (the result); plus
one input's tensor as read. TIES (:func:`_ties`) keeps the base and each model as read, with a
bool mask of each model's kept entries (its task vectors recomputed exactly a chunk at a time
when needed), and 1 E: the magnitudes of the model being trimmed, then the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

import numpy as np

#: mergekit's ``slerp``: above this |cos| of the angle the vectors are taken as colinear (lerp).
DOT_THRESHOLD = 0.9995
#: mergekit's ``normalize``: a vector of a norm at most this is not normalised.
NORM_EPS = 1e-8
#: Elements widened to float64 at a time when an input is added into an accumulator: the
#: temporaries stay 2 MiB whatever the tensor's size.
CHUNK = 1 << 18


def chunks(size: int) -> Iterator[slice]:
    """``slice``s of :data:`CHUNK` elements covering ``range(size)``."""
    return (slice(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK))


def as_float64(values: np.ndarray) -> np.ndarray:
    """``values`` (float16, float32 or float64) as a float64 array of their own (exact): a
    base to keep while the models are read, without keeping the base as read."""
    return values.astype(np.float64)


def add_scaled(total: np.ndarray, values: np.ndarray, weight: float | None = None) -> None:
    """``total += weight * values`` in place (``weight`` None: ``total += values``), each
    product formed in float64 from exactly widened values, a chunk at a time."""
    if weight is None:
        np.add(total, values, out=total)  # numpy widens values in its own small buffers
        return
    for part in chunks(total.size):
        scaled = values[part].astype(np.float64)
        scaled *= weight
        total[part] += scaled


def linear(tensors: Iterable[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """mergekit ``linear`` (normalize: true): ``sum_i w_i x_i / sum_i w_i``."""
    total: np.ndarray | None = None
    inputs = iter(tensors)  # (not zip: its reused result tuple would keep the last input)
    for w in weights:
        x = next(inputs)
        if total is None:
            total = np.zeros(x.shape, dtype=np.float64)
        add_scaled(total, x, w)
        del x
    assert total is not None
    total /= float(np.sum(np.asarray(weights, dtype=np.float64)))
    return total


def magnitude(delta: np.ndarray, density: float) -> np.ndarray:
    """mergekit ``sparsify.magnitude`` without rescaling: keep the ``max(1, int(density * n))``
    entries of largest magnitude (the first of an argsort by descending magnitude), zero the
    others. ``delta`` itself at ``density`` 1, else a trimmed copy (:func:`trim`)."""
    if density >= 1:
        return delta
    return trim(delta.copy(), density)


def kept_count(size: int, density: float) -> int:
    """How many entries of a task vector of ``size`` TIES keeps: mergekit 0.1.5's
    ``max(1, int(density * size))`` (at least one of a non-empty tensor)."""
    return min(size, max(1, int(density * size)))


def trim(delta: np.ndarray, density: float, scratch: np.ndarray | None = None) -> np.ndarray:
    """:func:`magnitude` in place on the float64 ``delta`` (returned). Temporaries: the
    magnitudes (in ``scratch``, a float64 array of ``delta``'s size, where given) and a mask."""
    if density >= 1 or delta.size == 0:
        return delta
    keep = _kept(delta.size, lambda part: np.abs(delta[part]), density, scratch)
    np.logical_not(keep, out=keep)
    delta[keep] = 0.0
    return delta


def _kept(
    size: int,
    magnitudes_of: Callable[[slice], np.ndarray],
    density: float,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """The bool mask of the :func:`kept_count` entries of largest magnitude, the magnitudes
    given a chunk at a time by ``magnitudes_of``: the k-th largest found by a partition of a
    float64 copy (``scratch``: no argsort, no index arrays); every entry above it kept, and of
    those equal to it the first ones in index order (where a stable argsort by descending
    magnitude would put them)."""
    k = kept_count(size, density)
    magnitudes = np.empty(size, dtype=np.float64) if scratch is None else scratch.reshape(-1)
    for part in chunks(size):
        magnitudes[part] = magnitudes_of(part)
    magnitudes.partition(size - k)
    threshold = magnitudes[size - k]
    del magnitudes
    keep = np.empty(size, dtype=bool)
    above = 0
    for part in chunks(size):
        np.greater(magnitudes_of(part), threshold, out=keep[part])
        above += int(np.count_nonzero(keep[part]))
    ties = k - above  # entries equal to the threshold still kept, first in index order
    for part in chunks(size):
        if ties <= 0:
            break
        here = np.flatnonzero(magnitudes_of(part) == threshold)[:ties]
        keep[part.start + here] = True
        ties -= len(here)
    return keep


def _task_vector(x: np.ndarray, base: np.ndarray, part: slice) -> np.ndarray:
    """``x - base`` over ``part`` of the flat arrays, exact in float64 (both widened first)."""
    return np.subtract(x[part], base[part], dtype=np.float64)


def _magnitudes(x: np.ndarray, base: np.ndarray, part: slice) -> np.ndarray:
    """``|x - base|`` over ``part``, exact in float64."""
    return np.abs(_task_vector(x, base, part))


def task_arithmetic(
    base: np.ndarray,
    models: Iterable[np.ndarray],
    weights: Sequence[float],
    lam: float = 1.0,
    *,
    density: float = 1.0,
    consensus: bool = False,
    normalize: bool = False,
) -> np.ndarray:
    """mergekit's generalised task arithmetic: ``task_arithmetic`` (no trimming, no consensus,
    normalize false) and ``ties`` (``magnitude`` trimming, sign consensus by total mass,
    normalize true). ``lam`` scales the mixed delta (mergekit's ``lambda``). ``models`` are
    taken one at a time; without ``consensus`` each is added into the mixed delta and dropped;
    with it, :func:`_ties`."""
    weights = list(weights)
    inputs = iter(models)  # (not zip: its reused result tuple would keep the last input)
    if consensus:
        return _ties(base, inputs, weights, lam, density, normalize)
    base = base.astype(np.float64, copy=False)
    mixed = np.zeros_like(base)
    # the magnitudes of each task vector as it is trimmed
    scratch = np.empty_like(base) if density < 1 else None
    for w in weights:
        x = next(inputs)
        if density >= 1:  # w (x - b), a chunk at a time
            for part in chunks(base.size):
                delta = x[part] - base[part]
                delta *= w
                mixed[part] += delta
        else:
            delta = np.subtract(x, base, dtype=np.float64)
            del x  # the input as read: not needed once its task vector is made
            trim(delta, density, scratch)
            delta *= w
            mixed += delta
            del delta
    del scratch
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    if normalize:
        mixed /= 1.0 if abs(total) < 1e-8 else total
    if lam != 1:
        mixed *= lam
    mixed += base
    return mixed


def _ties(
    base: np.ndarray,
    inputs: Iterator[np.ndarray],
    weights: list[float],
    lam: float,
    density: float,
    normalize: bool,
) -> np.ndarray:
    """TIES: ``e_i = w_i trim(x_i - b)``; the elected sign of each entry is that of the total
    mass ``sum_i e_i``; the merge is ``b + lam * sum_(agreeing i) e_i / sum_(agreeing i) w_i``.

    The vote and the disjoint merge need every task vector, so each model is kept as read
    (its own dtype) with the bool mask of its kept entries, and its task vector recomputed
    exactly, a chunk at a time, for the vote and the merge of that chunk; the base is kept as
    read too. Held at once, beside the base and the models: while a model is trimmed, its
    magnitudes (1 E, in float64 copies ``E`` of the tensor); then the result, in their place.
    The mass and the elected signs are a chunk's."""
    size = base.size
    flat_base = base.reshape(-1)
    scratch = np.empty(size, dtype=np.float64) if density < 1 else None
    kept: list[tuple[np.ndarray, np.ndarray | None, float]] = []
    for w in weights:
        x = next(inputs).reshape(-1)
        keep = (
            None
            if density >= 1 or size == 0
            else _kept(size, partial(_magnitudes, x, flat_base), density, scratch)
        )  # fmt: skip
        kept.append((x, keep, w))
        del x, keep
    result = np.empty(size, dtype=np.float64) if scratch is None else scratch
    del scratch
    for part in chunks(size):
        deltas = []
        mass = np.zeros(part.stop - part.start, dtype=np.float64)
        for x, keep, w in kept:
            delta = _task_vector(x, flat_base, part)
            if keep is not None:
                delta[~keep[part]] = 0.0
            delta *= w
            mass += delta
            deltas.append(delta)
        positive = mass >= 0  # mergekit: (sum >= 0) * 2 - 1
        mixed = np.zeros_like(mass)
        divisor = np.zeros_like(mass)
        for (_, _, w), delta in zip(kept, deltas):
            # an entry agrees when its sign is the elected one (a zero agrees with neither)
            agree = ((delta > 0) & positive) | ((delta < 0) & ~positive)
            np.add(mixed, delta, out=mixed, where=agree)
            np.add(divisor, w, out=divisor, where=agree)
        if normalize:
            divisor[divisor == 0] = 1
            mixed /= divisor
        if lam != 1:
            mixed *= lam
        mixed += flat_base[part]
        result[part] = mixed
    return result.reshape(base.shape)


def slerp(t: float, v0: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """mergekit ``slerp``: the angle from normalised copies, the unnormalised vectors
    interpolated; nearly colinear (|cos| > :data:`DOT_THRESHOLD`): ``(1 - t) v0 + t v1``."""
    n0 = float(np.linalg.norm(v0.astype(np.float64, copy=False)))
    n1 = float(np.linalg.norm(v1.astype(np.float64, copy=False)))
    dot = 0.0
    for part in chunks(v0.size):  # the normalised copies a chunk at a time
        u0, u1 = v0[part].astype(np.float64), v1[part].astype(np.float64)
        if n0 > NORM_EPS:
            u0 /= n0
        if n1 > NORM_EPS:
            u1 /= n1
        u0 *= u1
        dot += float(np.sum(u0))
    if abs(dot) > DOT_THRESHOLD:
        s0, s1 = 1 - t, t
    else:
        theta_0 = np.arccos(dot)
        sin_theta_0 = np.sin(theta_0)
        theta_t = theta_0 * t
        s0 = np.sin(theta_0 - theta_t) / sin_theta_0
        s1 = np.sin(theta_t) / sin_theta_0
    out = np.multiply(v0, s0, dtype=np.float64)
    for part in chunks(out.size):
        scaled = v1[part].astype(np.float64)
        scaled *= s1
        out[part] += scaled
    return out
