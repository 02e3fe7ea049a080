"""A torch.distributed.checkpoint (DCP) directory written from an edited tree of another one
(``edit``): the same data files, each holding the items of the source's that the edit kept, in
the source's order; a new ``.metadata`` naming them where they now lie; any other file of the
directory copied as it is.

An item the edit keeps as it was (a value, or a tensor chunk whatever its new name) is copied
byte for byte: its small ``torch.save`` archive does not name its key. A chunk of a tensor the
edit casts is read (only that chunk), cast by the caller's function, and saved as the archive
DCP's ``FileSystemWriter`` writes for a chunk (``torch.save`` of the chunk's tensor). The new
``.metadata`` is the pickle of torch's own ``Metadata`` classes that ``FileSystemWriter.finish``
writes, built with torch: each key's path in the nested state dict (``planner_data``), its
properties and chunks (``state_dict_metadata``), and each item's place (``storage_data``).

The data files are shared out (:func:`ckpttool.io.units.shared_map`, weighed by their bytes):
over ``--jobs`` threads, or over torchrun's ranks, each writing its files into the directory
rank 0 staged and returning where each item lies; rank 0 alone writes ``.metadata`` (from its
own items, so that the pickle is byte for byte the one process's) and copies the other files.
"""

from __future__ import annotations

import functools
import io
import pickle
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError
from ckpttool.formats.dcp.directory import load_metadata, tensor_record
from ckpttool.formats.dcp.files import DcpFiles
from ckpttool.formats.dcp.metadata import BytesEntry, StorageSpan, TensorEntry, span_of
from ckpttool.formats.dcp.names import DCP_METADATA
from ckpttool.io import units
from ckpttool.io.source import member_sizes
from ckpttool.model.records import ChunkedStorageRecord, ChunkRecord, TensorRecord

#: A cast the caller asks for: the dtype a tensor is written in, and a function from the
#: elements of one of its chunks (a NumPy array in the source dtype's stored type) to that
#: chunk's bytes in the new dtype.
Cast = tuple[str, Callable[[Any], bytes]]

_COPY_BLOCK = 16 << 20  # bytes copied at a time from a source data file


@dataclass(frozen=True)
class _Item:
    """One item of the output: where it comes from and what it becomes."""

    fqn: str  # its key in the output's metadata
    span: StorageSpan  # its bytes in the source
    chunk: ChunkRecord | None = None  # a tensor chunk (None: a value)
    storage: ChunkedStorageRecord | None = None  # the source tensor the chunk is part of
    cast: Cast | None = None  # None: copied byte for byte


def rewrite_dcp(source: Path, root: Any, target: Path, casts: Mapping[str, Cast]) -> None:
    """Write ``root`` (the tree of the DCP directory ``source`` with entries dropped, tensors
    renamed, or tensors given another one's values) as a DCP directory into ``target`` (an
    empty directory). ``casts``: output key -> :data:`Cast` for the tensors to cast."""
    import torch
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with open(source / DCP_METADATA, "rb") as handle:
        _, meta = load_metadata(handle, refuse_dangerous=True)
    paths = {entry.fqn: tuple(meta.paths.get(entry.fqn, (entry.fqn,))) for entry in meta.entries}
    tensor_entries = {e.fqn: e for e in meta.entries if isinstance(e, TensorEntry)}
    placed: dict[str, list[tuple[Any, ...]]] = {}  # source tensor -> its output paths
    for path, record in _tensor_leaves(root, ()):
        storage = record.storage
        if not isinstance(storage, ChunkedStorageRecord) or storage.key not in tensor_entries:
            raise InputError(f"{'.'.join(map(str, path))}: not a tensor of this checkpoint")
        placed.setdefault(storage.key, []).append(path)

    items: list[_Item] = []
    state_dict_metadata: dict[str, Any] = {}
    planner_data: dict[str, tuple[Any, ...]] = {}
    for entry in meta.entries:
        if isinstance(entry, BytesEntry):
            node = _at(root, paths[entry.fqn])
            if node is _ABSENT or isinstance(node, TensorRecord):
                continue  # dropped (a renamed tensor may hold its name now)
            if entry.span is None:
                raise InputError(f"{entry.fqn}: the metadata says where no bytes of it lie")
            state_dict_metadata[entry.fqn] = dcp_metadata.BytesStorageMetadata()
            planner_data[entry.fqn] = paths[entry.fqn]
            items.append(_Item(entry.fqn, entry.span))
            continue
        storage = tensor_record(entry).storage
        assert isinstance(storage, ChunkedStorageRecord)
        for path in placed.get(entry.fqn, ()):
            fqn = ".".join(map(str, path))
            cast = casts.get(fqn)
            dtype = cast[0] if cast is not None else entry.dtype
            state_dict_metadata[fqn] = dcp_metadata.TensorStorageMetadata(
                properties=dcp_metadata.TensorProperties(
                    dtype=getattr(torch, dtype), requires_grad=entry.requires_grad
                ),
                size=torch.Size(entry.shape),
                chunks=[
                    dcp_metadata.ChunkStorageMetadata(
                        offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)
                    )
                    for chunk in entry.chunks
                ],
            )
            planner_data[fqn] = path
            for chunk in entry.chunks:
                items.append(_Item(fqn, span_of(chunk), chunk, storage, cast))

    by_file: dict[str, list[_Item]] = {}
    for item in items:
        by_file.setdefault(item.span.file, []).append(item)
    # each data file written by one worker (--jobs threads, or a torchrun rank: into the
    # directory rank 0 staged), weighed by its bytes; the rest is rank 0's
    names = sorted(by_file)
    sizes = member_sizes(str(source), names)
    weights = [max(1, sum(item.span.length for item in by_file[name])) for name in names]
    write = functools.partial(_write_file, source, target, by_file, sizes)
    spans: list[list[tuple[int, int]]] = units.shared_map(write, names, weights)
    units.lead_only()
    storage_data: dict[Any, Any] = {}
    for name, found in zip(names, spans):
        # the keys from this process's own items: the pickle's references to the strings the
        # metadata shares are then those one process writes (the same bytes under torchrun)
        for item, (offset, length) in zip(_in_file_order(by_file[name]), found, strict=True):
            index = (
                dcp_metadata.MetadataIndex(item.fqn)
                if item.chunk is None
                else dcp_metadata.MetadataIndex(item.fqn, item.chunk.offsets, _chunk_index(item))
            )
            storage_data[index] = _StorageInfo(name, offset, length)
    _copy_others(source, target, {DCP_METADATA, *meta.files})
    written = dcp_metadata.Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data,
        version=meta.version,
    )
    with open(target / DCP_METADATA, "wb") as out:
        pickle.dump(written, out)


def _in_file_order(items: list[_Item]) -> list[_Item]:
    return sorted(items, key=lambda item: item.span.offset)


def _write_file(
    source: Path, target: Path, by_file: dict[str, list[_Item]], sizes: dict[str, int], name: str
) -> list[tuple[int, int]]:
    """The data file ``name`` of the output written into ``target``, its items in the order
    they lie in the source's file of that name (each worker reads its own file): where each
    was written (offset, length), in that order."""
    files = DcpFiles(source, {name: sizes[name]})
    placed: list[tuple[int, int]] = []
    try:
        with open(target / name, "wb") as out:
            for item in _in_file_order(by_file[name]):
                offset = out.tell()
                _write_item(files, item, out)
                placed.append((offset, out.tell() - offset))
    finally:
        files.close()
    return placed


def _copy_others(source: Path, target: Path, owned: set[str]) -> None:
    """Every file of ``source`` that is not the checkpoint's (a config, a README beside it),
    copied byte for byte: the edited directory replaces the source's whole."""
    for path in sorted(source.rglob("*")):
        name = path.relative_to(source).as_posix()
        if name in owned or not path.is_file():
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / name)


def _chunk_index(item: _Item) -> int:
    """The chunk's position among its tensor's chunks (``MetadataIndex.index``: a hint)."""
    assert item.storage is not None and item.chunk is not None
    return item.storage.chunks.index(item.chunk)


def _write_item(files: DcpFiles, item: _Item, out: Any) -> None:
    if item.cast is None:
        _copy(files, item.span, out)
        return
    import numpy as np
    import torch

    from ckpttool.io.values import torch_dtype
    from ckpttool.model.cast import stored_dtype

    assert item.chunk is not None and item.storage is not None
    dtype, cast = item.cast
    raw = files.chunk_values(item.chunk, item.storage)
    values = np.ascontiguousarray(raw).view(stored_dtype(item.storage.dtype))
    data = cast(values.reshape(item.chunk.sizes))
    if item.chunk.numel:
        tensor = torch.frombuffer(bytearray(data), dtype=torch_dtype(dtype))
    else:
        tensor = torch.empty(0, dtype=torch_dtype(dtype))
    buffer = io.BytesIO()
    torch.save(tensor.reshape(item.chunk.sizes), buffer)
    out.write(buffer.getbuffer())


def _copy(files: DcpFiles, span: StorageSpan, out: Any) -> None:
    done = 0
    while done < span.length:
        step = min(_COPY_BLOCK, span.length - done)
        out.write(files.pread(span.file, span.offset + done, step))
        done += step


_ABSENT = object()


def _at(root: Any, path: tuple[Any, ...]) -> Any:
    """The node at ``path`` in ``root`` (dict keys, list indices), or ``_ABSENT``."""
    node = root
    for step in path:
        in_dict = isinstance(node, dict) and step in node
        in_list = isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)
        if not (in_dict or in_list):
            return _ABSENT
        node = node[step]
    return node


def _tensor_leaves(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The tensors of the nested state dict with their paths (dict keys, list indices), as
    DCP's ``flatten_state_dict`` walks it: into dicts and lists, not into values."""
    if isinstance(node, TensorRecord):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _tensor_leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _tensor_leaves(value, (*path, index))


__all__ = ["Cast", "rewrite_dcp"]
