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

from ckpttool.frameworks.base import (
    CONFIG,
    INDEX,
    OTHER,
    TRAINING_STATE,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    list_files,
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
    return None


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
    recipe = os.path.join(os.path.dirname(os.path.normpath(path)), RECIPE_STATE_DIR, RECIPE_STATE)
    layout.details["torchtune"] = {
        "epoch": epoch,
        "layout": "epoch_N/ (0.4+)",
        "recipe_state": f"../{RECIPE_STATE_DIR}/{RECIPE_STATE}"
        + ("" if os.path.isfile(recipe) else " (absent: the final epoch, or not resumable)"),
    }
    shards = [SHARD.match(n) for n in files]
    counts = {int(m.group(2)) for m in shards if m}
    if len(counts) == 1:
        (count,) = counts
        have = {int(m.group(1)) for m in shards if m}
        layout.missing += [
            f"model-{i:05d}-of-{count:05d}.*" for i in range(1, count + 1) if i not in have
        ]
    layout.complete = not layout.missing
    return layout


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
