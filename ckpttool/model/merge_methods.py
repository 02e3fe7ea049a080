"""The arithmetic of ``ckpttool merge``, one tensor at a time: pure functions on flat arrays,
following mergekit's own methods as written in its source (arcee-ai/mergekit, commit
0031a40ae4692ee2da83448668048a51bf8bbf4b: ``merge_methods/linear.py``, ``slerp.py``,
``generalized_task_arithmetic.py``, and ``sparsify.py``'s ``magnitude``). docs/merge.md.

The inputs of a method are taken one at a time (an iterable: the caller reads each input's
tensor when it is asked for it) and added into float64 accumulators in place, widened a
:data:`CHUNK` at a time: no float64 copy of an input is made where the formula does not keep
one. What each method holds at once, in float64 copies of the tensor (``E`` bytes each): linear
1 (the sum), task arithmetic 2 (the base, the mixed task vector), TIES ``n + 3`` for n models,
that is (inputs + 2) (the base; the n weighted trimmed task vectors, which the disjoint merge
needs after the sign election; the mass, then the mixed sum; the magnitudes of the task vector
being trimmed, then the divisor), SLERP 1 (the result); plus one input's tensor as read
and, for TIES, three bool masks (3/8 E).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

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
    """mergekit ``sparsify.magnitude`` without rescaling: keep the ``int(density * n)`` entries
    of largest magnitude (the first of an argsort by descending magnitude), zero the others.
    ``delta`` itself at ``density`` 1, else a trimmed copy (:func:`trim`)."""
    if density >= 1:
        return delta
    return trim(delta.copy(), density)


def trim(delta: np.ndarray, density: float, scratch: np.ndarray | None = None) -> np.ndarray:
    """:func:`magnitude` in place on the float64 ``delta`` (returned): the k-th largest
    magnitude found by a partition (no argsort, no index arrays); every entry above it kept,
    and of those equal to it the first ones in index order (where a stable argsort by
    descending magnitude would put them). Temporaries: the magnitudes (in ``scratch``, a
    float64 array of ``delta``'s size, where given) and two bool masks."""
    if density >= 1:
        return delta
    size = delta.size
    k = int(density * size)
    if k <= 0:
        raise ValueError(f"--density {density} keeps no entry of a tensor of {size}")
    magnitudes = np.abs(delta, out=scratch)
    magnitudes.partition(size - k)
    threshold = magnitudes[size - k]
    np.abs(delta, out=magnitudes)
    keep = magnitudes > threshold
    at = magnitudes == threshold
    del magnitudes
    ties = k - int(np.count_nonzero(keep))  # entries equal to the threshold still kept
    for part in chunks(size):
        if ties <= 0:
            at[part] = False
            continue
        here = np.flatnonzero(at[part])
        if len(here) > ties:
            at[part.start + int(here[ties]) : part.stop] = False
        ties -= min(len(here), ties)
    keep |= at
    del at
    np.logical_not(keep, out=keep)
    delta[keep] = 0.0
    return delta


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
    taken one at a time; without ``consensus`` each is added into the mixed delta and dropped,
    with it each weighted trimmed task vector is kept until the disjoint merge."""
    base = base.astype(np.float64, copy=False)
    weights = list(weights)
    mixed = np.zeros_like(base)
    # the magnitudes of each task vector as it is trimmed, then the divisor: one buffer
    scratch = np.empty_like(base) if density < 1 or consensus else None
    inputs = iter(models)  # (not zip: its reused result tuple would keep the last input)
    if not consensus:
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
        total = float(np.sum(np.asarray(weights, dtype=np.float64)))
        divisor: float | np.ndarray = 1.0 if abs(total) < 1e-8 else total
    else:
        weighted: deque[np.ndarray] = deque()  # e_i = w_i trim(x_i - b): needed after the vote
        for w in weights:
            x = next(inputs)
            delta = np.subtract(x, base, dtype=np.float64)
            del x  # the input as read: not needed once its task vector is made
            trim(delta, density, scratch)
            delta *= w
            mixed += delta  # the total mass, first
            weighted.append(delta)
            del delta
        elected = mixed >= 0  # mergekit: (sum >= 0) * 2 - 1
        mixed[...] = 0.0
        assert scratch is not None
        divisor = scratch
        divisor[...] = 0.0
        agree = np.empty(base.shape, dtype=bool)
        negative = np.empty(base.shape, dtype=bool)
        for w in weights[: len(weighted)]:
            delta = weighted.popleft()  # dropped once added: memory falls as the merge goes
            # an entry agrees when its sign is the elected one (a zero agrees with neither)
            np.greater(delta, 0, out=agree)
            agree &= elected
            np.less(delta, 0, out=negative)
            np.greater(negative, elected, out=negative)  # negative where - was elected
            agree |= negative
            np.add(mixed, delta, out=mixed, where=agree)
            np.add(divisor, w, out=divisor, where=agree)
            del delta
        del agree, negative, elected
        divisor[divisor == 0] = 1
    if normalize:
        mixed /= divisor
    del divisor, scratch
    if lam != 1:
        mixed *= lam
    mixed += base
    return mixed


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
