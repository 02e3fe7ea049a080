"""``repair``'s library side, for single files: what a damaged checkpoint still holds, written
out as a checkpoint of the same format.

The file's format finds what survives (:meth:`~ckpttool.formats.base.FileFormat.recover`,
through :func:`ckpttool.formats.registry.recover_file`): the tree and the storages whose bytes
check out. A tensor whose bytes are lost is left out with the dict entry that held it (a state
dict key; in an optimizer's ``state``, the whole per-parameter entry, which the optimizer then
starts afresh) and listed; every other value, tensors and plain fields (epoch, step,
hyper-parameters), is kept. With ``fill_from``, a lost tensor is taken instead from another
checkpoint that holds one of the same key, dtype and shape (an optimizer entry whose every lost
tensor is so taken is kept whole); one it cannot take stays lost, with the reason. A file with
no damage is not written: there is nothing to repair. The output is written atomically beside
the source (never over it), then read back through :func:`ckpttool.checkpoint.open_checkpoint`
and every tensor in it compared byte for byte with the source's (a filled one with
``fill_from``'s): an output that differs is removed and :class:`~ckpttool.errors.ReadBackError`
raised.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ckpttool.commands.repair_directory import repair_directory
from ckpttool.commands.repair_report import FilledTensor, LostTensor, RepairReport
from ckpttool.commands.rewrite import write_checked
from ckpttool.errors import (
    CkptError,
    EmptyFileError,
    InputError,
    NotACheckpointError,
    OutputExistsError,
    ReadBackError,
    UnrecoverableError,
    name_file,
)
from ckpttool.formats.base import Checkpoint, Recovered
from ckpttool.formats.registry import recover_file
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    join_key,
    walk,
    with_fields,
)


def repair(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    fill_from: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    quarantine: bool = False,
    clean: bool = False,
) -> RepairReport:
    """Repair the checkpoint file or directory ``src``: a file through :func:`repair_file`
    (``dst``, ``fill_from``, ``overwrite``), a directory through
    :func:`ckpttool.commands.repair_directory.repair_directory` (``quarantine``, ``clean``)."""
    if Path(src).is_dir():
        if dst is not None or fill_from is not None:
            raise name_file(
                InputError("an output path and fill_from apply to files, not directories"),
                str(src),
            )
        return repair_directory(src, dry_run=dry_run, quarantine=quarantine, clean=clean)
    if quarantine or clean:
        raise name_file(
            InputError("quarantine and clean apply to run directories, not files"), str(src)
        )
    return repair_file(src, dst, dry_run=dry_run, overwrite=overwrite, fill_from=fill_from)


def default_output(src: Path) -> Path:
    """``NAME.repaired.EXT`` beside ``src`` (never ``src`` itself)."""
    return src.with_name(f"{src.stem}.repaired{src.suffix}")


def repair_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    dry_run: bool = False,
    overwrite: bool = False,
    fill_from: str | os.PathLike[str] | None = None,
) -> RepairReport:
    """Salvage what the checkpoint file ``src`` still holds into ``dst`` (default
    :func:`default_output`), of the same format; ``dry_run``: report only, write nothing.
    ``fill_from``: another checkpoint (any ckpttool opens) whose tensors of the same key, dtype
    and shape stand in for the lost ones. ``src`` is never changed; a file with no damage is
    not written (the report's ``output`` None). Raises a :class:`~ckpttool.errors.CkptError`
    naming ``src`` when nothing can be rebuilt (:class:`~ckpttool.errors.UnrecoverableError`)."""
    source = Path(src)
    output = Path(dst) if dst is not None else default_output(source)
    with ExitStack() as stack:
        fill = _open_fill(stack, fill_from)
        try:
            if not source.is_file():
                raise InputError("no such file" if not source.exists() else "not a file")
            if output.exists() and os.path.samefile(output, source):
                raise InputError(f"the output {output} is the source: repair never writes over it")
            handle = stack.enter_context(open(source, "rb"))
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise EmptyFileError("the file is empty: nothing to recover")
            found = recover_file(handle, size)
            if found is None:
                raise NotACheckpointError(
                    "not a file ckpttool can recover (it recovers torch.save files, zip and "
                    "legacy, safetensors files and pickles)"
                )
            pruned = _Pruned(found, fill)
            root = pruned.prune(found.root, "")
            if root is _DROP:
                raise UnrecoverableError(
                    "every value of the file is lost; resume from the previous checkpoint"
                )

            def read_range(storage_key: str, start: int, length: int) -> bytes:
                """``length`` bytes from ``start`` of a salvaged (or filled) storage."""
                if fill is not None and storage_key.startswith(_FILLED):
                    return fill.read(storage_key)[start : start + length]
                offset, size = found.intact[storage_key]
                data = os.pread(handle.fileno(), min(length, size - start), offset + start)
                if len(data) != length:
                    raise ReadBackError(f"storage {storage_key!r} changed while read")
                return data

            def read(storage_key: str) -> bytes:
                if fill is not None and storage_key.startswith(_FILLED):
                    return fill.read(storage_key)
                return read_range(storage_key, 0, found.intact[storage_key][1])

            kept = [(key, record) for key, record in walk(root) if isinstance(record, TensorRecord)]
            damaged = bool(found.damage or pruned.lost or pruned.dropped or pruned.filled)
            write = damaged and not dry_run
            if write and output.exists() and not overwrite:
                raise OutputExistsError(
                    f"{output} already exists (pass overwrite=True to replace it)"
                )
            if write:
                write_checked(found, root, output, read_range, read)
        except CkptError as error:
            raise name_file(error, str(source)) from None
    return RepairReport(
        source=str(source),
        kind="file",
        format=found.format,
        damage=(*found.damage, *pruned.notes),
        recovered=len(kept),
        lost=tuple(pruned.lost.values()),
        dropped=tuple(pruned.dropped),
        output=str(output) if damaged else None,
        written=write,
        filled=tuple(pruned.filled.values()),
        dry_run=dry_run,
    )


_DROP: Any = object()  # what pruning a node gives when its whole entry must go
_FILLED = "\0filled\0"  # storage keys of the tensors taken from fill_from (no file's own)


class _Fill:
    """The checkpoint lost tensors are taken from (``fill_from``), read by key."""

    def __init__(self, name: str, ckpt: Checkpoint) -> None:
        from ckpttool.commands.show import weights_section

        self.name = name
        self.ckpt = ckpt
        records = ckpt.tensors()
        self.records = {record.key: record for record in records}
        # a directory's weights also by the keys their files store them under (a model
        # directory's 'model.model.norm.weight' as 'model.norm.weight'), as a file of them has
        section = weights_section(ckpt)
        if section is not None:
            prefix = f"{section}."
            for record in records:
                if record.key.startswith(prefix):
                    self.records.setdefault(record.key.removeprefix(prefix), record)
        self.taken: dict[str, TensorRecord] = {}  # filled storage key -> the record read

    def take(self, record: TensorRecord, key: str) -> TensorRecord | str:
        """A record standing for ``record`` whose bytes are this checkpoint's tensor ``key``,
        or why there is none."""
        theirs = self.records.get(key)
        mine = f"{record.dtype}{list(record.shape)}"
        if theirs is None:
            return f"{self.name} has no tensor {key!r}"
        if theirs.dtype != record.dtype or tuple(theirs.shape) != tuple(record.shape):
            return f"{self.name} holds it as {theirs.dtype}{list(theirs.shape)}, not {mine}"
        if (
            theirs.storage is None
            or theirs.layout != "strided"
            or theirs.parts
            or theirs.quant is not None
            or theirs.dtensor is not None
            or theirs.dtype not in ITEMSIZE
            or theirs.dtype in ELEMENTS_PER_BYTE
            or not theirs.is_contiguous
            or record.layout != "strided"
            or record.parts
            or record.quant is not None
        ):
            return f"{self.name} holds it in a layout repair cannot copy"
        storage_key = _FILLED + key
        self.taken[storage_key] = theirs
        stride = []
        step = 1
        for size in reversed(record.shape):
            stride.append(step)
            step *= size
        storage = StorageRecord(
            storage_key, record.dtype, record.numel, "cpu", "fill_from", record.nbytes
        )
        return with_fields(
            record, stride=tuple(reversed(stride)), storage_offset=0, storage=storage
        )

    def read(self, storage_key: str) -> bytes:
        theirs = self.taken[storage_key]
        data, first = self.ckpt.read_bytes(theirs)
        start = first * theirs.itemsize
        out = bytes(data[start : start + theirs.nbytes])
        if len(out) != theirs.nbytes:
            raise ReadBackError(f"{self.name}: tensor {theirs.key!r} is shorter than its shape")
        return out


def _open_fill(stack: ExitStack, fill_from: str | os.PathLike[str] | None) -> _Fill | None:
    if fill_from is None:
        return None
    from ckpttool.checkpoint import open_checkpoint

    name = str(fill_from)
    return _Fill(name, stack.enter_context(open_checkpoint(name)))


class _Pruned:
    """The tree without the entries that hold lost tensors (or with them taken from
    ``fill_from``); what was lost and left out, and what was filled."""

    def __init__(self, found: Recovered, fill: _Fill | None = None) -> None:
        self.intact = found.intact
        self.fill = fill
        self.lost: dict[str, LostTensor] = {}
        self.dropped: dict[str, None] = {}
        self.filled: dict[str, FilledTensor] = {}
        self._fills: dict[str, TensorRecord | str] = {}
        self.notes: list[str] = []  # what the left-out entries mean for a resume

    def is_lost(self, record: TensorRecord) -> bool:
        parts = record.parts or (record,)
        for part in parts:
            storage = part.storage
            if storage is None or part.inline_data is not None:  # no bytes, or in the pickle
                continue
            span = self.intact.get(storage.key)
            if span is None or part.stored_extent_bytes > span[1]:
                return True
        return False

    def filler(self, record: TensorRecord, key: str) -> TensorRecord | str:
        """The record that stands for the lost ``record`` (taken from ``fill_from``), or why
        there is none (empty without ``fill_from``)."""
        if self.fill is None:
            return ""
        found = self._fills.get(key)
        if found is None:
            found = self._fills[key] = self.fill.take(record, key)
        return found

    def prune(self, node: Any, key: str) -> Any:
        if isinstance(node, TensorRecord):
            if self.is_lost(node):
                filler = self.filler(node, key)
                if isinstance(filler, TensorRecord):
                    assert self.fill is not None
                    self.filled[key] = FilledTensor(key, self.fill.name)
                    return filler
                self.lose(node, key, filler)
                return _DROP
            return node
        if isinstance(node, dict):
            optimizer = "param_groups" in node and isinstance(node.get("state"), dict)
            out = {}
            for name, value in node.items():
                child_key = join_key(key, str(name))
                if optimizer and name == "state":
                    out[name] = self.prune_entries(value, child_key)
                    self.note_optimizer(key, node, len(value) - len(out[name]))
                    continue
                child = self.prune(value, child_key)
                if child is _DROP:
                    self.drop(value, child_key)
                else:
                    out[name] = child
            return out
        if isinstance(node, (list, tuple)):
            items = [self.prune(value, join_key(key, str(i))) for i, value in enumerate(node)]
            if any(item is _DROP for item in items):
                self.drop(node, key)
                return _DROP
            return type(node)(items) if isinstance(node, list) else tuple(items)
        if isinstance(node, OpaqueObject):
            state = node.state
            # a lost tensor among its arguments or items (not its dict state) takes it whole
            if any(_holds(self, value) for value in (node.args, node.listitems)) or (
                not isinstance(state, dict) and _holds(self, state)
            ):
                for k, record in walk(node, key):
                    if isinstance(record, TensorRecord) and self.is_lost(record):
                        self.lose(record, k, "left out with the object that held it")
                self.drop(node, key)
                return _DROP
            new_state = self.prune(state, key) if isinstance(state, dict) else state
            items = self.prune(node.dictitems, key)
            rebuilt = node.rebuilt(node.args, new_state)
            rebuilt.dictitems = items
            rebuilt.listitems = node.listitems
            return rebuilt
        return node

    def prune_entries(self, state: dict[Any, Any], key: str) -> dict[Any, Any]:
        """An optimizer's per-parameter state: an entry with a lost tensor goes whole, unless
        every lost tensor of it is taken from ``fill_from``."""
        out = {}
        for name, entry in state.items():
            entry_key = join_key(key, str(name))
            lost = [
                (k, r)
                for k, r in walk(entry, entry_key)
                if isinstance(r, TensorRecord) and self.is_lost(r)
            ]
            if not lost:
                out[name] = entry
                continue
            fillers = [self.filler(r, k) for k, r in lost]
            if all(isinstance(filler, TensorRecord) for filler in fillers):
                out[name] = self.prune(entry, entry_key)
                continue
            unfilled = [k for (k, _), f in zip(lost, fillers) if not isinstance(f, TensorRecord)]
            for (k, record), filler in zip(lost, fillers):
                if isinstance(filler, TensorRecord):
                    filler = f"left out with its optimizer entry ({unfilled[0]} is lost)"
                self.lose(record, k, filler)
            self.drop(entry, entry_key)
        return out

    def note_optimizer(self, key: str, optimizer: dict[Any, Any], left_out: int) -> None:
        """Say how much of an optimizer's per-parameter state the output keeps when entries
        were left out: a resume from it restarts their moments from zero."""
        if not left_out:
            return
        groups = optimizer.get("param_groups")
        params = sum(
            len(group["params"])
            for group in (groups if isinstance(groups, (list, tuple)) else [])
            if isinstance(group, dict) and isinstance(group.get("params"), (list, tuple))
        )
        kept = len(optimizer["state"]) - left_out
        of = f" of the {params} parameters" if params else ""
        self.notes.append(
            f"{key or 'optimizer'}: the repaired file keeps the optimizer state of {kept}{of}; "
            f"{left_out} entr{'ies' if left_out != 1 else 'y'} lost or left out, so a resume "
            "starts those parameters' state afresh (momentum and moments at zero): take them "
            "from the previous checkpoint with --fill-from"
        )

    def lose(self, record: TensorRecord, key: str, reason: str = "") -> None:
        self.lost.setdefault(
            key, LostTensor(key, record.dtype, tuple(record.shape), record.nbytes, reason)
        )

    def drop(self, node: Any, key: str) -> None:
        """Note the intact tensors under ``node`` (left out with a lost one)."""
        for k, record in walk(node, key):
            if isinstance(record, TensorRecord) and k not in self.lost:
                self.dropped[k] = None


def _holds(pruned: _Pruned, node: Any) -> bool:
    return any(
        isinstance(record, TensorRecord) and pruned.is_lost(record) for _, record in walk(node)
    )
