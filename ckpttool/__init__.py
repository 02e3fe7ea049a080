"""ckpttool: inspect, compare, convert and repair PyTorch checkpoints; save and resume exactly."""

from __future__ import annotations

__version__ = "0.1.0"

from ckpttool.atomic import atomic_write
from ckpttool.errors import CkptError

__all__ = [
    "CkptError",
    "__version__",
    "atomic_write",
]
