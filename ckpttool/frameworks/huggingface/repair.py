"""``repair`` of Hugging Face directories: a sharded model's ``*.index.json`` rebuilt from its
shards' headers, and a Trainer ``output_dir`` 's checkpoints in the order auto-resume sees them.

The index is derived data: ``save_pretrained`` writes each shard, then an index naming, for
every tensor, the shard that holds it, with ``metadata.total_size`` (huggingface_hub's
``split_torch_state_dict_into_shards``: the bytes of every distinct storage) and, since
transformers 4.5x, ``metadata.total_parameters``. Rebuilt, it names each tensor the shards hold
(found by reading their headers: a safetensors header, a ``.bin`` shard's pickle; no tensor
bytes but those of a tensor stored twice, compared); the old metadata is kept with
``total_size`` recomputed. A tensor the old index names and no shard holds is lost, and the
index is the only record of it: the rebuilt index keeps naming it where the old one did (and
keeps the old ``total_size``, the whole model's), so that ``verify`` still reports it and
``from_pretrained`` fails on the missing shard instead of filling the tensor with random
values. Its damage line is one the rewrite does not mend (``IndexRepair.stays``).

Auto-resume (``trainer_utils.get_last_checkpoint``) takes the highest ``checkpoint-N`` that
matches ``^checkpoint-(\\d+)$`` whatever it holds; rotation (``sort_checkpoints``,
``save_total_limit``) counts and deletes every ``checkpoint-*`` folder, so an incomplete one
moved aside to ``checkpoint-N.incomplete`` would still take a complete one's place and be
deleted by the next save. It is moved to ``incomplete-checkpoint-N``, outside both.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass

from ckpttool.errors import CkptError, CorruptCheckpointError
from ckpttool.frameworks.base import (
    IndexRepair,
    RunLayout,
    inside,
    list_files,
    open_member,
    read_json,
)
from ckpttool.frameworks.huggingface.files import (
    BIN_SHARD,
    SAFE_SHARD,
    SAFE_WEIGHTS_INDEX_NAME,
    WEIGHTS_INDEX_NAME,
    detect_output_dir,
    weight_map,
)
from ckpttool.io.source import is_url, join

#: Where Trainer's auto-resume and rotation never look (module docstring).
ASIDE_PREFIX = "incomplete-"
#: A shard's number and the count of shards in its name (``-00002-of-00003``).
SHARD_NUMBER = re.compile(r"-(\d+)-of-(\d+)(?=\.)")
#: How many tensor names a damage line gives before "and N more".
SHOWN = 3


def aside_name(name: str) -> str:
    """``checkpoint-8`` -> ``incomplete-checkpoint-8``."""
    return ASIDE_PREFIX + name


def run_layout(directory: str) -> RunLayout | None:
    """A Trainer ``output_dir``: its ``checkpoint-N`` folders by step (those auto-resume can
    pick; other ``checkpoint-*`` names, a rescaled ``checkpoint-4.ws2``, are not listed)."""
    layout = detect_output_dir(directory)
    if layout is None:
        return None
    listed = layout.details.get("checkpoints", [])
    assert isinstance(listed, list)
    names = tuple(c["name"] for c in listed if c["resumable"])
    if not names:
        return None
    return RunLayout(title=layout.title, checkpoints=names, aside=aside_name)


@dataclass
class _Stored:
    """One tensor as a shard stores it."""

    shard: str
    storage: str  # the storage's key inside the shard (tensors sharing it are one storage)
    storage_bytes: int


def rebuild_index(directory: str, *, keep_lost: bool = True) -> IndexRepair | None:
    """The weights index of ``directory`` (safetensors first, as transformers loads them) as its
    shards say it should be; None when it holds no sharded weights and no index. ``keep_lost``
    False: tensors no shard holds are dropped from it (``edit`` dropped them on purpose)."""
    if is_url(directory) or not os.path.isdir(directory):
        return None
    files = list_files(directory)
    for index_name, pattern in (
        (SAFE_WEIGHTS_INDEX_NAME, SAFE_SHARD),
        (WEIGHTS_INDEX_NAME, BIN_SHARD),
    ):
        shards = [name for name in files if pattern.match(name)]
        if index_name in files or shards:
            return _rebuild(directory, set(files), index_name, shards, keep_lost)
    return None


def _rebuild(
    directory: str, files: set[str], index_name: str, shards: list[str], keep_lost: bool
) -> IndexRepair:
    damage: list[str] = []
    old: dict[str, object] | None = None
    old_map: dict[str, str] = {}
    if index_name in files:
        path = join(directory, index_name)
        try:
            parsed = read_json(path)
            old_map = weight_map(parsed, path)
            assert isinstance(parsed, dict)
            old = parsed
        except CkptError as error:
            reason = str(error).removeprefix(f"{path}: ")
            damage.append(f"{index_name}: unreadable ({reason}): rebuilt from the shards")
    else:
        damage.append(
            f"no {index_name}: {len(shards)} weight shards and no index saying what each holds"
        )
    named = sorted(set(old_map.values()))
    for name in named:
        inside(directory, name)  # an index naming a file outside the directory is refused
    gone = [name for name in named if name not in files]
    if old is not None:
        damage += [
            f"{name}: a weight shard that {index_name} does not list"
            for name in shards
            if name not in named
        ]
    missing = _numbering_gaps(shards) if old is None else []
    if missing:  # without the index nothing says what they held: an index without them would
        # make from_pretrained load the model with those weights random
        damage += [
            f"{name}: missing (the shards are numbered 1 to {len(shards) + len(missing)}), and no "
            f"readable {index_name} says what it held: no index is written, so that the model "
            "does not load without its tensors; put the shard back"
            for name in missing
        ]
        return IndexRepair(index_name, tuple(damage), None)
    candidates = sorted(set(shards) | (set(named) - set(gone)))
    holders, stored, unreadable = _read_shards(directory, candidates)
    if unreadable:  # its tensors may be salvaged: the index is not rebuilt without them
        damage += [
            f"{name}: unreadable ({reason}): the index is not rebuilt until it is repaired "
            "(ckpttool repair FILE salvages what it still holds)"
            for name, reason in unreadable.items()
        ]
        return IndexRepair(index_name, tuple(damage), None)
    new_map, duplicates = _choose(directory, holders, old_map)
    damage += duplicates
    lost = sorted(key for key in old_map if key not in new_map)
    stays = _lost_lines(old_map, lost, gone, index_name)
    damage += stays
    if old is not None:
        damage += _stale_lines(old_map, new_map, index_name)
    kept = old.get("metadata") if old is not None else None
    metadata: dict[str, object] = dict(kept) if isinstance(kept, dict) else {}
    old_size = metadata.get("total_size")
    seen = {(stored[key].shard, stored[key].storage): stored[key].storage_bytes for key in new_map}
    if not keep_lost:
        lost = []
    total_size = sum(seen.values()) if not lost or old_size is None else old_size
    size_wrong = old is not None and old_size is not None and old_size != total_size
    if size_wrong and not damage:
        damage.append(f"{index_name}: total_size is {old_size}, the shards hold {total_size}")
    if not new_map:
        damage.append(f"no shard holds a tensor: no {index_name} is written")
        return IndexRepair(index_name, tuple(damage), None, lost=tuple(lost))
    new_map |= {key: old_map[key] for key in lost}  # the only record of them: kept (docstring)
    unchanged = old is not None and new_map == old_map and not size_wrong
    if unchanged:  # damage the index cannot mend (a tensor twice, kept where it was named)
        return IndexRepair(index_name, tuple(damage), None, lost=tuple(lost))
    metadata["total_size"] = total_size
    content = json.dumps({"metadata": metadata, "weight_map": new_map}, indent=2, sort_keys=True)
    changes = _changes(old is not None, old_map, new_map, lost, len(candidates))
    if old_size != total_size:
        changes += f"; total_size {old_size} -> {total_size}" if old is not None else ""
    return IndexRepair(
        index_name,
        tuple(damage),
        (content + "\n").encode(),
        changes,
        lost=tuple(lost),
        stays=tuple(stays),
    )


def _numbering_gaps(shards: list[str]) -> list[str]:
    """The shard names missing from a numbered set (``model-00002-of-00003.safetensors`` when
    the first and third are there), by the ``-of-N`` the names share; [] when they share none."""
    numbered = [SHARD_NUMBER.search(name) for name in shards]
    totals = {m.group(2) for m in numbered if m is not None}
    if len(totals) != 1 or None in numbered:
        return []
    total = totals.pop()
    present = {int(m.group(1)) for m in numbered if m is not None}
    example = shards[0]
    return [
        SHARD_NUMBER.sub(f"-{n:0{len(total)}d}-of-{total}", example)
        for n in range(1, int(total) + 1)
        if n not in present
    ]


def _read_shards(
    directory: str, candidates: list[str]
) -> tuple[dict[str, list[str]], dict[str, _Stored], dict[str, str]]:
    """(tensor key -> the shards holding it, in name order; key -> how its first holder stores
    it; shard -> why it could not be read). Headers only: no tensor bytes are read."""
    holders: dict[str, list[str]] = defaultdict(list)
    stored: dict[str, _Stored] = {}
    unreadable: dict[str, str] = {}
    for name in candidates:
        path = join(directory, name)
        try:
            with open_member(path) as shard:
                records = shard.tensors()
        except CkptError as error:
            unreadable[name] = str(error).removeprefix(f"{path}: ")
            continue
        for record in records:
            holders[record.key].append(name)
            storage = record.storage
            stored.setdefault(
                record.key,
                _Stored(
                    name,
                    storage.key if storage is not None else record.key,
                    storage.nbytes if storage is not None else record.nbytes,
                ),
            )
    return holders, stored, unreadable


def _choose(
    directory: str, holders: dict[str, list[str]], old_map: dict[str, str]
) -> tuple[dict[str, str], list[str]]:
    """Each tensor's shard; a tensor in two shards: both copies byte-identical, the shard the old
    index named (else the first by name); different bytes refused. Damage lines, grouped by the
    shards involved."""
    new_map: dict[str, str] = {}
    twice: dict[tuple[tuple[str, ...], str, bool], list[str]] = defaultdict(list)
    for key in sorted(holders):
        where = holders[key]
        if len(where) == 1:
            new_map[key] = where[0]
            continue
        _same_bytes(directory, key, where)
        chosen = old_map[key] if old_map.get(key) in where else where[0]
        new_map[key] = chosen
        twice[(tuple(where), chosen, old_map.get(key) == chosen)].append(key)
    lines = []
    for (shards, chosen, as_before), keys in twice.items():
        why = "as the old index did" if as_before else "the first by name"
        lines.append(
            f"{_count(keys)} stored in {' and '.join(shards)}, byte-identical "
            f"({_names(keys)}): the index names {chosen} ({why})"
        )
    return new_map, lines


def _same_bytes(directory: str, key: str, where: list[str]) -> None:
    """Refuse a tensor whose copies differ (dtype, shape or bytes)."""
    first = _tensor_bytes(directory, where[0], key)
    for other in where[1:]:
        if _tensor_bytes(directory, other, key) != first:
            raise CorruptCheckpointError(
                f"{key}: stored in {where[0]} and {other} with different values: which is right "
                "cannot be told; move the wrong shard out of the directory and run repair again"
            )


def _tensor_bytes(directory: str, shard: str, key: str) -> tuple[str, tuple[int, ...], bytes]:
    with open_member(join(directory, shard)) as ckpt:
        record = next(r for r in ckpt.tensors() if r.key == key)
        data, offset = ckpt.read_bytes(record)
        start = offset * record.itemsize
        return record.dtype, tuple(record.shape), bytes(data[start : start + record.nbytes])


def _lost_lines(old_map: dict[str, str], lost: list[str], gone: list[str], index: str) -> list[str]:
    lines = []
    by_shard: dict[str, list[str]] = defaultdict(list)
    for key in lost:
        by_shard[old_map[key]].append(key)
    for shard, keys in sorted(by_shard.items()):
        if shard in gone:
            why = f"{shard}: listed in {index} but missing"
        else:
            why = f"{shard}: does not hold what {index} lists there, nor does any other shard"
        lines.append(
            f"{why}: {_count(keys)} lost ({_names(keys)}); the index keeps naming them, the only "
            "record of them: the directory stays incomplete (verify reports them; put the shard "
            "back, or take them from another copy of the model)"
        )
    lines += [f"{shard}: listed in {index} but missing" for shard in gone if shard not in by_shard]
    return lines


def _stale_lines(old_map: dict[str, str], new_map: dict[str, str], index: str) -> list[str]:
    moved = [key for key, shard in old_map.items() if key in new_map and new_map[key] != shard]
    unlisted = [key for key in new_map if key not in old_map]
    lines = []
    if moved:
        key = moved[0]
        lines.append(
            f"{index}: {_count(moved)} named in the wrong shard (e.g. {key}: it says "
            f"{old_map[key]}, stored in {new_map[key]})"
        )
    if unlisted:
        lines.append(f"{index}: {_count(unlisted)} stored but not listed ({_names(unlisted)})")
    return lines


def _changes(
    had_index: bool, old_map: dict[str, str], new_map: dict[str, str], lost: list[str], shards: int
) -> str:
    if not had_index:
        return f"written from the headers of {shards} shards: {_count(list(new_map))}"
    moved = sum(1 for key, shard in new_map.items() if key in old_map and old_map[key] != shard)
    added = sum(1 for key in new_map if key not in old_map)
    removed = sum(1 for key in old_map if key not in new_map)
    kept = f"; {len(lost)} lost, kept where the old index named them" if lost else ""
    return (
        f"weight_map rebuilt from the headers of {shards} shards: "
        f"{_count(list(new_map))}, {moved} moved to the shard that holds them, {added} added, "
        f"{removed} removed{kept}"
    )


def _count(keys: list[str]) -> str:
    return f"{len(keys)} tensor{'s' * (len(keys) != 1)}"


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
