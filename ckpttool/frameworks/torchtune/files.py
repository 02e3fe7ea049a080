"""torchtune's checkpoints, by torchtune's own names.

0.6 (``training/checkpointing/_checkpointer.py``, ``_utils.py``): each epoch's weights go to
``{output_dir}/epoch_{N}/``: ``model-{i:05d}-of-{n:05d}.safetensors`` (``SHARD_FNAME``; ``.bin``
without ``safe_serialization``) with ``model.safetensors.index.json`` /
``pytorch_model.bin.index.json``, or ``model-...-of-...`` ``.pt`` from the torchtune and Meta
checkpointers; the adapter as ``adapter_model.pt`` (torchtune's names) and
``adapter_model.safetensors`` (PEFT's), ``adapter_config.json``; the input directory's other
files (``config.json``, tokenizer) copied. The resume state of an intermediate checkpoint
(``seed``, ``epochs_run``, ``total_epochs``, ``max_steps_per_epoch``, ``optimizer``,
``dataloader``) goes to ``{output_dir}/recipe_state/recipe_state.pt``, beside the epochs.

0.2-0.3 wrote everything into ``output_dir`` with the epoch as a suffix:
``hf_model_{i:04d}_{N}.pt``, ``torchtune_model_{N}.pt``, ``meta_model_{N}.pt``,
``adapter_{N}.pt``, ``adapter_model.bin`` and ``recipe_state.pt``.
"""

from __future__ import annotations

import os
import re

from ckpttool.errors import CkptError
from ckpttool.frameworks.base import (
    CONFIG,
    INDEX,
    OTHER,
    TRAINING_STATE,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    list_files,
    open_member,
    run_directory,
)
from ckpttool.io.source import is_dir, is_url

TORCHTUNE = "torchtune"
TITLE = "torchtune checkpoint"
EPOCH_DIRECTORY = re.compile(r"^epoch_(\d+)$")
SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.(safetensors|bin|pt)$")  # SHARD_FNAME
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ADAPTERS = ("adapter_model.pt", "adapter_model.safetensors", "adapter_model.bin")
ADAPTER_CONFIG = "adapter_config.json"
RECIPE_STATE_DIR, RECIPE_STATE = "recipe_state", "recipe_state.pt"
#: Where a run directory keeps the recipe state: 0.6's ``recipe_state/``, else beside the epochs.
RECIPE_STATE_PATHS = (os.path.join(RECIPE_STATE_DIR, RECIPE_STATE), RECIPE_STATE)
#: ``output_dir`` holding the ``epoch_N/`` of one run: listed, each by its epoch.
TORCHTUNE_RUN = "torchtune_run"
RUN_TITLE = "torchtune output directory"
#: 0.2-0.3: every epoch's files side by side, the epoch as a suffix.
FLAT_MODEL = re.compile(r"^(?:hf_model_\d{4}|torchtune_model|meta_model)_(\d+)\.pt$")
FLAT_ADAPTER = re.compile(r"^adapter_(\d+)\.pt$")
#: The recipe state's counters (training/checkpointing/_utils.py's keys).
RECIPE_COUNTERS = ("epochs_run", "total_epochs", "max_steps_per_epoch", "seed")


def detect(path: str) -> FrameworkDirectory | None:
    if is_url(path) or not is_dir(path):
        return None
    files = list_files(path)
    match = EPOCH_DIRECTORY.match(os.path.basename(os.path.normpath(path)))
    if match is not None and any(SHARD.match(n) or n in ADAPTERS for n in files):
        return _epoch_directory(path, files, int(match.group(1)))
    epochs = sorted(
        {int(m.group(1)) for n in files for m in (FLAT_MODEL.match(n), FLAT_ADAPTER.match(n)) if m}
    )
    if epochs:
        return _flat_directory(path, files, epochs)
    return _run_directory(path)


def _run_directory(path: str) -> FrameworkDirectory | None:
    """``output_dir`` of 0.4+: its ``epoch_N/`` listed, and the recipe state beside them."""
    layout = run_directory(path, TORCHTUNE_RUN, RUN_TITLE, EPOCH_DIRECTORY, _epoch_only)
    if layout is None:
        return None
    layout.details["counter"] = "epoch"
    recipe = recipe_state_of(path)
    if recipe is not None:
        layout.details["recipe_state"] = {
            "file": os.path.relpath(recipe, path),
            **read_recipe_state(recipe),
        }
    return layout


def _epoch_only(path: str) -> FrameworkDirectory | None:
    layout = detect(path)
    return layout if layout is not None and not layout.collection else None


def _latest_epoch(run: str) -> int | None:
    """The highest N of the ``epoch_N/`` folders in ``run``."""
    try:
        names = os.listdir(run)
    except OSError:
        return None
    epochs = [int(m.group(1)) for name in names if (m := EPOCH_DIRECTORY.match(name))]
    return max(epochs) if epochs else None


def recipe_state_of(run: str) -> str | None:
    """The recipe state torchtune keeps in the run directory ``run`` (``recipe_state/`` in
    0.6, beside the epochs before), when there is one."""
    for relative in RECIPE_STATE_PATHS:
        candidate = os.path.join(run, relative)
        if os.path.isfile(candidate):
            return candidate
    return None


def read_recipe_state(path: str) -> dict[str, object]:
    """The recipe state's counters and which training states it holds (read by the safe
    reader: no tensor bytes)."""
    with open_member(path) as ckpt:
        root = ckpt.root
    if not isinstance(root, dict):
        return {}
    found: dict[str, object] = {
        key: root[key]
        for key in RECIPE_COUNTERS
        if isinstance(root.get(key), int) and not isinstance(root.get(key), bool)
    }
    found["optimizer"] = isinstance(root.get("optimizer"), dict)
    found["dataloader"] = "dataloader" in root
    return found


def _epoch_directory(path: str, files: dict[str, int], epoch: int) -> FrameworkDirectory:
    members = []
    for name, size in files.items():
        if SHARD.match(name):
            members.append(Member(name, WEIGHTS, "model", size, shard=True))
        elif name in SHARD_INDEXES:
            members.append(Member(name, INDEX, None, size))
        elif name in ADAPTERS:
            section = "adapter" if name.endswith(".pt") else "adapter_" + name.rpartition(".")[2]
            members.append(Member(name, WEIGHTS, section, size))
        elif name == ADAPTER_CONFIG:
            members.append(Member(name, CONFIG, "adapter_config", size, json=True))
        else:
            members.append(Member(name, OTHER, None, size))
    layout = FrameworkDirectory(kind=TORCHTUNE, title=TITLE, directory=path, members=members)
    run = os.path.dirname(os.path.abspath(path))
    recipe = recipe_state_of(run)
    latest = _latest_epoch(run)
    if recipe is None:
        said = f"../{RECIPE_STATE_DIR}/{RECIPE_STATE} (absent: the final epoch, or not resumable)"
    elif latest is not None and latest != epoch:  # the run's resume state is the last epoch's
        said = (
            f"../{os.path.relpath(recipe, run)} is the run's, saved with epoch_{latest}: not "
            "this epoch's"
        )
        recipe = None
    else:
        said = "../" + os.path.relpath(recipe, run)
    layout.details["torchtune"] = {
        "epoch": epoch,
        "layout": "epoch_N/ (0.4+)",
        "recipe_state": said,
    }
    layout.found = recipe  # read by check_tree: the recipe state saved with these weights
    # the shards an index lists and the directory lacks (the count in the names below cannot
    # tell when every shard of a name is gone)
    listed = [
        f"{name} (listed in {index})"
        for index in SHARD_INDEXES
        if index in files
        for name in _listed_shards(layout, index)
        if name not in files
    ]
    layout.missing += listed
    shards = [SHARD.match(n) for n in files]
    counts = {int(m.group(2)) for m in shards if m}
    if len(counts) == 1:
        (count,) = counts
        have = {int(m.group(1)) for m in shards if m}
        layout.missing += [
            f"model-{i:05d}-of-{count:05d}.*"
            for i in range(1, count + 1)
            if i not in have
            and not any(n.startswith(f"model-{i:05d}-of-{count:05d}.") for n in listed)
        ]
    layout.complete = not layout.missing
    return layout


def _listed_shards(layout: FrameworkDirectory, index: str) -> list[str]:
    """The file names the index ``index`` of ``layout`` maps tensors to (a broken index: none
    here; reading the checkpoint reports it)."""
    try:
        mapping = layout.read_json(index)
    except CkptError:
        return []
    weight_map = mapping.get("weight_map") if isinstance(mapping, dict) else None
    if not isinstance(weight_map, dict):
        return []
    return sorted({name for name in weight_map.values() if isinstance(name, str)})


def _flat_directory(path: str, files: dict[str, int], epochs: list[int]) -> FrameworkDirectory:
    latest = epochs[-1]
    members = []
    for name, size in files.items():
        model, adapter = FLAT_MODEL.match(name), FLAT_ADAPTER.match(name)
        if model and int(model.group(1)) == latest:
            members.append(Member(name, WEIGHTS, "model", size, shard=True))
        elif adapter and int(adapter.group(1)) == latest:
            members.append(Member(name, WEIGHTS, "adapter", size))
        elif name == RECIPE_STATE:
            members.append(Member(name, TRAINING_STATE, "recipe_state", size))
        else:  # other epochs' files: listed, the latest is read
            members.append(Member(name, OTHER, None, size))
    layout = FrameworkDirectory(kind=TORCHTUNE, title=TITLE, directory=path, members=members)
    layout.details["torchtune"] = {
        "epoch": latest,
        "layout": "flat, epoch suffixes (0.2-0.3)",
        "epochs": epochs,
    }
    return layout
