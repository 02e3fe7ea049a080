"""The one durable, atomic file writer, and the one atomic directory replacement.

A target that is a symlink is written through: the file or directory it points to is
replaced, the link stays (:func:`written_through`).

A crash at any moment leaves the target either as it was or complete: the bytes go to a temp
file in the target's directory (a rename across file systems would be a copy), which is
flushed and fsynced, then ``os.replace``-d over the target, and the directory is fsynced so the
rename itself survives a power loss. On any exception the temp file is removed and the target
is untouched.

A directory (:func:`staged_directory`) is built the same way: a temp directory beside the
target, every file and directory in it fsynced, renamed over the target (an existing one swapped
out atomically with ``renameat2(RENAME_EXCHANGE)`` where the kernel has it, else moved aside
first and put back if the second rename fails), and the parent fsynced.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ckpttool.errors import CLEANUP_SIGNALS, OutputExistsError

#: Temp files are named ``.<target name>.<random>.ckpttool-tmp`` so that ``verify`` can find
#: leftovers of interrupted writes next to a checkpoint.
TMP_SUFFIX = ".ckpttool-tmp"


def temp_name_pattern(target: Path) -> str:
    """Glob pattern matching the temp files a write to ``target`` may leave after a crash."""
    return f".{target.name}.*{TMP_SUFFIX}"


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back (delivered at the end of the block) while a temp
    file or directory is made and recorded for removal: one arriving in between would leave
    it behind (the test that stops a write the instant its temp file appears caught it)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, CLEANUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def clear_stale_backup(original: Path, backup: Path, *, dry_run: bool = False) -> bool:
    """Remove ``backup`` (not with ``dry_run``) where it is what an interrupted ``--backup``
    rewrite left (killed before it could remove it): the original's own inode (the hard link a
    backup is), or a copy of the same bytes. It holds nothing the original does not, and left
    there it would refuse every later ``--backup``. Returns whether it was stale; any other
    file at ``backup`` is kept (a backup is never overwritten) and the caller refuses."""
    try:
        if not (os.path.samefile(original, backup) or _same_bytes(original, backup)):
            return False
        if not dry_run:
            backup.unlink()
    except OSError:
        return False
    return True


def _same_bytes(a: Path, b: Path) -> bool:
    if os.path.islink(b) or not os.path.isfile(b) or os.path.getsize(a) != os.path.getsize(b):
        return False
    import filecmp

    return filecmp.cmp(a, b, shallow=False)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def written_through(target: Path) -> Path:
    """The path a write to ``target`` replaces: through a symlink, the file or directory it
    points to, and the link stays (the one rule of every writer, an in-place rewrite as an
    output: a shell's ``>`` and ``cp`` do the same); else ``target``."""
    return Path(os.path.realpath(target)) if os.path.islink(target) else target


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

    ``check``, if given, is called with the temp files' paths once they are complete
    (flushed), while they are fsynced on a second thread (the read-back comes from the page
    cache either way), and before anything is renamed: an exception from it (``convert``'s
    read-back verification), or from an fsync, removes the temps and leaves every target as
    it was.
    """
    stack = contextlib.ExitStack()
    temps: list[tuple[Path, Path]] = []
    handles: list[BinaryIO] = []
    try:
        for target in map(written_through, targets):
            directory = target.parent if str(target.parent) else Path(".")
            with signals_held():
                fd, tmp_name = tempfile.mkstemp(
                    prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=directory
                )
                temps.append((Path(tmp_name), target))
            handles.append(stack.enter_context(os.fdopen(fd, "wb")))
        yield handles
        for handle in handles:
            handle.flush()
        _sync_while([handle.fileno() for handle in handles], check, [tmp for tmp, _ in temps])
        stack.close()
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


def _sync_while(
    fds: list[int], check: Callable[[list[Path]], None] | None, temps: list[Path]
) -> None:
    """fsync ``fds`` and run ``check(temps)`` at once (fsync lets go of the GIL: a
    ``convert``'s read-back overlaps the disk's write, bench/README.md "Near the floors");
    both end before this returns, and check's error wins over an fsync's."""
    if check is None:
        for fd in fds:
            os.fsync(fd)
        return
    import threading

    failed: list[BaseException] = []

    def sync() -> None:
        try:
            for fd in fds:
                os.fsync(fd)
        except BaseException as error:  # raised on the caller's thread, below
            failed.append(error)

    syncing = threading.Thread(target=sync, name="ckpttool-fsync")
    syncing.start()
    try:
        check(temps)
    finally:  # an error or Ctrl-C in check: the files stay open until their fsync ends
        syncing.join()
    if failed:
        raise failed[0]


@contextlib.contextmanager
def staged_directory(
    target: Path, *, replace_existing: bool, parent: Path | None = None
) -> Iterator[Path]:
    """A temp directory beside ``target`` (in ``parent``, default its parent) that becomes
    ``target`` on a clean exit: its files and directories are fsynced, it gets the permissions
    of a new directory, it is renamed into place (:func:`replace_directory`) and the parent is
    fsynced. Any exception removes it and leaves ``target`` as it was. A symlink ``target`` is
    written through (:func:`written_through`)."""
    if os.path.islink(target):
        target = written_through(target)
        parent = target.parent
    if parent is None:
        parent = target.parent if str(target.parent) else Path(".")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=parent))
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
        _fsync_tree(staging)
        replace_directory(staging, target, replace_existing)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _fsync_tree(top: Path) -> None:
    """fsync every file under ``top``, then every directory, deepest first."""
    directories = [top]
    for root, dirs, files in os.walk(top):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        directories += [Path(root, name) for name in dirs]
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(directory)


def replace_directory(temp: Path, target: Path, replace_existing: bool) -> None:
    """Rename the finished ``temp`` to ``target`` and fsync the parent; an existing ``target``
    (only with ``replace_existing``) is swapped out atomically where the kernel can
    (``renameat2(RENAME_EXCHANGE)``), else moved aside first, and removed once the new one is
    in place."""
    parent = temp.parent
    if not os.path.lexists(target):
        os.rename(temp, target)
        fsync_dir(parent)
        return
    if not replace_existing:
        raise OutputExistsError(f"{target} appeared while writing; it was kept")
    if _exchange(temp, target):
        fsync_dir(parent)
        shutil.rmtree(temp)  # now holds the old directory
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", suffix=TMP_SUFFIX, dir=parent))
    os.rmdir(aside)
    os.rename(target, aside)
    try:
        os.rename(temp, target)
    except BaseException:
        os.rename(aside, target)
        raise
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``). False where unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(name, use_errno=True)
        renameat2 = libc.renameat2
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) == 0:
            return True
    return False
