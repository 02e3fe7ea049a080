"""A rank set opened as one checkpoint: rank 0's tree, each DTensor replaced by its global
tensor (:mod:`ckpttool.frameworks.rank_set.assemble`), each plain tensor by rank 0's copy."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ckpttool.errors import CkptError, CorruptCheckpointError
from ckpttool.formats.base import Parsed, no_span
from ckpttool.formats.registry import as_checkpoint
from ckpttool.frameworks.base import FrameworkDirectory, OpenedMembers, open_member
from ckpttool.frameworks.rank_set.assemble import (
    Assembler,
    Piece,
    RankStorageRecord,
    boxes,
    global_record,
    placed,
    tiling_problems,
)
from ckpttool.frameworks.rank_set.files import HF_FOLDER, RankFiles
from ckpttool.frameworks.tree import DIRECTORY, layout_details
from ckpttool.io.source import join
from ckpttool.model.records import TensorRecord, with_key

#: Where the set's summary goes in ``details`` (``show``'s lines read it).
SUMMARY = "rank_set"


def open_rank_set(layout: FrameworkDirectory, *, strict: bool, refuse_dangerous: bool) -> Any:
    """The set ``layout`` describes as one Checkpoint. ``strict=False`` (``verify``): problems
    are recorded instead of raised, and replicated copies are compared byte for byte."""
    found = layout.found
    assert isinstance(found, RankFiles)
    problems = list(layout.problems)
    if layout.missing and strict:  # verify reports it as incompleteness
        raise CorruptCheckpointError(
            f"{layout.directory}: {layout.missing[0]} is missing: the set has "
            f"{len(found.files)} of {len(found.files) + len(layout.missing)} rank files, and "
            "the global tensors need every rank's pieces"
        )
    if problems and strict:
        raise CorruptCheckpointError(f"{layout.directory}: {problems[0]}")
    ranks = sorted(found.files)
    names = [found.files[rank] for rank in ranks]
    opened = OpenedMembers()
    with opened.closed_on_error(layout.directory):
        for name in names:
            opened.append(
                open_member(join(layout.directory, name), strict=strict,
                            refuse_dangerous=refuse_dangerous)
            )  # fmt: skip
        assembler = Assembler(opened)
        root, summary, found_problems = _assemble(
            opened, names, assembler, strict, tile=not layout.missing
        )
        problems += found_problems
        if problems and strict:
            raise CorruptCheckpointError(problems[0])

    details = layout_details(layout)
    details[SUMMARY] = summary
    if found.hf_config:
        details["hf_config"] = f"{HF_FOLDER}/config.json"
    parsed = Parsed(format=DIRECTORY, root=root, span=no_span, details=details,
                    problems=problems, read=assembler.read, close=opened.close,
                    unchanged=opened.check_unchanged)  # fmt: skip
    return as_checkpoint(layout.directory, parsed, None, sum(c.file_size for c in opened))


def _assemble(
    opened: list[Any], names: list[str], assembler: Assembler, strict: bool, *, tile: bool
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the global state dict, the summary for ``show``, the problems; ``tile``: whether to
    check that the pieces tile each tensor, pointless when a rank file is missing)."""
    trees = [ckpt.root for ckpt in opened]
    for name, tree in zip(names, trees):
        if not isinstance(tree, dict):
            raise CorruptCheckpointError(f"{name}: not a state dict (a {type(tree).__name__})")
    first = trees[0]
    problems: list[str] = []
    for name, tree in zip(names[1:], trees[1:]):
        if list(tree) != list(first):
            extra = sorted(set(tree) ^ set(first), key=str)
            problems.append(
                f"{name}: its keys differ from {names[0]}'s"
                + (f" ({extra[0]!r})" if extra else " (order)")
            )
    if problems:
        return {}, {}, problems
    root: dict[str, Any] = {}
    splits: Counter[str] = Counter()
    meshes: set[str] = set()
    done: dict[int, TensorRecord] = {}  # tied parameters: one global record per rank-0 record
    tied: dict[tuple[Any, ...], TensorRecord] = {}  # the same, by the pieces' views
    for key, value in first.items():
        if not isinstance(value, TensorRecord):
            root[key] = value
            continue
        if id(value) in done:
            root[key] = with_key(done[id(value)], str(key))  # tied: one storage
            continue
        records = [tree[key] for tree in trees]
        view = _tied_view(value, records)
        if view is not None and view in tied:
            root[key] = with_key(tied[view], str(key))
            continue
        if not all(isinstance(r, TensorRecord) for r in records):
            problems.append(f"{key}: a tensor in {names[0]}, not in every rank file")
            continue
        pieces: list[Piece] = []
        copies: list[tuple[Piece, Piece]] = []
        if value.dtensor is None:
            if any(r.dtensor is not None for r in records):
                problems.append(f"{key}: a DTensor in some rank files, a plain tensor in others")
                continue
            whole = tuple(0 for _ in value.shape)
            pieces = [Piece(0, value, whole, value.shape)]
            copies = [(Piece(m, r, whole, r.shape), pieces[0]) for m, r in enumerate(records) if m]
            how = "plain tensor, the same on every rank"
        else:
            read: list[Piece] = []
            others: list[Piece] = []
            for member, record in enumerate(records):
                if record.dtensor is None or record.shape != value.shape:
                    problems.append(
                        f"{key}: {names[member]} holds it as "
                        + (
                            "a plain tensor"
                            if record.dtensor is None
                            else f"global {list(record.shape)}"
                        )
                    )
                    continue
                runs, is_read = placed(str(key), value.shape, record.dtensor)
                (read if is_read else others).extend(boxes(member, record.dtensor.local, runs))
            for copy in others:
                match = [
                    p for p in read
                    if (p.offsets, p.sizes, p.local_offsets)
                    == (copy.offsets, copy.sizes, copy.local_offsets)
                ]  # fmt: skip
                if match:
                    copies.append((copy, match[0]))
            pieces = read
            how = value.dtensor.split()
            meshes.add(str(list(value.dtensor.mesh_shape)))
            if tile:
                problems += tiling_problems(str(key), value.shape, pieces, names)
        splits[how] += 1
        record = global_record(str(key), value, pieces, copies, names, how)
        if not strict:
            storage = record.storage
            assert isinstance(storage, RankStorageRecord)
            try:
                problems += assembler.replica_problems(str(key), storage, names)
            except CkptError as error:
                problems.append(f"{key}: {error}")
        done[id(value)] = record
        if view is not None:
            tied[view] = record
        root[key] = record
    summary = {
        "ranks": len(trees),
        "files": names,
        "splits": dict(splits),
    }
    return root, summary, problems


def _tied_view(value: TensorRecord, records: list[Any]) -> tuple[Any, ...] | None:
    """The identity of a DTensor by what it views on every rank: two DTensors of a state dict
    are one tied parameter when each rank's local pieces view the same bytes the same way,
    with the same global shape and placements (FSDP2 pickles a tied ``lm_head.weight`` and
    ``embed_tokens.weight`` as two DTensor objects over one local storage, as transformers'
    ``tie_word_embeddings`` does); None: not a DTensor on every rank, or a piece without bytes."""
    if value.dtensor is None:
        return None
    views: list[Any] = [value.shape, value.dtype, value.dtensor.placements]
    for record in records:
        info = record.dtensor if isinstance(record, TensorRecord) else None
        local = info.local if info is not None else None
        if local is None or local.storage is None or local.inline_data is not None:
            return None
        views.append(
            (local.storage.key, local.storage_offset, local.shape, local.stride, local.dtype)
        )
    return tuple(views)
