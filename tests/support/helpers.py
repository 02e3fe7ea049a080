"""Shared test helpers: the fixture list and a torch-side flattening to compare against."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NOT_CHECKPOINTS = {"torchscript.pt"}


def fixture_files() -> list[Path]:
    """Every committed checkpoint fixture (not the generator, not the TorchScript archive)."""
    return sorted(
        p
        for p in FIXTURES.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc", ".md") and p.name not in NOT_CHECKPOINTS
        and "__pycache__" not in p.parts
        and p.relative_to(FIXTURES).parts[0] != "pairs"  # diff's inputs (one holds a NaN)
        and p.relative_to(FIXTURES).parts[0] != "frameworks"  # tests/test_framework_fixtures.py
        and p.relative_to(FIXTURES).parts[0] != "folders"  # tests/test_folders.py
        # torch.load reads no GGUF: tests/test_gguf.py reads them against the gguf package
        and p.relative_to(FIXTURES).parts[0] != "gguf"
        # torch.load imports ultralytics' classes: tests/test_ultralytics_fixture.py's manifest
        and p.relative_to(FIXTURES).parts[0] != "ultralytics"
        # mmengine's Runner checkpoint is one like any other; its manifest is
        # tests/test_mmengine_fixture.py's
        and not (p.relative_to(FIXTURES).parts[0] == "mmengine" and p.suffix == ".json")
        # torch.load gives torchao's subclasses: tests/test_torchao.py's manifest
        and p.relative_to(FIXTURES).parts[0] != "torchao"
        # DeepSpeed's rank files are torch.save files like any other; its `latest`, JSON and
        # damaged copies are tests/test_deepspeed_*.py's
        and not (p.relative_to(FIXTURES).parts[0] == "deepspeed"
                 and (p.suffix != ".pt" or "damaged" in p.parts))
        and not (p.parent / ".metadata").is_file()  # a DCP directory's parts (tests/test_dcp.py)
    )  # fmt: skip


def fixture_id(path: Path) -> str:
    return str(path.relative_to(FIXTURES))


def flatten_loaded(
    obj: Any, prefix: str = "", holding: frozenset[int] = frozenset()
) -> Iterator[tuple[str, Any]]:
    """(dotted key, tensor or ndarray) for an object torch.load returned, in ckpttool's keys.
    An object that holds itself through its children (omegaconf's ``_parent``) is a leaf where
    it comes back (``holding``: the objects on the path), as ckpttool's back-references are."""
    import numpy as np
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray)):
        yield prefix, obj
        return
    if id(obj) in holding:
        return
    holding = holding | {id(obj)}
    if isinstance(obj, dict):
        items: Any = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    elif isinstance(obj, torch.nn.Module):  # read as its state_dict() (issue 40)
        items = obj.state_dict(keep_vars=True).items()
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).items()
    else:
        return
    for name, value in items:
        yield from flatten_loaded(value, f"{prefix}.{name}" if prefix else name, holding)


def dtype_name(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return str(value.dtype)


def copy_fixture(name: str, tmp_path: Path) -> Path:
    """A fixture copied into ``tmp_path``, for commands that modify their input."""
    target = tmp_path / Path(name).name
    shutil.copyfile(FIXTURES / name, target)
    return target


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
