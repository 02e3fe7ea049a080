"""``average``/``merge --like-input``: the output in the first input's own layout, its weights
replaced by the combined ones and everything else (a resume file's optimizer, step, config) the
first input's.

A file the formats can rewrite (a torch zip or legacy ``.pth``, a safetensors file) is written
as ``edit`` writes it (:func:`ckpttool.commands.rewrite.write_checked`): the same tree, each
combined tensor a new contiguous storage computed when the writer asks for it, the other
storages copied from the first input, read back before it replaces anything (the combined
tensors are computed a second time for the read-back). A Hugging Face model directory gives a
model directory, as ``convert`` writes one (``model.safetensors``, or shards of at most the
input's largest shard and their index; ``config.json`` and ``generation_config.json`` copied). Other layouts (a DCP or DeepSpeed directory) are refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.convert import model_dir
from ckpttool.commands.convert.output import INDEX_SUFFIX, OutFile, plan_outputs
from ckpttool.commands.convert.plan import Plan, Planned
from ckpttool.commands.convert.run import write_outputs
from ckpttool.commands.mapped import contiguous
from ckpttool.commands.rewrite import write_checked
from ckpttool.errors import InputError, OutputExistsError
from ckpttool.formats.registry import recover_file
from ckpttool.io.progress import ProgressCallback
from ckpttool.model import edits
from ckpttool.model.records import StorageRecord, TensorRecord, walk, with_fields

Data = bytes | bytearray | memoryview
#: Makes each tensor's producer: (the tensors in the order they will be asked for, output name
#: -> the name they were matched under).
Producers = Callable[[list[Planned], dict[str, str]], dict[str, Callable[[], Data]]]
_PREFIX = "\0combined\0"


def write_like(
    ckpt: Checkpoint,
    path: Path,
    plan: Plan,
    target: Path,
    producers: Producers,
    *,
    provenance: tuple[str, dict[str, object]],
    force: bool,
    verify: bool,
    progress: ProgressCallback | None,
    on_total: ProgressCallback | None,
    notes: list[str],
) -> str:
    """Write ``target`` in the layout of ``ckpt`` (the first input, at ``path``) with ``plan``'s
    tensors produced by ``producers``; what was written: "safetensors", "pth" (a torch zip or
    legacy file, a pickle) or "directory" (a model directory)."""
    advance = progress or (lambda n: None)
    output = model_dir.model_directory(ckpt)
    if output is not None:
        return _model_directory(ckpt, path, plan, target, output, producers, provenance,
                                force, verify, advance, on_total, notes)  # fmt: skip
    if ckpt.format == "directory" or path.is_dir():
        raise InputError(
            f"--like-input: {path} is a {ckpt.details.get('layout') or ckpt.format} directory, "
            "which is not written in its own layout; write a .safetensors or .pth OUT instead"
        )
    if not path.is_file():
        raise InputError(
            f"--like-input: {path} is not a local file (it is rewritten from its own bytes); "
            "write a .safetensors or .pth OUT instead"
        )
    if target.is_dir():
        raise InputError(
            f"{target}: is a directory; --like-input of a file writes a file: name a file as OUT"
        )
    if (target.exists() or target.is_symlink()) and not force:
        raise OutputExistsError(f"{target} exists; pass --force to overwrite it")
    with open(path, "rb") as handle:
        found = recover_file(handle, os.fstat(handle.fileno()).st_size)
        if found is None or found.damage:
            raise InputError(
                f"--like-input: {path} ({ckpt.format}) cannot be rewritten in its own format; "
                "write a .safetensors or .pth OUT instead"
            )
        by_key = {p.record.key: p for p in plan.stored}
        made: dict[tuple[Any, ...], StorageRecord] = {}
        order: list[Planned] = []
        for key, record in walk(found.root):
            planned = by_key.get(key)
            if isinstance(record, TensorRecord) and planned is not None:
                view = _view(record)
                if view is not None and view not in made:
                    storage_key = f"{_PREFIX}{len(made)}"
                    made[view] = StorageRecord(storage_key, planned.dtype, record.numel, "cpu",
                                               storage_key, planned.nbytes)  # fmt: skip
                    order.append(planned)
        if len(order) != len(plan.stored):
            left = sorted(set(by_key) - {p.record.key for p in order})
            raise InputError(
                f"--like-input: {path}'s tensors {', '.join(left[:3])} are not where its "
                "format's tree has them; write a .safetensors or .pth OUT instead"
            )
        produce = producers(order, {})
        derived: dict[str, Callable[[], bytes]] = {}
        for planned, storage in zip(order, made.values()):
            derived[storage.key] = _counted(
                produce[planned.name], planned.nbytes, advance, 1 + verify
            )

        def combined(record: TensorRecord, key: str) -> TensorRecord:
            storage = made.get(_view(record) or ())
            if storage is None:
                return record
            return with_fields(record, dtype=storage.dtype, storage=storage, storage_offset=0,
                               stride=contiguous(tuple(record.shape)))  # fmt: skip

        root = edits.map_tensors(found.root, combined)
        if found.format == "safetensors":
            key, facts = provenance
            found.metadata[key] = json.dumps(facts, sort_keys=True)
        else:
            notes.append(f"a {found.format} file keeps no metadata: the provenance is not written")
        if on_total is not None:
            on_total(plan.tensor_bytes * (2 if verify else 1))
        sources = _Sources(handle.fileno(), found.intact, derived)
        write_checked(found, root, target, sources.read_range, sources.read)
    return "safetensors" if found.format == "safetensors" else "pth"


def _view(record: TensorRecord) -> tuple[Any, ...] | None:
    storage = record.storage
    if storage is None or record.inline_data is not None:
        return None
    return (storage.key, record.storage_offset, record.shape, record.stride, record.dtype)


def _counted(
    produce: Callable[[], Data], nbytes: int, advance: ProgressCallback, times: int
) -> Callable[[], bytes]:
    """``produce`` as bytes, its first ``times`` calls counted (written, read back: a tensor
    tied to another may be made once more for the read-back of the other name)."""
    calls = 0

    def run() -> bytes:
        nonlocal calls
        data = bytes(produce())
        calls += 1
        if calls <= times:
            advance(nbytes)
        return data

    return run


class _Sources:
    """Where each storage of the written tree comes from: the first input's file (``intact``:
    key -> offset, length) or the combination (``derived``: key -> producer; the last one made
    is kept, for the read-back's windows)."""

    def __init__(
        self, fd: int, intact: dict[str, tuple[int, int]], derived: dict[str, Callable[[], bytes]]
    ) -> None:
        self.fd, self.intact, self.derived = fd, intact, derived
        self._last: tuple[str, bytes] | None = None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if key in self.derived:
            return self.read(key)[start : start + length]
        offset, stored = self.intact[key]
        return os.pread(self.fd, min(length, stored - start), offset + start)

    def read(self, key: str) -> bytes:
        producer = self.derived.get(key)
        if producer is None:
            return self.read_range(key, 0, self.intact[key][1])
        if self._last is None or self._last[0] != key:
            self._last = None  # the previous one freed before the next is made
            self._last = (key, producer())
        return self._last[1]


def _model_directory(
    ckpt: Checkpoint,
    path: Path,
    plan: Plan,
    target: Path,
    output: Any,
    producers: Producers,
    provenance: tuple[str, dict[str, object]],
    force: bool,
    verify: bool,
    advance: ProgressCallback,
    on_total: ProgressCallback | None,
    notes: list[str],
) -> str:
    """A model directory, as ``convert SRC DIR/`` writes one, holding the combined weights."""
    matched = {id(p.record): p.name for p in plan.stored}
    plan = model_dir.for_transformers(plan, output)
    plan.fields, plan.carried, plan.left_out = {}, {}, []
    renamed = {p.name: matched[id(p.record)] for p in plan.stored}
    model_dir.check_target(output, target, force)
    shard_size = _shard_size(output)
    with model_dir.staged_directory(target) as staging:
        weights = staging / output.weights_name if shard_size is None else staging
        files: list[OutFile] = plan_outputs(path, weights, None, shard_size, plan)
        key, facts = provenance
        files[0].metadata[key] = json.dumps(facts, sort_keys=True)
        if on_total is not None:
            on_total(plan.tensor_bytes * (2 if verify else 1))
        order = [p for f in files if f.kind != "index" for p in f.tensors if not p.kept]
        write_outputs(ckpt, plan, files, allow_overflow=False, verify=verify, progress=advance,
                      replaced=producers(order, renamed))  # fmt: skip
        model_dir.copy_files(output, staging)
    return "directory"


def _shard_size(output: Any) -> int | None:
    """A sharded model directory's largest weights file (the shards written are at most that),
    or None: one weights file (unsharded, or a directory that is not local)."""
    directory = output.directory
    if (
        not isinstance(directory, Path)
        or not (directory / (Path(output.weights_name).stem + INDEX_SUFFIX)).is_file()
    ):
        return None
    shards = [p.stat().st_size for p in directory.glob("*.safetensors") if p.is_file()]
    return max(shards) if shards else None
