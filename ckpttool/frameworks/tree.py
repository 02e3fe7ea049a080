"""Several files, one checkpoint: a framework's directory read as one tree.

:func:`ckpttool.frameworks.registry.detect_directory` says which files a directory holds and where
each goes (``model``, ``optimizer``, ``rng.rank1``...). Each member is opened through the same
safe, lazy reader as a single file (the format registry), JSON members are parsed as bounded JSON,
and their trees are placed into one dict; the shards of a sharded model are merged into one
flat ``model`` dict in the order the files list them, a tensor found in two shards being a
problem; then the framework's :meth:`~ckpttool.frameworks.base.Framework.check_tree` reads
what it knows out of the merged tree. Every storage is re-labelled with the member it lives in
(:class:`MemberStorageRecord`), so storages of different files never compare equal (``.bin``
shards all number theirs from "0") and reading a tensor's bytes goes to the right file.

Nothing is read but what a single-file open reads: the members' headers and pickles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from ckpttool.errors import (
    CkptError,
    CorruptCheckpointError,
    InputError,
    NotACheckpointError,
    name_file,
)
from ckpttool.formats.base import Parsed, no_span
from ckpttool.frameworks.base import (
    Framework,
    FrameworkDirectory,
    Member,
    OpenedMembers,
    inside,
    open_format_directory,
    open_member,
)
from ckpttool.model.records import OpaqueObject, StorageRecord, TensorRecord

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint

DIRECTORY = "directory"


@dataclass(frozen=True)
class MemberStorageRecord(StorageRecord):
    """A storage of one member file of a directory checkpoint."""

    member: str = ""  # the member file, relative to the checkpoint directory


def read_directory(
    layout: FrameworkDirectory, framework: Framework, *, strict: bool, refuse_dangerous: bool
) -> Parsed:
    """Open every member of ``layout`` (which ``framework`` detected) and merge their trees
    (see the module docstring)."""
    opened = OpenedMembers()
    owners: dict[MemberStorageRecord, tuple[Checkpoint, StorageRecord]] = {}
    root: dict[str, Any] = {}
    shard_of: dict[str, str] = {}  # tensor key -> the shard file it was found in
    problems = list(layout.problems)
    with opened.closed_on_error(layout.directory):
        for member in layout.members:
            if member.section is None:
                continue
            path = inside(layout.directory, member.name)
            if member.json:
                value = layout.read_json(member.name)
            else:
                try:
                    ckpt = (
                        open_format_directory(
                            os.path.dirname(path), strict=strict, refuse_dangerous=refuse_dangerous
                        )
                        if member.indexes_directory
                        else open_member(path, strict=strict, refuse_dangerous=refuse_dangerous)
                        if layout.opener is None
                        else layout.opener(member.name, strict, refuse_dangerous)
                    )
                except (CorruptCheckpointError, InputError, NotACheckpointError) as error:
                    if strict:
                        raise
                    # verify: a member that cannot be read is one problem; the others are
                    # still read and the layout's rules still checked
                    problems.append(f"{member.name}: {str(error).removeprefix(f'{path}: ')}")
                    continue
                opened.append(ckpt)
                problems += [f"{member.name}: {problem}" for problem in ckpt.problems]
                value = _relabel(ckpt.root, member.name, ckpt, owners)
            if member.shard:
                problems += _merge_shard(root, member, value, shard_of)
            else:
                _place(root, member.section, value)
        details = layout_details(layout)
        problems += framework.check_tree(layout, root, details, shard_of)
        if problems and strict:
            raise CorruptCheckpointError(problems[0])

    def read(storage: StorageRecord, start: int, stop: int) -> bytearray:
        ckpt, original = owners[storage]  # type: ignore[index]
        try:
            return ckpt.read_storage(original, start, stop)
        except CkptError as error:
            raise name_file(error, ckpt.name) from None

    details.update(_recorded_counters(root))
    return Parsed(
        format=DIRECTORY,
        root=root,
        span=no_span,
        details=details,
        problems=problems,
        read=read,
        close=opened.close,
        unchanged=opened.check_unchanged,  # members in an object store, before a commit
        # members that are files (pread, ranged requests), or directories that allow it
        concurrent_reads=all(c._parsed.read is None or c.concurrent_reads for c in opened),
    )


def layout_details(layout: FrameworkDirectory) -> dict[str, Any]:
    """What ``show`` prints about the directory: layout, files with roles and sizes, gaps."""
    return {
        "layout": layout.kind,
        "layout_title": layout.title,
        "directory": layout.directory,
        "members": [
            {"name": m.name, "role": m.role, "size": m.size, "section": m.section, "rank": m.rank}
            for m in layout.members
        ],
        "missing": list(layout.missing),
        "complete": layout.complete,
        **({"index": layout.index} if layout.index else {}),
        **layout.details,
    }


def _recorded_counters(root: dict[str, Any]) -> dict[str, Any]:
    """Counters kept inside the members, for the header: accelerate's ``step`` (in each
    ``random_states_{rank}.pkl``) and the scheduler's ``last_epoch``."""
    counters: dict[str, Any] = {}
    rng = root.get("rng")
    first_rank = rng.get("rank0") if isinstance(rng, dict) else None
    if isinstance(first_rank, dict) and isinstance(first_rank.get("step"), int):
        counters["step"] = first_rank["step"]
    scheduler = root.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("last_epoch"), int):
        counters["scheduler_last_epoch"] = scheduler["last_epoch"]
    return counters


def directory_size(layout: FrameworkDirectory) -> int:
    return sum(member.size for member in layout.members)


def _merge_shard(
    root: dict[str, Any], member: Member, value: Any, shard_of: dict[str, str]
) -> list[str]:
    assert member.section is not None
    if not isinstance(value, dict) or not all(isinstance(v, TensorRecord) for v in value.values()):
        return [f"{member.name}: a weight shard that is not a flat dict of tensors"]
    merged = root.setdefault(member.section, {})
    problems = []
    for key, record in value.items():
        if key in merged:
            problems.append(f"{key}: stored in two shards ({shard_of[key]} and {member.name})")
            continue
        merged[key] = record
        shard_of[key] = member.name
    return problems


def _place(root: dict[str, Any], section: str, value: Any) -> None:
    if section == "" and isinstance(value, dict):  # the member's entries at the top level
        root.update(value)
        return
    *parents, last = section.split(".")
    node = root
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _relabel(
    tree: Any,
    member: str,
    ckpt: Checkpoint,
    owners: dict[MemberStorageRecord, tuple[Checkpoint, StorageRecord]],
) -> Any:
    """``tree`` with each tensor's storage labelled with ``member`` (shared storages stay shared:
    one new label per original storage)."""
    labels: dict[StorageRecord, MemberStorageRecord] = {}
    copies: dict[int, Any] = {}

    def label(storage: StorageRecord) -> MemberStorageRecord:
        found = labels.get(storage)
        if found is None:
            values = {f.name: getattr(storage, f.name) for f in fields(StorageRecord)}
            found = labels[storage] = MemberStorageRecord(**values, member=member)
            owners[found] = (ckpt, storage)
        return found

    def copy(node: Any) -> Any:
        if isinstance(node, TensorRecord):
            return node if node.storage is None else replace(node, storage=label(node.storage))
        if not isinstance(node, (dict, list, tuple, OpaqueObject)):
            return node
        done = copies.get(id(node))
        if done is not None:
            return done
        if isinstance(node, dict):
            out: Any = type(node)() if type(node) is not dict else {}
            copies[id(node)] = out
            for key, value in node.items():
                out[key] = copy(value)
            return out
        if isinstance(node, list):
            items: list[Any] = []
            copies[id(node)] = items
            items.extend(copy(value) for value in node)
            return items
        if isinstance(node, tuple):
            result = tuple(copy(value) for value in node)
            copies[id(node)] = result
            return result
        opaque = node.empty_copy()
        opaque.args, opaque.state = copy(node.args), copy(node.state)
        copies[id(node)] = opaque
        opaque.dictitems = copy(node.dictitems)
        opaque.listitems = copy(node.listitems)
        return opaque

    return copy(tree)
