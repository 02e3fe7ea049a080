"""Model folders inside one checkpoint folder, read as its named parts.

A library that saves a model as several model folders (sentence-transformers' modules, a
diffusers pipeline's components) is one checkpoint with named parts: each part's weights (one
file, or shards listed by an index) are members of the directory placed under
``model.<part>`` (sharded ones are merged, then nested by :func:`nest_parts`), and
``details["parts"]`` lists them for ``show``. What each library calls its files stays in its
own plug-in: this module only knows how a model folder keeps its weights.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import CorruptCheckpointError
from ckpttool.frameworks.base import INDEX, WEIGHTS, Member, inside, read_json
from ckpttool.frameworks.base import PARTS as PARTS  # where the parts' details go (show lists them)
from ckpttool.io.source import is_url, join


@dataclass(frozen=True)
class WeightNames:
    """How a library names a model folder's weights, in the order its loader prefers them."""

    singles: tuple[str, ...]  # one file of every weight ("model.safetensors", "pytorch_model.bin")
    indexes: tuple[str, ...]  # the index of a sharded save, the same order
    shards: tuple[re.Pattern[str], ...]  # the shards' names, one per index


def folder_weights(
    directory: str, folder: str, files: dict[str, int], section: str, names: WeightNames
) -> tuple[list[Member], list[str], str | None]:
    """The weights members of the model folder ``folder`` ("" for ``directory`` itself; member
    names are relative to ``directory``), placed at ``section``; the problems between an index
    and its shards; and the index's member name. No members: the folder holds no weights."""
    prefix = f"{folder}/" if folder else ""
    for index, single, shard in zip(names.indexes, names.singles, names.shards):
        if single in files:
            return [Member(prefix + single, WEIGHTS, section, files[single])], [], None
        if index in files:
            return _sharded(directory, prefix, files, index, shard, section)
    return [], [], None


def _sharded(
    directory: str,
    prefix: str,
    files: dict[str, int],
    index: str,
    pattern: re.Pattern[str],
    section: str,
) -> tuple[list[Member], list[str], str | None]:
    path = join(directory, prefix + index)
    mapping = read_json(path)
    weight_map = mapping.get("weight_map") if isinstance(mapping, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(f"{path}: no 'weight_map' of tensor names to file names")
    members = [Member(prefix + index, INDEX, None, files[index], json=True)]
    problems = []
    listed = sorted(set(weight_map.values()))
    for name in listed:
        inside(directory, prefix + name)
        if name not in files:
            problems.append(f"{prefix}{name}: listed in {prefix}{index} but missing")
            continue
        members.append(Member(prefix + name, WEIGHTS, section, files[name], shard=True))
    problems += [
        f"{prefix}{name}: a weight shard that {prefix}{index} does not list"
        for name in files
        if pattern.match(name) and name not in listed
    ]
    return members, problems, prefix + index


def nest_parts(root: dict[str, Any], sections: list[str]) -> None:
    """Move the merged shards of each dotted ``section`` (``model.unet``: the tree merges shards
    into one top-level key) to where the dots say, beside the parts read from one file."""
    for section in sections:
        if "." not in section or section not in root:
            continue
        value = root.pop(section)
        *parents, last = section.split(".")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value


def count_tensors(root: dict[str, Any], section: str) -> int:
    """How many tensors are stored at the dotted ``section`` of the merged tree (0: none)."""
    node: Any = root
    for part in section.split("."):
        if not isinstance(node, dict) or part not in node:
            return 0
        node = node[part]
    return len(node) if isinstance(node, dict) else 0


def part_lines(details: dict[str, Any]) -> list[str]:
    """``show``'s lines for ``details["parts"]``: one per part, in the library's order."""
    parts = details.get(PARTS)
    if not isinstance(parts, list) or not parts:
        return []
    lines = [f"parts:      {len(parts)}"]
    for part in parts:
        where = part.get("folder") or "."
        kind = part.get("type") or ""
        tensors = part.get("tensors", 0)
        held = f"{tensors} tensor{'' if tensors == 1 else 's'}" if tensors else "no weights"
        lines.append(f"  {part['name']:<14} {where + '/':<16} {kind:<28} {held} (key prefix "
                     f"{part['prefix']!r})")  # fmt: skip
    not_read = details.get("not_read")
    if isinstance(not_read, list) and not_read:
        lines.append(f"not read:   {', '.join(not_read)}")
    return lines


def unlisted_folders(path: str, listed: set[str]) -> list[str]:
    """Folders beside the parts that the folder's own list (``modules.json``,
    ``model_index.json``) does not name: its loader never reads them, so neither does ckpttool,
    and ``show`` says so. None over a URL (a folder there cannot be listed)."""
    if is_url(path):
        return []
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return []
    return [f"{e.name}/" for e in entries if e.is_dir() and e.name not in listed]
