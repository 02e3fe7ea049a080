"""Directories of per-rank ``torch.save`` files: one state dict per rank, holding that rank's
pieces of each DTensor (FSDP2, tensor parallelism) or ShardedTensor (FSDP1's
``SHARDED_STATE_DICT``).

File names, from the writers' own source:

* verl, SkyRL, oumi (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``):
  ``model_world_size_{W}_rank_{R}.pt`` (the weights), ``optim_world_size_{W}_rank_{R}.pt``,
  ``extra_state_world_size_{W}_rank_{R}.pt``, ``fsdp_config.json`` and a ``huggingface/``
  folder holding the model's ``config.json`` (and tokenizer);
* Composer (``composer/utils/checkpoint.py``, sharded): ``{name}-rank{R}.pt``;
* FSDP1 scripts: ``{name}_rank{R}.pt``, ``{name}rank_{R}.pt``, ``rank{R}.pt``...

A directory is a rank set when its files named ``<prefix>rank<R>.pt`` of one prefix (the one
naming the model, when there are several) are all the checkpoint files it holds besides
verl's. Names and sizes only: what the files hold is read when the set is opened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpttool.frameworks.base import (
    CONFIG,
    OPTIMIZER,
    OTHER,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    list_files,
)
from ckpttool.io.source import is_dir, join

RANK_SET = "rank_set"
TITLE = "set of per-rank state dicts"
#: verl's names: what each file is, and the world size it was saved with.
VERL = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
#: Any other per-rank name: ``<prefix>rank<R>.<ext>`` (Composer's ``-rank0.pt``, ``_rank_0.pt``).
RANKED = re.compile(r"^(.*?)rank_?(\d+)\.(pt|pth|bin)$")
VERL_ROLES = {"model": WEIGHTS, "optim": OPTIMIZER, "extra_state": OTHER}
HF_FOLDER = "huggingface"  # verl saves the model's config (and tokenizer) here


@dataclass(frozen=True)
class RankFiles:
    """The weights files of a rank set, by rank, and what their names say."""

    pattern: str  # how the names run, for messages ("model_world_size_2_rank_{R}.pt")
    files: dict[int, str]  # rank -> file name
    world_size: int | None  # from the names (verl); None: not named
    hf_config: bool  # a huggingface/config.json beside them (verl)


def detect(path: str) -> FrameworkDirectory | None:
    if not is_dir(path):
        return None
    files = list_files(path)
    found = _rank_files(files)
    if found is None:
        return None
    ranks, pattern, world, others = found
    members = [
        Member(name, WEIGHTS, None, files[name], rank=rank) for rank, name in sorted(ranks.items())
    ]
    members += [Member(name, role, None, files[name], rank=rank) for name, role, rank in others]
    expected = world if world is not None else max(ranks) + 1
    missing = [pattern.format(R=r) for r in range(expected) if r not in ranks]
    problems = []
    if world is not None and max(ranks) >= world:
        extra = sorted(r for r in ranks if r >= world)
        problems.append(
            f"{pattern.format(R=extra[0])}: rank {extra[0]} of a set saved by {world} ranks"
        )
    hf_config = is_dir(join(path, HF_FOLDER)) and "config.json" in list_files(join(path, HF_FOLDER))
    if hf_config:
        members.append(Member(f"{HF_FOLDER}/config.json", CONFIG, None, 0, json=True))
    info = RankFiles(pattern, ranks, world, hf_config)
    return FrameworkDirectory(
        kind=RANK_SET, title=TITLE, directory=path, members=members, missing=missing,
        problems=problems, complete=not missing,
        details={"world_size": expected, "rank_files": pattern}, found=info,
    )  # fmt: skip


def _rank_files(
    files: dict[str, int],
) -> tuple[dict[int, str], str, int | None, list[tuple[str, str, int]]] | None:
    """(weights files by rank, their name pattern, the world size the names give, the other
    per-rank files as (name, role, rank)), or None when the directory is no rank set."""
    verl: dict[str, dict[int, str]] = {}
    worlds: set[int] = set()
    for name in files:
        match = VERL.match(name)
        if match:
            verl.setdefault(match[1], {})[int(match[3])] = name
            worlds.add(int(match[2]))
    if "model" in verl and len(worlds) == 1:
        (world,) = worlds
        others = [
            (name, VERL_ROLES[kind], rank)
            for kind, by_rank in verl.items()
            if kind != "model"
            for rank, name in sorted(by_rank.items())
        ]
        return verl["model"], f"model_world_size_{world}_rank_{{R}}.pt", world, others
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for name in files:
        match = RANKED.match(name)
        if match and not match[1].endswith("mp_"):  # DeepSpeed's ..._mp_rank_00_...
            separator = "rank_" if name[len(match[1]) :].startswith("rank_") else "rank"
            groups.setdefault((match[1], separator, match[3]), {})[int(match[2])] = name
    if not groups:
        return None
    if len(groups) > 1:  # the one that names the model, else none
        named = [key for key in groups if "model" in key[0].lower()]
        if len(named) != 1:
            return None
        groups = {named[0]: groups[named[0]]}
    (((prefix, separator, ext), ranks),) = groups.items()
    if len(ranks) < 2 and 0 not in ranks:
        return None
    return ranks, f"{prefix}{separator}{{R}}.{ext}", None, []
