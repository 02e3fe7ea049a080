"""The layout matrix's table: every registered layout with a fixture of it, and its damaged copies.

A *registered layout* is a name ckpttool answers for through a registry: every layout a
framework of :data:`ckpttool.frameworks.registry.FRAMEWORKS` detects, every format of
:mod:`ckpttool.formats.registry` (by id), and every layout :mod:`ckpttool.model.roles` takes as
declared (:data:`~ckpttool.model.roles.DECLARED_LAYOUTS`). A new layout joins the matrix
(``tests/test_matrix.py``) by being registered: the coverage test fails until :data:`TABLE`
names a fixture for it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support import containers
from tests.support.helpers import FIXTURES

#: Files that hold a checkpoint's data (the ones a damaged copy truncates or loses).
DATA_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".distcp", ".gguf", ".ckpt")


@dataclass(frozen=True)
class Fixture:
    """One fixture of a registered layout, as the matrix uses it."""

    layout: str  # the registered id: show --json's "layout" or "format"
    path: str  # under tests/fixtures/, or a name for ``build``
    tensors: bool = True  # has model weights: convert, edit, average, merge apply
    collection: bool = False  # a run directory of several checkpoints (show, verify only)
    build: Callable[[], bytes] | None = None  # a generated file (no committed fixture)
    refused: str | None = None  # what show says refusing it (a format ckpttool reads no values of)
    #: the layout records which files it holds, so a deleted one is damage it can see; a folder
    #: of parts records none (a part deleted leaves a smaller folder of parts: docs/formats.md)
    records_files: bool = True

    @property
    def id(self) -> str:
        return self.layout

    def copy_to(self, directory: Path) -> Path:
        """A copy of the fixture under ``directory`` (its own name kept), to damage or compare."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.build is not None:
            target = directory / self.path
            target.write_bytes(self.build())
            return target
        source = FIXTURES / self.path
        target = directory / source.name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copyfile(source, target)
        return target


#: One fixture per registered layout (several where one would leave a kind of it out).
TABLE: tuple[Fixture, ...] = (
    # frameworks (ckpttool/frameworks/registry.py)
    Fixture("lightning_sharded", "frameworks/lightning_sharded/checkpoints/epoch=2-step=4"),
    Fixture("torchtitan", "frameworks/torchtitan/checkpoint/step-3"),
    Fixture("torchtitan_run", "frameworks/torchtitan/checkpoint", collection=True),
    Fixture("torchtune", "frameworks/torchtune/output/epoch_0"),
    Fixture("torchtune_run", "frameworks/torchtune/output", collection=True),
    Fixture("peft_adapter", "frameworks/peft/lora"),
    Fixture("sentence_transformers", "folders/st_dense"),
    Fixture("diffusers_model", "folders/unet"),
    Fixture("diffusers_ema", "folders/unet_ema"),
    Fixture("diffusers_pipeline", "folders/ldm_pipeline"),
    Fixture("accelerate", "frameworks/accelerate_1proc/state"),
    Fixture("hf_model", "frameworks/hf_sharded"),
    Fixture("hf_trainer", "frameworks/trainer_1proc/output/checkpoint-8"),
    Fixture("hf_trainer_output", "frameworks/trainer_1proc/output", collection=True),
    Fixture("deepspeed", "deepspeed/stage2_fp32_2proc/checkpoints/global_step4"),
    Fixture("megatron_torch_dist", "frameworks/megatron/tp2/iter_0000010"),
    Fixture("megatron_legacy", "frameworks/megatron/legacy_tp2/iter_0000010"),
    Fixture("rank_set", "frameworks/rank_sets/fsdp2"),
    # a folder of differently named checkpoint files (frameworks/container), each file a part
    Fixture("checkpoint_parts", "wrapped", records_files=False),
    # roles.DECLARED_LAYOUTS beyond the frameworks'
    Fixture("pickled_module", "frameworks/tutorial/whole_model.pt"),
    # formats (ckpttool/formats/registry.py), by id
    Fixture("torch-zip", "minimind/pretrain_32_resume.pth"),
    Fixture("safetensors", "safetensors/model.safetensors"),
    Fixture("gguf", "gguf/llama_f32.gguf"),
    Fixture("torch-legacy", "legacy/state_dict.pth"),
    Fixture("dcp", "dcp/checkpoint"),
    # torch before 0.4 wrote the tar format; no torch since does: a generated one (no tensors)
    Fixture(
        "torch-tar",
        "torch_tar.pth",
        tensors=False,
        build=lambda: containers.torch_tar(containers.BENIGN_PICKLE),
        refused="torch's pre-0.4 tar format",
    ),
)


def registered_layouts() -> set[str]:
    """Every layout id a registry answers for (see the module docstring)."""
    from ckpttool.formats import registry as formats
    from ckpttool.frameworks import registry as frameworks
    from ckpttool.model.roles import DECLARED_LAYOUTS

    ids = {layout for _, layouts in frameworks.FRAMEWORKS for layout in layouts}
    ids |= {f.id for f in (*formats.file_formats(), *formats.directory_formats())}
    return ids | set(DECLARED_LAYOUTS)


def data_files(path: Path) -> list[Path]:
    """The data files of a fixture copy, largest first (a file fixture: itself)."""
    if path.is_file():
        return [path]
    found = [p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES]
    return sorted(found, key=lambda p: (-p.stat().st_size, str(p)))


def truncate_one(path: Path) -> Path:
    """Cut the largest data file of ``path`` to half its size; the file cut."""
    victim = data_files(path)[0]
    size = victim.stat().st_size
    with open(victim, "r+b") as handle:
        handle.truncate(size // 2)
    return victim


#: The roles of a framework directory's members that hold the model's weights (``show --json``'s
#: ``details.members``): a deleted one loses weights, not an optional file (a Trainer's
#: ``optimizer.pt`` is absent by choice with ``save_only_model``).
WEIGHTS_ROLES = ("weights", "model_states", "format_data")


def delete_one(path: Path) -> Path | None:
    """Delete the largest data file that holds weights (a shard, a rank's file) of a
    directory of several; the file deleted (None: a file, or a directory of one)."""
    files = data_files(path)
    if path.is_file() or len(files) < 2:
        return None
    roles = _member_roles(path)
    weights = [f for f in files if roles.get(f.relative_to(path).as_posix()) in WEIGHTS_ROLES]
    indexed = {
        index.parent / name for index in path.rglob("*.index.json")
        for name in json.loads(index.read_text()).get("weight_map", {}).values()
    }  # fmt: skip
    # a shard an index names (in a run directory: one of its checkpoints'): surely needed
    shards = [f for f in (weights or files) if f in indexed]
    victim = (shards or weights or files)[0]
    victim.unlink()
    return victim


def _member_roles(path: Path) -> dict[str, str]:
    """A framework directory's members by name: their roles (empty: no framework's)."""
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.errors import CkptError

    try:
        with open_checkpoint(str(path)) as ckpt:
            members = ckpt.details.get("members") or []
    except CkptError:
        return {}
    return {m["name"]: m.get("role", "") for m in members if isinstance(m, dict)}


def tree_hash(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by relative name and SHA-256."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


# --- a copy with one tensor and one non-tensor field changed, by the library that wrote it ----

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def change_tensor_and_field(path: Path) -> tuple[bool, str | None]:
    """Change one floating tensor of the copy at ``path`` (its first element, +1) and one
    non-tensor field (an int, float or string in a dict), each rewritten by the library that
    wrote its file (torch.save, safetensors, torch.distributed.checkpoint; a GGUF's tensor bytes
    in place). Returns whether a tensor was changed and the changed field's key (None: the
    layout keeps no such field in a file this can rewrite)."""
    files = sorted(data_files(path), key=str)
    changed = False
    for file in files:
        if file.suffix == ".safetensors" and _change_safetensors(file):
            changed = True
            break
        if file.suffix in PICKLE_SUFFIXES and _rewrite_pickle(file, tensor=True) is not None:
            changed = True
            break
    field = None
    for file in files:
        if file.suffix in PICKLE_SUFFIXES:
            field = _rewrite_pickle(file, tensor=False)
            if field is not None:
                break
    dcp_root = next((f.parent for f in files if f.suffix == ".distcp"), None)
    if dcp_root is not None and (not changed or field is None):
        changed_here, field_here = _change_dcp(dcp_root, tensor=not changed, field=field is None)
        changed = changed or changed_here
        field = field or field_here
    if not changed and files and files[0].suffix == ".gguf":
        changed = _change_gguf(files[0])
    return changed, field


def _bump(tensor: object) -> None:
    """Change a floating tensor's first element: +1, or 0 where +1 leaves it as it was (an
    infinity, a value too large for +1 to show: a callback's ``kth_value`` of ``inf``)."""
    import torch

    flat = tensor.view(-1)  # type: ignore[attr-defined]
    with torch.no_grad():
        old = flat[0].item()
        flat[0] = old + 1
        if flat[0].item() == old or flat[0].item() != flat[0].item():
            flat[0] = 0.0 if old != 0 else 1.0


def _first_float(obj: object) -> object:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() and obj.numel() else None
    if isinstance(obj, torch.nn.Module):
        return _first_float(obj.state_dict())
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    for value in items:
        found = _first_float(value)
        if found is not None:
            return found
    return None


def _change_field(obj: object) -> str | None:
    """Change the first int/float/str value of a dict in ``obj`` (depth first); its key."""
    if not isinstance(obj, dict):
        return None
    for key, value in obj.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float | str) and isinstance(key, str):
            obj[key] = value + "x" if isinstance(value, str) else value + 1
            return key
    for value in obj.values():
        found = _change_field(value)
        if found is not None:
            return found
    return None


def remove_field(path: Path) -> str | None:
    """Delete one non-tensor field (an int, float or string in a dict, the first
    :func:`_change_field` would change) from the first pickled file of the copy at ``path``
    that has one, rewritten by torch.save; its key (None: no pickled file holds one)."""
    import zipfile

    import torch

    for file in sorted(data_files(path), key=str):
        if file.suffix not in PICKLE_SUFFIXES:
            continue
        obj = torch.load(file, map_location="cpu", weights_only=False)
        key = _delete_field(obj)
        if key is not None:
            torch.save(obj, file, _use_new_zipfile_serialization=zipfile.is_zipfile(file))
            return key
    return None


def _delete_field(obj: object) -> str | None:
    if not isinstance(obj, dict):
        return None
    for key, value in obj.items():
        scalar = isinstance(value, int | float | str) and not isinstance(value, bool)
        if scalar and isinstance(key, str):
            del obj[key]
            return key
    for value in obj.values():
        found = _delete_field(value)
        if found is not None:
            return found
    return None


def _rewrite_pickle(file: Path, *, tensor: bool) -> str | None:
    """torch.load, change (a tensor or a field), torch.save in the file's own container."""
    import zipfile

    import torch

    obj = torch.load(file, map_location="cpu", weights_only=False)
    if tensor:
        found = _first_float(obj)
        if found is None:
            return None
        _bump(found)
        key = "tensor"
    else:
        key = _change_field(obj)  # type: ignore[assignment]
        if key is None:
            return None
    zipped = zipfile.is_zipfile(file)
    torch.save(obj, file, _use_new_zipfile_serialization=zipped)
    return key


def _change_safetensors(file: Path) -> bool:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(file), "pt") as handle:
        metadata = handle.metadata()
    loaded = load_file(str(file))
    found = _first_float(dict(sorted(loaded.items())))
    if found is None:
        return False
    _bump(found)
    save_file(loaded, str(file), metadata=metadata)
    return True


def _change_dcp(directory: Path, *, tensor: bool, field: bool) -> tuple[bool, str | None]:
    """A DCP directory read by torch.distributed.checkpoint into one state dict, changed and
    written again by it (its other files kept)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    whole = directory.parent / (directory.name + ".whole.pt")
    dcp_to_torch_save(str(directory), str(whole))
    obj = torch.load(whole, weights_only=False)
    found = _first_float(obj) if tensor else None
    if found is not None:
        _bump(found)
    key = _change_field(obj) if field else None
    torch.save(obj, whole)
    for old in (*directory.glob("*.distcp"), directory / ".metadata"):
        old.unlink()
    torch_save_to_dcp(str(whole), str(directory))
    whole.unlink()
    return found is not None, key


def _change_gguf(file: Path) -> bool:
    """The last byte of a GGUF's data (its last tensor's; GGUF keeps no checksum) changed."""
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01
    file.write_bytes(bytes(data))
    return True
