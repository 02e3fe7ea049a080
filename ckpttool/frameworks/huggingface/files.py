"""Hugging Face transformers: ``save_pretrained`` model directories and ``Trainer`` checkpoints.

File names are transformers' own (``modeling_utils``/``trainer.py`` constants; 4.x also wrote
``pytorch_model.bin`` and its shards, which 5.x still loads). What ``Trainer._save_checkpoint``
writes into ``checkpoint-N/``, in order: the weights (``save_model``), ``optimizer.pt`` and
``scheduler.pt``, ``scaler.pt`` (mixed precision only), ``rng_state.pth`` (one process) or
``rng_state_{rank}.pth`` (each of several), ``training_args.bin``, and ``trainer_state.json``
last. Auto-resume (``get_last_checkpoint``) takes the highest ``checkpoint-N`` whatever it
holds, so a save that died part-way makes the resume crash: a folder without
``trainer_state.json``, weights, optimizer or scheduler is reported incomplete.
"""

from __future__ import annotations

import os
import re

from ckpttool.errors import CorruptCheckpointError
from ckpttool.frameworks.base import (
    COLLECTION,
    CONFIG,
    INDEX,
    OTHER,
    RNG,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    inside,
    list_files,
    read_json,
)
from ckpttool.frameworks.trainer_files import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    RNG_STATE_RANK,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
    trainer_members,
)
from ckpttool.io.source import is_dir, is_file, is_url, join

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
BIN_SHARD = re.compile(r"^pytorch_model-\d{5}-of-\d{5}\.bin$")

#: A PEFT model's weights, which Trainer saves in their place (transformers.utils'
#: ``ADAPTER_SAFE_WEIGHTS_NAME``, ``ADAPTER_WEIGHTS_NAME``; the PEFT plug-in reads such a folder).
ADAPTER_WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR
#: What Trainer's rotation (``save_total_limit``, ``trainer_utils.sort_checkpoints``) globs and
#: may delete: ``checkpoint-*`` folders, ordered by the number after the prefix. Only those that
#: match CHECKPOINT_DIR are ever resumed from (``get_last_checkpoint``).
ROTATED_DIR = re.compile(r"^checkpoint-(\d*)")

TRAINER_FILES = (TRAINER_STATE_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME)

HF_MODEL = "hf_model"
HF_TRAINER = "hf_trainer"
HF_TRAINER_OUTPUT = COLLECTION


def weight_map(index: object, path: str) -> dict[str, str]:
    """The ``weight_map`` of an index file: tensor name -> shard file name."""
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise CorruptCheckpointError(f"{path}: no 'weight_map' of tensor names to file names")
    return mapping


def detect(path: str) -> FrameworkDirectory | None:
    """A model directory or a Trainer ``checkpoint-N/`` (or an index file inside one)."""
    index_path = path if path.endswith(".index.json") and is_file(path) else None
    directory = (os.path.dirname(path) or ".") if index_path else path
    if not is_dir(directory):
        return None
    files = list_files(directory)
    trainer = any(name in files for name in TRAINER_FILES) or any(
        RNG_STATE_RANK.match(name) or name == RNG_STATE_NAME for name in files
    )
    parsed_json: dict[str, object] = {}
    members, weights_problems, index_name = _weights(directory, files, index_path, parsed_json)
    if not members and not trainer:
        return None
    layout = HF_TRAINER if trainer else HF_MODEL
    members += trainer_members(files) if trainer else []
    for name, section in ((CONFIG_NAME, "config"), (GENERATION_CONFIG_NAME, "generation_config")):
        if name in files:
            members.append(Member(name, CONFIG, section, files[name], json=True))
    known = {member.name for member in members}
    members += [
        Member(name, OTHER, None, size) for name, size in files.items() if name not in known
    ]
    result = FrameworkDirectory(
        kind=layout,
        title="Hugging Face Trainer checkpoint" if trainer else "Hugging Face model directory",
        directory=directory,
        members=members,
        problems=weights_problems,
        index=index_name,
        parsed_json=parsed_json,
    )
    if trainer:
        _check_trainer(result, files)
    return result


def _weights(
    directory: str, files: dict[str, int], index_path: str | None, parsed: dict[str, object]
) -> tuple[list[Member], list[str], str | None]:
    """The weights members (safetensors preferred, as transformers loads them) and problems."""
    for index_name, single, shard in (
        (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, SAFE_SHARD),
        (WEIGHTS_INDEX_NAME, WEIGHTS_NAME, BIN_SHARD),
    ):
        chosen_index = os.path.basename(index_path) if index_path else None
        if chosen_index is not None and chosen_index != index_name:
            continue
        if index_name in files:
            return _sharded(directory, files, index_name, shard, parsed)
        if single in files:
            return [Member(single, WEIGHTS, "model", files[single])], [], None
        orphans = [name for name in files if shard.match(name)]
        if orphans:
            problem = f"{len(orphans)} weight shards but no {index_name} to say what each holds"
            return (
                [Member(n, WEIGHTS, "model", files[n], shard=True) for n in orphans],
                [problem],
                None,
            )
    if index_path is not None:  # an index file of another name: read it as given
        return _sharded(directory, files, os.path.basename(index_path), None, parsed)
    return [], [], None


def _sharded(
    directory: str,
    files: dict[str, int],
    index_name: str,
    pattern: re.Pattern[str] | None,
    parsed: dict[str, object],
) -> tuple[list[Member], list[str], str | None]:
    index_path = join(directory, index_name)
    parsed[index_name] = read_json(index_path)
    mapping = weight_map(parsed[index_name], index_path)
    shards = sorted(set(mapping.values()))  # file order is save order: -00001-of-, -00002-of-...
    problems = []
    members = [Member(index_name, INDEX, None, files[index_name], json=True)]
    for name in shards:
        inside(directory, name)
        if name not in files:
            problems.append(f"{name}: listed in {index_name} but missing")
            continue
        members.append(Member(name, WEIGHTS, "model", files[name], shard=True))
    if pattern is not None:
        listed = set(shards)
        problems += [
            f"{name}: a weight shard that {index_name} does not list"
            for name in files
            if pattern.match(name) and name not in listed
        ]
    return members, problems, index_name


def _check_trainer(layout: FrameworkDirectory, files: dict[str, int]) -> None:
    """What a resumable Trainer checkpoint must hold, and the counters it records."""
    adapter = any(name in files for name in ADAPTER_WEIGHTS_NAMES)
    if not adapter and not any(m.role == WEIGHTS for m in layout.members):
        layout.missing.append("the model weights (model.safetensors or pytorch_model.bin)")
    for name in (OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME):
        if name not in files:
            layout.missing.append(name)
    ranks = sorted(m.rank for m in layout.members if m.role == RNG and m.rank is not None)
    if ranks:
        layout.details["ranks"] = ranks[-1] + 1
        layout.missing += [f"rng_state_{r}.pth" for r in range(ranks[-1] + 1) if r not in ranks]
    elif RNG_STATE_NAME not in files:
        layout.missing.append(f"{RNG_STATE_NAME} (or rng_state_<rank>.pth)")
    if TRAINER_STATE_NAME in files:
        state = layout.read_json(TRAINER_STATE_NAME)
        if isinstance(state, dict):
            for key in (
                "global_step",
                "epoch",
                "max_steps",
                "train_batch_size",
                "num_train_epochs",
            ):
                if key in state:
                    layout.details[key] = state[key]
    match = CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(layout.directory)))
    if match:
        layout.details["checkpoint_step"] = int(match.group(1))
    layout.complete = not layout.missing and not layout.problems


def detect_output_dir(path: str) -> FrameworkDirectory | None:
    """A Trainer ``output_dir`` holding ``checkpoint-N/`` folders: each listed with its step and
    whether it is complete; Trainer checkpoints under other ``checkpoint-*`` names too (e.g. a
    ``checkpoint-4.ws2``), with ``resumable`` False: rotation counts them, auto-resume never
    takes them. Not one checkpoint: commands other than ``show`` ask for one.
    Local only (a URL names one checkpoint)."""
    if is_url(path) or not os.path.isdir(path):
        return None
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    checkpoints = []
    for name in names:
        match = CHECKPOINT_DIR.match(name)
        rotated = ROTATED_DIR.match(name)
        if not rotated or not os.path.isdir(os.path.join(path, name)):
            continue
        layout = detect(os.path.join(path, name))
        if not match and (layout is None or layout.kind != HF_TRAINER):
            continue  # another folder the glob happens to match: not listed
        complete = layout is not None and layout.complete
        missing = layout.missing if layout is not None else ["every file"]
        step = int(rotated.group(1) or 0)
        checkpoints.append((step, name, complete, missing, match is not None))
    if not checkpoints:
        return None
    checkpoints.sort()
    result = FrameworkDirectory(
        kind=HF_TRAINER_OUTPUT,
        title="Hugging Face Trainer output directory",
        directory=path,
        members=[],
        complete=False,
        collection=True,
    )
    result.details["checkpoints"] = [
        {
            "name": name,
            "step": step,
            "complete": complete,
            "missing": missing,
            "resumable": resumable,
        }
        for step, name, complete, missing, resumable in checkpoints
    ]
    return result
