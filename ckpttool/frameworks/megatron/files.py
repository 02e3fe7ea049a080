"""Megatron-LM's checkpoint names and how a directory is recognised (names, sizes and the small
JSON file only).

From Megatron-LM's ``megatron/training/checkpointing.py`` and megatron-core's
``megatron/core/dist_checkpointing/`` (0.16.1):

* the save directory holds ``latest_checkpointed_iteration.txt`` (the last iteration saved, or
  ``release``) and one folder per save: ``iter_{iteration:07d}/`` (``release/`` for a release);
* a ``torch_dist`` save (``--ckpt-format torch_dist``, the default since core 0.8) is that folder
  as a torch.distributed.checkpoint directory (``.metadata``, ``__{rank}_{n}.distcp``) plus
  ``common.pt`` (the state dict's entries that are not sharded tensors: ``iteration``,
  ``args``, ``checkpoint_version``...) and ``metadata.json`` (``{"sharded_backend":
  "torch_dist", ...}``, written last by ``dist_checkpointing.save``: its presence is what
  ``check_is_distributed_checkpoint`` tests);
* a legacy save (``--ckpt-format torch``) is one ``torch.save`` per model-parallel rank:
  ``mp_rank_{tp:02d}/model_optim_rng.pt`` without pipeline parallelism,
  ``mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt`` with it (``get_checkpoint_name``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ckpttool.errors import InputError
from ckpttool.frameworks.base import (
    CUSTOM,
    INDEX,
    OTHER,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    list_files,
    read_json,
)
from ckpttool.io.source import is_dir, is_url, join, read_head

TORCH_DIST = "megatron_torch_dist"
LEGACY = "megatron_legacy"
TORCH_DIST_TITLE = "Megatron torch_dist checkpoint"
LEGACY_TITLE = "Megatron legacy checkpoint (mp_rank shards)"

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CONFIG = "metadata.json"  # dist_checkpointing.core.CONFIG_FNAME
COMMON = "common.pt"  # dist_checkpointing.serialization: COMMON_STATE_FNAME
DCP_INDEX = ".metadata"
SHARD_FILE = "model_optim_rng.pt"
#: ``mp_rank_XX`` or ``mp_rank_XX_YYY`` (tensor rank, pipeline rank).
MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
#: The tracker holds an iteration number or ``release``: a few bytes.
MAX_TRACKER_BYTES = 64


@dataclass(frozen=True)
class LegacyShards:
    """A legacy save's shard files by (tensor rank, pipeline rank)."""

    files: dict[tuple[int, int], str]  # (tp, pp) -> "mp_rank_01_000/model_optim_rng.pt"
    tensor_parallel: int
    pipeline_parallel: int
    pipelined: bool  # the folders carry a pipeline rank (``mp_rank_XX_YYY``)


@dataclass(frozen=True)
class Found:
    """What detection found: the save's own folder and the tracker that named it."""

    tracker: str | None = None  # what latest_checkpointed_iteration.txt says
    shards: LegacyShards | None = None
    backend: dict[str, object] = field(default_factory=dict)  # metadata.json


def read_tracker(save_dir: str) -> str:
    """The folder ``latest_checkpointed_iteration.txt`` names (``iter_0000010`` or
    ``release``), as Megatron's ``read_metadata`` reads it."""
    path = join(save_dir, TRACKER)
    try:
        text = read_head(path, MAX_TRACKER_BYTES + 1).decode("utf-8", "replace").strip()
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    if text == RELEASE:
        return RELEASE
    if not text.isdigit() or len(text) > MAX_TRACKER_BYTES:
        raise InputError(
            f"{path}: {text[:40]!r} is neither an iteration number nor 'release' "
            "(Megatron's read_metadata refuses it too)"
        )
    return f"iter_{int(text):07d}"


def detect(path: str) -> FrameworkDirectory | None:
    if not is_dir(path):
        return None
    files = list_files(path)
    tracker = None
    if TRACKER in files:  # a save directory: the folder its tracker names
        tracker = read_tracker(path)
        inner = join(path, tracker)
        if not is_dir(inner):
            raise InputError(
                f"{join(path, TRACKER)}: names {tracker}, which is not in {path} (the save "
                "was interrupted or the folder was removed); name an iteration folder instead"
            )
        path, files = inner, list_files(inner)
    if CONFIG in files:
        return _torch_dist(path, files, tracker)
    return _legacy(path, tracker)


def _torch_dist(path: str, files: dict[str, int], tracker: str | None) -> FrameworkDirectory:
    backend = read_json(join(path, CONFIG))
    if not isinstance(backend, dict) or "sharded_backend" not in backend:
        raise InputError(f"{join(path, CONFIG)}: not Megatron's metadata.json (no sharded_backend)")
    if backend.get("sharded_backend") != "torch_dist":
        raise InputError(
            f"{path}: a Megatron {backend.get('sharded_backend')!r} checkpoint; ckpttool reads "
            "the torch_dist backend only (save with --ckpt-format torch_dist, or convert with "
            "Megatron's checkpoint converter)"
        )
    members = [Member(CONFIG, OTHER, None, files[CONFIG], json=True)]
    missing = [name for name in (DCP_INDEX, COMMON) if name not in files]
    if COMMON in files:
        members.append(Member(COMMON, CUSTOM, None, files[COMMON]))
    # the DCP files are read as one directory (verify checks every item through the DCP
    # reader), not each as a checkpoint file of its own
    members += [
        Member(name, INDEX if name == DCP_INDEX else OTHER, None, size)
        for name, size in files.items()
        if name.endswith(".distcp") or name == DCP_INDEX
    ]
    return FrameworkDirectory(
        kind=TORCH_DIST, title=TORCH_DIST_TITLE, directory=path, members=members,
        missing=missing, complete=not missing,
        details=({"tracker": tracker} if tracker else {}),
        found=Found(tracker=tracker, backend=backend),
    )  # fmt: skip


def _legacy(path: str, tracker: str | None) -> FrameworkDirectory | None:
    folders = _mp_rank_folders(path)
    if not folders:
        return None
    members: list[Member] = []
    shards: dict[tuple[int, int], str] = {}
    missing: list[str] = []
    pipelined = any(pp is not None for _, pp in folders.values())
    problems = []
    if pipelined and any(pp is None for _, pp in folders.values()):
        problems.append("both mp_rank_XX and mp_rank_XX_YYY folders: two saves mixed")
    for name, (tp, pp) in sorted(folders.items()):
        shard_files = list_files(join(path, name))
        if SHARD_FILE not in shard_files:
            missing.append(f"{name}/{SHARD_FILE}")
            continue
        shards[tp, pp or 0] = f"{name}/{SHARD_FILE}"
        members.append(
            Member(f"{name}/{SHARD_FILE}", WEIGHTS, None, shard_files[SHARD_FILE], rank=tp)
        )
    ranks = {tp for tp, _ in folders.values()}
    stages = {pp or 0 for _, pp in folders.values()}
    tensor, pipeline = max(ranks) + 1, max(stages) + 1
    for tp in range(tensor):
        for pp in range(pipeline):
            folder = f"mp_rank_{tp:02d}_{pp:03d}" if pipelined else f"mp_rank_{tp:02d}"
            if folder not in folders:
                missing.append(f"{folder}/{SHARD_FILE}")
    info = LegacyShards(shards, tensor, pipeline, pipelined)
    return FrameworkDirectory(
        kind=LEGACY, title=LEGACY_TITLE, directory=path, members=members,
        missing=sorted(missing), problems=problems, complete=not missing,
        details={"tensor_parallel": tensor, "pipeline_parallel": pipeline,
                 **({"tracker": tracker} if tracker else {})},
        found=Found(tracker=tracker, shards=info),
    )  # fmt: skip


def _mp_rank_folders(path: str) -> dict[str, tuple[int, int | None]]:
    if is_url(path):
        return {}  # a store lists files, not folders: name the folder on disk
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    found: dict[str, tuple[int, int | None]] = {}
    for name in names:
        match = MP_RANK.match(name)
        if match and os.path.isdir(os.path.join(path, name)):
            found[name] = (int(match[1]), None if match[2] is None else int(match[2]))
    return found
