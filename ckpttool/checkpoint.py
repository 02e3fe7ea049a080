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

Any other directory is a framework's: the frameworks of :mod:`ckpttool.frameworks.registry`
are asked in order (each once per open) which knows it, and that one's members are read as one
tree. ``view=`` asks for another view of it than the merged tree, by name
(:data:`~ckpttool.frameworks.base.WEIGHTS_VIEW`: the model's weights as the framework
consolidates them, DeepSpeed ZeRO's fp32 master weights); a checkpoint without that view opens
as the files are stored. :data:`~ckpttool.frameworks.base.DEFAULT_VIEW` asks for the view the
layout itself declares (:attr:`~ckpttool.frameworks.base.Framework.default_view`): every reader
of a checkpoint's tensors, command or library call, asks for that one, so that no command and no
library call decides a layout's default. No command names a framework.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ckpttool.errors import (
    CheckpointCollectionError,
    InputError,
    NotACheckpointError,
    NotADirectoryCheckpointError,
)
from ckpttool.formats.base import Checkpoint
from ckpttool.formats.registry import (
    as_checkpoint,
    directory_format_of,
    directory_formats,
    incomplete_directory,
    open_directory_format,
    open_file,
)
from ckpttool.io.source import is_url, join, local_path, open_local, open_source
from ckpttool.model.records import (
    tensors,
)

if TYPE_CHECKING:
    from ckpttool.frameworks.base import FrameworkDirectory

#: What the frameworks answered for one path during one open (framework name -> layout).
Known = dict[str, "FrameworkDirectory | None"]


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    refuse_dangerous: bool = True,
    track_spans: bool = False,
    allow_ambiguous: bool = False,
    view: str | None = None,
) -> Checkpoint:
    """Open ``path`` safely and lazily. Raises a :class:`~ckpttool.errors.CkptError` subclass
    whose message names the file (whatever part of it the error concerns).

    ``strict=False`` records structural problems in ``Checkpoint.problems`` where it can go on
    (``verify`` uses this); ``refuse_dangerous=False`` records dangerous globals instead of
    refusing the file (``scan``). A file that reads two ways (docs/safety.md, "Parser
    differentials") raises :class:`~ckpttool.errors.AmbiguousFileError`; with
    ``allow_ambiguous`` (``scan``) it is read as ``torch.load`` reads it (a file not named
    ``*.safetensors``) and ``details["ambiguous"]`` says what else it is.

    ``view`` names a view a framework offers of its directories, or ``DEFAULT_VIEW``: the one
    the layout declares (module docstring); None or ``FILES_VIEW`` (which no framework offers):
    the files as stored. The opened view's ``details["view"]`` holds its
    :class:`~ckpttool.frameworks.base.ViewFacts`.
    """
    return _open(os.fspath(path), strict, refuse_dangerous, track_spans, allow_ambiguous, view, {})


#: ``details`` key of a view the door opened: the path it was asked for and the detections
#: that found the view (:data:`Known`), for :func:`open_files_of`.
DETECTED = "detected"


def open_files_of(view: Checkpoint) -> Checkpoint:
    """The files as stored of the directory ``view`` (a framework's view, opened by
    :func:`open_checkpoint`) was opened from, from the detections that found the view
    (nothing detected twice): what ``diff`` compares beyond a view assembled from some of them."""
    name, known = view.details.get(DETECTED, (view.name, {}))
    return _open(name, True, True, False, False, None, known)


def _open(
    name: str,
    strict: bool,
    refuse_dangerous: bool,
    track_spans: bool,
    allow_ambiguous: bool,
    view: str | None,
    known: Known,
) -> Checkpoint:
    """:func:`open_checkpoint`, with the detections already made for ``name`` in ``known``."""
    if view is not None:
        opened = _open_view(name, view, known)
        if opened is not None:
            opened.details[DETECTED] = (name, known)
            return opened
    if is_url(name):
        from ckpttool.io.remote import is_directory

        if name.endswith(".index.json"):
            return _open_directory(name, strict, refuse_dangerous, known)
        if is_directory(name):
            return _open_remote_directory(name, strict, refuse_dangerous, known)
        handle = open_source(name)
        return open_file(name, handle, strict, refuse_dangerous, track_spans, allow_ambiguous)
    if local_path(name) != name:  # file:///x: what was detected was asked of another name
        name = local_path(name)
        known.clear()
    directory_format = directory_format_of(name) if os.path.isdir(name) else None
    if directory_format is not None and _framework_over_format(name, known):
        return _open_directory(name, strict, refuse_dangerous, known)
    if directory_format is not None:  # DCP: its index file names every other
        index = open_local(os.path.join(name, directory_format.index_name))
        return open_directory_format(directory_format, name, index, strict, refuse_dangerous)
    if is_framework_path(name):
        return _open_directory(name, strict, refuse_dangerous, known)
    handle = open_local(name)
    try:
        return open_file(name, handle, strict, refuse_dangerous, track_spans, allow_ambiguous)
    except NotACheckpointError:
        archive = _archive_of_parts(name, strict, refuse_dangerous, known)
        if archive is None:
            raise
        return archive


def _archive_of_parts(
    name: str, strict: bool, refuse_dangerous: bool, known: Known
) -> Checkpoint | None:
    """A local file no format reads, as an archive of checkpoint files a framework knows (a zip
    of ``.pth`` members: its named parts); None when none does (asked after every format, so
    that a file a format reads is never read as an archive)."""
    from ckpttool.frameworks.registry import detect_archive, read_directory

    found = detect_archive(name, known)
    if found is None:
        return None
    layout, framework = found
    parsed, size = read_directory(
        layout, framework, strict=strict, refuse_dangerous=refuse_dangerous
    )
    return as_checkpoint(name, parsed, None, size, tensors(parsed.root))


def _framework_over_format(name: str, known: Known) -> bool:
    """Whether a framework's layout holds the directory-format directory ``name`` (Lightning's
    sharded checkpoint: DCP plus ``meta.pt``)."""
    from ckpttool.frameworks.registry import detect_before_format

    return detect_before_format(name, known) is not None


def _open_view(name: str, view: str, known: Known) -> Checkpoint | None:
    """``view`` of the directory ``name`` from the first framework that offers it and knows the
    directory (asked before the detection order: a DeepSpeed save inside a Trainer
    ``checkpoint-N/`` is read as DeepSpeed's); for ``DEFAULT_VIEW``, each framework's declared
    ``default_view``. None: the files as stored."""
    from ckpttool.frameworks.base import DEFAULT_VIEW
    from ckpttool.frameworks.registry import detect_once, frameworks
    from ckpttool.io.source import is_dir

    if not is_dir(name):
        return None
    for framework in frameworks():
        wanted = framework.default_view if view == DEFAULT_VIEW else view
        if wanted is not None and wanted in framework.views:
            layout = detect_once(framework, name, known)
            if layout is not None:
                return framework.open_view(layout, wanted)
    return None


def _open_remote_directory(
    url: str, strict: bool, refuse_dangerous: bool, known: Known
) -> Checkpoint:
    """A directory under a URL: a framework's layout that holds a directory format's directory
    (Lightning's sharded ``meta.pt`` beside DCP, torchtitan's ``step-N``: found by name over
    HTTP too), else a directory format's when it has that format's index file (DCP:
    ``.metadata``), else a framework's layout (which needs a store that lists: HTTP cannot)."""
    from ckpttool.io.urls import display_url, url_scheme

    if _framework_over_format(url, known):  # Lightning's sharded and torchtitan's: DCP + more
        return _open_directory(url, strict, refuse_dangerous, known)
    formats = list(directory_formats())
    for fmt in formats:
        try:
            index = open_source(join(url, fmt.index_name))
        except InputError as error:
            if "no such file" not in str(error):
                raise
        else:
            if _framework_over_format(url, known):
                index.close()
                return _open_directory(url, strict, refuse_dangerous, known)
            return open_directory_format(fmt, url, index, strict, refuse_dangerous)
    if url_scheme(url) in ("http", "https", "hf"):
        names = " or ".join(fmt.index_name for fmt in formats)
        titles = " and ".join(fmt.directory_title for fmt in formats)
        raise InputError(
            f"{display_url(url)}: a directory without a {names} file; HTTP cannot list a "
            f"directory, so of directory checkpoints only {titles} ones are "
            "read from http(s):// and hf:// URLs (name a checkpoint file in it)"
        )
    return _open_directory(url, strict, refuse_dangerous, known)


def is_framework_path(path: str) -> bool:
    """A directory (not DCP) or an ``*.index.json`` file: a framework's several-file layout."""
    return os.path.isdir(path) or (path.endswith(".index.json") and os.path.isfile(path))


def _open_directory(name: str, strict: bool, refuse_dangerous: bool, known: Known) -> Checkpoint:
    """A framework's directory as one checkpoint: its members' trees merged."""
    from ckpttool.frameworks.base import describe_collection
    from ckpttool.frameworks.registry import detect_once, frameworks, read_directory

    layout = framework = None
    for framework in frameworks():
        layout = detect_once(framework, name, known)
        if layout is not None:
            break
    if layout is None or framework is None:
        incomplete = incomplete_directory(name)
        if incomplete is not None:
            raise incomplete
        raise NotADirectoryCheckpointError(
            f"{name}: is a directory, but not a checkpoint layout ckpttool knows (a Hugging Face "
            "model or Trainer checkpoint, a PEFT adapter, an accelerate save_state folder, a "
            "DeepSpeed save or tag directory, a Megatron save, a torchtitan or torchtune "
            "checkpoint, a set of per-rank state dicts, a DCP directory, a folder of differently "
            "named checkpoint files without subfolders); "
            f"{_files_seen(name)}"
        )
    if layout.collection:
        raise CheckpointCollectionError(layout, describe_collection(layout))
    opened = framework.open_directory(layout, strict=strict, refuse_dangerous=refuse_dangerous)
    if opened is not None:
        return opened
    parsed, size = read_directory(
        layout, framework, strict=strict, refuse_dangerous=refuse_dangerous
    )
    return as_checkpoint(name, parsed, None, size, tensors(parsed.root))


def checkpoint_names(directory: str) -> list[str]:
    """The files directly in ``directory`` named like checkpoints, sorted (names only: nothing
    is opened)."""
    from ckpttool.frameworks.base import CHECKPOINT_SUFFIXES

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
    from ckpttool.frameworks.base import one_series

    shown = ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")
    run = " (one run's checkpoints: `ckpttool trend` follows them)" if one_series(names) else ""
    return (
        f"it holds {len(names)} checkpoint file{'s' if len(names) != 1 else ''}: {shown}{run}; "
        "name one of them (verify and scan take the whole directory)"
    )


__all__ = ["Checkpoint", "checkpoint_names", "open_checkpoint", "open_source"]
