"""The one door to checkpoints: :func:`open_checkpoint`, for a file, a directory or a URL.

Every command reads through here. Opening a file recognises its format, walks its pickle with
:mod:`ckpttool.pickle.interpreter` (nothing in it runs), and returns a :class:`Checkpoint`: the
object tree with tensors as :class:`~ckpttool.model.records.TensorRecord` s. No tensor bytes are read;
:meth:`Checkpoint.read_bytes` reads exactly the bytes a value needs when a command asks, with
``pread`` on the open file (never the whole file). torch is not imported.

A torch.distributed.checkpoint directory (``.metadata`` plus one data file per rank) opens the
same way, as one checkpoint: its format (:mod:`ckpttool.formats.dcp`, found through
:mod:`ckpttool.formats.registry`) gives each tensor its global shape and assembles its bytes
from the chunks on read.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ckpttool.errors import (
    CheckpointCollectionError,
    InputError,
    NotADirectoryCheckpointError,
)
from ckpttool.formats.base import DCP_METADATA, Checkpoint, is_dcp_directory
from ckpttool.formats.registry import (
    format_by_id,
    has_dcp_shards,
    open_directory_format,
    open_file,
    open_local,
    open_source,
)
from ckpttool.io.source import is_url, join, local_path
from ckpttool.model.records import (
    tensors,
)

if TYPE_CHECKING:
    pass


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    refuse_dangerous: bool = True,
    track_spans: bool = False,
    allow_ambiguous: bool = False,
) -> Checkpoint:
    """Open ``path`` safely and lazily. Raises a :class:`~ckpttool.errors.CkptError` subclass
    whose message names the file (whatever part of it the error concerns).

    ``strict=False`` records structural problems in ``Checkpoint.problems`` where it can go on
    (``verify`` uses this); ``refuse_dangerous=False`` records dangerous globals instead of
    refusing the file (``scan``). A file that reads two ways (docs/safety.md, "Parser
    differentials") raises :class:`~ckpttool.errors.AmbiguousFileError`; with
    ``allow_ambiguous`` (``scan``) it is read as ``torch.load`` reads it (a file not named
    ``*.safetensors``) and ``details["ambiguous"]`` says what else it is.
    """
    name = os.fspath(path)
    if is_url(name):
        from ckpttool.io.remote import is_directory

        if name.endswith(".index.json"):
            return _open_directory(name, strict, refuse_dangerous)
        if is_directory(name):
            return _open_remote_directory(name, strict, refuse_dangerous)
        handle = open_source(name)
        return open_file(name, handle, strict, refuse_dangerous, track_spans, allow_ambiguous)
    name = local_path(name)
    if not is_dcp_directory(name) and is_framework_path(name):
        return _open_directory(name, strict, refuse_dangerous)
    if not is_dcp_directory(name):
        handle = open_local(name)
        return open_file(name, handle, strict, refuse_dangerous, track_spans, allow_ambiguous)
    return _open_dcp(name, open_local(os.path.join(name, DCP_METADATA)), strict, refuse_dangerous)


def _open_remote_directory(url: str, strict: bool, refuse_dangerous: bool) -> Checkpoint:
    """A directory under a URL: DCP when it has a ``.metadata``, else a framework's layout
    (which needs a store that lists: HTTP cannot)."""
    from ckpttool.io.remote import display_url, url_scheme

    try:
        metadata = open_source(join(url, DCP_METADATA))
    except InputError as error:
        if "no such file" not in str(error):
            raise
    else:
        return _open_dcp(url, metadata, strict, refuse_dangerous)
    if url_scheme(url) in ("http", "https", "hf"):
        raise InputError(
            f"{display_url(url)}: a directory without a {DCP_METADATA} file; HTTP cannot list a "
            "directory, so of directory checkpoints only torch.distributed.checkpoint ones are "
            "read from http(s):// and hf:// URLs (name a checkpoint file in it)"
        )
    return _open_directory(url, strict, refuse_dangerous)


def _open_dcp(name: str, handle: Any, strict: bool, refuse_dangerous: bool) -> Checkpoint:
    """A torch.distributed.checkpoint directory (local, or a URL) whose ``.metadata`` is open
    (its reader imported only now: listing a single file should not pay for it)."""
    dcp = format_by_id("dcp")
    return open_directory_format(dcp, name, handle, strict, refuse_dangerous)


def is_framework_path(path: str) -> bool:
    """A directory (not DCP) or an ``*.index.json`` file: a framework's several-file layout."""
    return os.path.isdir(path) or (path.endswith(".index.json") and os.path.isfile(path))


def _open_directory(name: str, strict: bool, refuse_dangerous: bool) -> Checkpoint:
    """A framework's directory (Hugging Face, Trainer, accelerate) as one checkpoint."""
    from ckpttool.frameworks.base import COLLECTION, describe_collection, detect_directory
    from ckpttool.frameworks.tree import directory_size, read_directory

    layout = detect_directory(name)
    if layout is None:
        if os.path.isdir(name) and has_dcp_shards(name):
            open_local(name)  # raises the DCP-specific message
        raise NotADirectoryCheckpointError(
            f"{name}: is a directory, but not a checkpoint layout ckpttool knows (a Hugging Face "
            "model or Trainer checkpoint, an accelerate save_state folder, a DeepSpeed save or tag "
            f"directory, a DCP directory); {_files_seen(name)}"
        )
    if layout.layout == COLLECTION:
        raise CheckpointCollectionError(layout, describe_collection(layout))
    parsed = read_directory(layout, strict=strict, refuse_dangerous=refuse_dangerous)
    return Checkpoint(
        name=name,
        format=parsed.format,
        root=parsed.root,
        file_size=directory_size(layout),
        details=parsed.details,
        metadata=parsed.metadata,
        problems=list(parsed.problems),
        pickle=None,
        _parsed=parsed,
        _handle=None,
        _all_tensors=tensors(parsed.root),
    )


#: Names of files that are usually checkpoints (what ``show DIR`` lists of a plain directory).
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar")


def checkpoint_names(directory: str) -> list[str]:
    """The files directly in ``directory`` named like checkpoints, sorted (names only: nothing
    is opened)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted(
        name for name in entries
        if name.endswith(CHECKPOINT_SUFFIXES) and not name.startswith(".")
        and os.path.isfile(os.path.join(directory, name))
    )  # fmt: skip


def _files_seen(directory: str, most: int = 8) -> str:
    """What a plain directory holds, for the refusal: its checkpoint files, or that it has none."""
    names = checkpoint_names(directory)
    if not names:
        return (
            "it holds no file named like a checkpoint (*.pth, *.pt, *.bin, *.ckpt, *.safetensors)"
        )
    shown = ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")
    return (
        f"it holds {len(names)} checkpoint file{'s' if len(names) != 1 else ''}: {shown}; "
        "name one of them (verify and scan take the whole directory)"
    )


__all__ = ["Checkpoint", "checkpoint_names", "open_checkpoint", "open_source"]
