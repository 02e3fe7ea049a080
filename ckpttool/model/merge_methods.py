"""The arithmetic of ``ckpttool merge``, one tensor at a time: pure functions on flat float64
arrays, following mergekit's own methods as written in its source (arcee-ai/mergekit, commit
0031a40ae4692ee2da83448668048a51bf8bbf4b: ``merge_methods/linear.py``, ``slerp.py``,
``generalized_task_arithmetic.py``, and ``sparsify.py``'s ``magnitude``). docs/merge.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: mergekit's ``slerp``: above this |cos| of the angle the vectors are taken as colinear (lerp).
DOT_THRESHOLD = 0.9995
#: mergekit's ``normalize``: a vector of a norm at most this is not normalised.
NORM_EPS = 1e-8


def linear(tensors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """mergekit ``linear`` (normalize: true): ``sum_i w_i x_i / sum_i w_i``."""
    total = np.zeros_like(tensors[0])
    for x, w in zip(tensors, weights):
        total += w * x
    return total / float(np.sum(np.asarray(weights, dtype=np.float64)))


def magnitude(delta: np.ndarray, density: float) -> np.ndarray:
    """mergekit ``sparsify.magnitude`` without rescaling: keep the ``int(density * n)`` entries
    of largest magnitude (the first of an argsort by descending magnitude), zero the others."""
    if density >= 1:
        return delta
    k = int(density * delta.size)
    if k <= 0:
        raise ValueError(f"--density {density} keeps no entry of a tensor of {delta.size}")
    keep = np.argsort(-np.abs(delta), kind="stable")[:k]
    out = np.zeros_like(delta)
    out[keep] = delta[keep]
    return out


def task_arithmetic(
    base: np.ndarray,
    models: Sequence[np.ndarray],
    weights: Sequence[float],
    lam: float = 1.0,
    *,
    density: float = 1.0,
    consensus: bool = False,
    normalize: bool = False,
) -> np.ndarray:
    """mergekit's generalised task arithmetic: ``task_arithmetic`` (no trimming, no consensus,
    normalize false) and ``ties`` (``magnitude`` trimming, sign consensus by total mass,
    normalize true). ``lam`` scales the mixed delta (mergekit's ``lambda``)."""
    deltas = [w * magnitude(m - base, density) for m, w in zip(models, weights)]
    if consensus:
        mass = np.zeros_like(base)
        for d in deltas:
            mass += d
        elected = np.where(mass >= 0, 1.0, -1.0)  # mergekit: (sum >= 0) * 2 - 1
        mixed = np.zeros_like(base)
        divisor = np.zeros_like(base)
        for d, w in zip(deltas, weights):
            agree = np.sign(d) == elected  # a zero entry agrees with neither sign
            mixed += np.where(agree, d, 0.0)
            divisor += np.where(agree, w, 0.0)
        divisor[divisor == 0] = 1
    else:
        mixed = np.zeros_like(base)
        for d in deltas:
            mixed += d
        total = float(np.sum(np.asarray(weights, dtype=np.float64)))
        divisor = np.full_like(base, 1.0 if abs(total) < 1e-8 else total)
    if normalize:
        mixed /= divisor
    if lam != 1:
        mixed *= lam
    return base + mixed


def slerp(t: float, v0: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """mergekit ``slerp``: the angle from normalised copies, the unnormalised vectors
    interpolated; nearly colinear (|cos| > :data:`DOT_THRESHOLD`): ``(1 - t) v0 + t v1``."""
    n0, n1 = float(np.linalg.norm(v0)), float(np.linalg.norm(v1))
    u0 = v0 / n0 if n0 > NORM_EPS else v0
    u1 = v1 / n1 if n1 > NORM_EPS else v1
    dot = float(np.sum(u0 * u1))
    if abs(dot) > DOT_THRESHOLD:
        return (1 - t) * v0 + t * v1
    theta_0 = np.arccos(dot)
    sin_theta_0 = np.sin(theta_0)
    theta_t = theta_0 * t
    s0 = np.sin(theta_0 - theta_t) / sin_theta_0
    s1 = np.sin(theta_t) / sin_theta_0
    return s0 * v0 + s1 * v1
