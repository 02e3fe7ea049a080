"""The one durable, atomic file writer.

A crash at any moment leaves the target either as it was or complete: the bytes go to a temp
file in the target's directory (a rename across file systems would be a copy), which is
flushed and fsynced, then ``os.replace``-d over the target, and the directory is fsynced so the
rename itself survives a power loss. On any exception the temp file is removed and the target
is untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

#: Temp files are named ``.<target name>.<random>.ckpttool-tmp`` so that ``verify`` can find
#: leftovers of interrupted writes next to a checkpoint.
TMP_SUFFIX = ".ckpttool-tmp"


def temp_name_pattern(target: Path) -> str:
    """Glob pattern matching the temp files a write to ``target`` may leave after a crash."""
    return f".{target.name}.*{TMP_SUFFIX}"


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(target: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temp file for writing; on clean exit it atomically and durably becomes ``target``.

    >>> with atomic_write("out/model.pth") as f:  # doctest: +SKIP
    ...     torch.save(state_dict, f)
    """
    with atomic_group([Path(target)]) as (handle,):
        yield handle


@contextlib.contextmanager
def atomic_group(
    targets: list[Path], *, check: Callable[[list[Path]], None] | None = None
) -> Iterator[list[BinaryIO]]:
    """Write several files that must appear together (shards + index) or not at all.

    All temp files are written and fsynced first; only then are they renamed, index last.
    A crash between renames can leave some new shards beside the old index; the caller puts the
    index (the file readers start from) last in ``targets`` so that it is never ahead of its
    shards.

    ``check``, if given, is called with the temp files' paths once they are complete and
    closed, before anything is renamed: an exception from it (``convert``'s read-back
    verification) removes the temps and leaves every target as it was.
    """
    stack = contextlib.ExitStack()
    temps: list[tuple[Path, Path]] = []
    handles: list[BinaryIO] = []
    try:
        for target in targets:
            directory = target.parent if str(target.parent) else Path(".")
            fd, tmp_name = tempfile.mkstemp(
                prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=directory
            )
            temps.append((Path(tmp_name), target))
            handles.append(stack.enter_context(os.fdopen(fd, "wb")))
        yield handles
        for handle in handles:
            handle.flush()
            os.fsync(handle.fileno())
        stack.close()
        if check is not None:
            check([tmp_path for tmp_path, _ in temps])
        umask = os.umask(0)
        os.umask(umask)
        for tmp_path, target in temps:
            os.chmod(tmp_path, 0o666 & ~umask)
            os.replace(tmp_path, target)
    except BaseException:
        stack.close()
        for tmp_path, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                tmp_path.unlink()
        raise
    for directory in {target.parent for _, target in temps}:
        fsync_dir(directory if str(directory) else Path("."))
