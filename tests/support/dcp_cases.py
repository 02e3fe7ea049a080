"""Shared inputs of the DCP tests: the fixture directory, torch's own reading of it, and damage.

The reference is ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: torch's
converter of a DCP directory to one ``torch.save`` file (run on our own trusted fixture only).
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.helpers import FIXTURES

DCP = FIXTURES / "dcp" / "checkpoint"
DCP_PTH = FIXTURES / "dcp" / "checkpoint.pth"
DCP_SAFETENSORS = FIXTURES / "dcp" / "model.safetensors"
SPLIT_ROWS = "model.lm_head.weight"  # Shard(0): rows 0-7 in __0_0.distcp, 8-15 in __1_0.distcp
SPLIT_COLUMNS = "model.model.layers.0.mlp.down_proj.weight"  # Shard(1): columns split


def torch_reference(tmp: Path) -> dict[str, Any]:
    """The fixture as torch reads it: dcp_to_torch_save, then torch.load."""
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / "reference.pth"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": expected
        dcp_to_torch_save(DCP, out)
    return dict(torch.load(out, weights_only=True))


def copy_dcp(tmp: Path, name: str = "copy") -> Path:
    target = tmp / name
    shutil.copytree(DCP, target)
    return target


def rewrite_metadata(directory: Path, change: Callable[[Any], None]) -> None:
    """Unpickle our own fixture's .metadata with torch's classes, change it, pickle it back."""
    import torch.distributed.checkpoint.metadata  # noqa: F401 - the classes pickle.load needs

    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our committed fixture: trusted
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


class RunsCommand:
    """Pickles as ``os.system(command)``: what a hostile checkpoint hides in a pickle."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def hostile_metadata(directory: Path, marker: Path) -> None:
    """Replace .metadata with a pickle that would create ``marker`` if anything ran it."""
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
