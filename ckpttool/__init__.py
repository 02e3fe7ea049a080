"""ckpttool: inspect, compare, convert and repair PyTorch checkpoints; save and resume exactly.

The training-loop API (``save_checkpoint``, ``load_checkpoint``, ``resume_training``,
``SkipBatchSampler``...) needs torch; it is imported on first use so that ``ckpttool show``
and the reader start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpttool.errors import CkptError
from ckpttool.version import __version__

_LAZY = {
    "atomic_write": "ckpttool.io.atomic",
    "SkipBatchSampler": "ckpttool.train",
    "capture_rng_state": "ckpttool.train",
    "checkpoint_paths": "ckpttool.train",
    "load_checkpoint": "ckpttool.train",
    "restore_rng_state": "ckpttool.train",
    "resume_training": "ckpttool.train",
    "save_checkpoint": "ckpttool.train",
    "wait_for_save": "ckpttool.train",
    "open_checkpoint": "ckpttool.checkpoint",
    "Checkpoint": "ckpttool.checkpoint",
    "TensorRecord": "ckpttool.model.records",
    # checkpoints as torch tensors, for other code (docs/python.md)
    "open": "ckpttool.library",
    "load_state_dict": "ckpttool.library",
    "CheckpointHandle": "ckpttool.library",
    "TensorSlice": "ckpttool.library",
    "rescale_step": "ckpttool.commands.rescale.run",
    "rescale_fields": "ckpttool.commands.rescale.run",
    # the commands as library functions (docs/: each command's page, "From Python")
    "show": "ckpttool.commands.show",
    "diff": "ckpttool.commands.diff.run",
    "convert": "ckpttool.commands.convert.run",
    "ConvertReport": "ckpttool.commands.convert.run",
    "verify": "ckpttool.commands.verify",
    "scan": "ckpttool.commands.scan",
}

if TYPE_CHECKING:
    from ckpttool.checkpoint import Checkpoint, open_checkpoint
    from ckpttool.commands.convert.run import ConvertReport, convert
    from ckpttool.commands.diff.run import diff
    from ckpttool.commands.rescale.run import rescale_fields, rescale_step
    from ckpttool.commands.scan import scan
    from ckpttool.commands.show import show
    from ckpttool.commands.verify import verify
    from ckpttool.io.atomic import atomic_write
    from ckpttool.library import CheckpointHandle, TensorSlice, load_state_dict, open
    from ckpttool.model.records import TensorRecord
    from ckpttool.train import (
        SkipBatchSampler,
        capture_rng_state,
        checkpoint_paths,
        load_checkpoint,
        restore_rng_state,
        resume_training,
        save_checkpoint,
        wait_for_save,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names too, loaded or not (``dir()``, tab completion), without importing
    them."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Checkpoint",
    "CheckpointHandle",
    "CkptError",
    "ConvertReport",
    "SkipBatchSampler",
    "TensorRecord",
    "TensorSlice",
    "__version__",
    "atomic_write",
    "capture_rng_state",
    "checkpoint_paths",
    "convert",
    "diff",
    "load_checkpoint",
    "load_state_dict",
    "open",
    "open_checkpoint",
    "rescale_fields",
    "rescale_step",
    "restore_rng_state",
    "resume_training",
    "save_checkpoint",
    "scan",
    "show",
    "verify",
    "wait_for_save",
]
