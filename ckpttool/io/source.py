"""Where checkpoint bytes come from: a local file (``pread``) or a URL (ranged reads).

A name is a :class:`Location` with one small set of verbs (open, list, join, read a small
file...), implemented twice: :class:`LocalSource` here, and
:class:`~ckpttool.io.remote.RemoteSource` for a URL. :func:`location` chooses once, from the
name (:func:`is_url`); no verb asks again, and plain local use imports nothing more than this
module (:mod:`ckpttool.io.remote` is imported only for a URL). The reader and the format
modules read an open file through two calls, :func:`read_range` and :func:`source_size`, on
either a local descriptor or a remote file.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from ckpttool.errors import EmptyFileError, InputError, MissingFileError, UnreadableFileError
from ckpttool.io.urls import SETTINGS as SETTINGS
from ckpttool.io.urls import RemoteSettings as RemoteSettings
from ckpttool.io.urls import is_url as is_url
from ckpttool.io.urls import local_path as local_path
from ckpttool.io.urls import url_scheme as url_scheme


class RangeReader(Protocol):
    """A file read by byte ranges (a remote object): what replaces ``pread`` on a descriptor."""

    size: int

    def read_range(self, offset: int, length: int) -> bytearray:
        """``length`` bytes at ``offset``, fewer only at the end of the file."""
        ...

    def close(self) -> None: ...


# These run once per tensor read: an attribute test, not isinstance() on a runtime-checkable
# protocol (which inspects every attribute, ~10 us: a second on 100,000 tensors).


def source_of(handle: Any) -> int | RangeReader:
    """What :func:`read_range` reads ``handle`` through: its descriptor, or itself if remote."""
    return handle if hasattr(handle, "read_range") else handle.fileno()


def source_size(handle: Any) -> int:
    """The size of an open local file or remote object."""
    if hasattr(handle, "read_range"):
        return int(handle.size)
    raw = getattr(handle, "raw", None)  # a buffered reader over a remote file or window
    if raw is not None and hasattr(raw, "read_range"):
        return int(raw.size)
    return os.fstat(handle.fileno()).st_size


def read_range(source: int | RangeReader, length: int, offset: int) -> bytearray:
    """``length`` bytes at ``offset`` of a descriptor or remote object, fewer only at its end."""
    if isinstance(source, int):
        return read_at(source, length, offset)
    return source.read_range(offset, length)


# -- where the bytes are: a local path or a URL, one protocol -----------------------------------


class Location(Protocol):
    """A name checkpoint bytes are read under, as a file or as a directory of members: a local
    path (:class:`LocalSource`) or a URL (:class:`ckpttool.io.remote.RemoteSource`).

    :func:`location` picks the implementation once, from the name; the functions below are
    its verbs for callers that hold a name. Errors: OSError for a local path,
    :class:`~ckpttool.errors.CkptError` naming the URL for a remote one (except the opening
    verbs, which raise :class:`~ckpttool.errors.CkptError` for both).
    """

    @property
    def name(self) -> str:
        """The name as given (a path, or the URL)."""
        ...

    def shown(self) -> str:
        """How errors name it (a URL without credentials or a presigned query)."""
        ...

    def open(self) -> Any:
        """The file opened for reading: a local binary file, or a remote one read by ranges.
        :class:`~ckpttool.errors.InputError` if it is missing, a directory, not a regular
        file or unreadable; :class:`~ckpttool.errors.EmptyFileError` if empty."""
        ...

    def is_dir(self) -> bool: ...

    def is_file(self) -> bool: ...

    def read_small(self, limit: int) -> bytes:
        """The whole file (an index, a JSON state); ``ValueError`` if over ``limit``."""
        ...

    def read_head(self, limit: int) -> bytes:
        """The first ``limit`` bytes (a marker file such as DeepSpeed's ``latest``)."""
        ...

    def join(self, member: str) -> str:
        """The name of ``member`` in this directory."""
        ...

    def member_sizes(self, names: list[str]) -> dict[str, int]:
        """Sizes of the regular files among ``names`` in this directory (absent ones left out)."""
        ...

    def can_list(self) -> bool:
        """Whether this directory's files can be listed (HTTP cannot)."""
        ...

    def list_names(self) -> list[str]: ...

    def list_dirs(self) -> list[str]: ...

    def open_member(self, member: str) -> int | RangeReader:
        """``member`` of this directory opened for :func:`read_range`."""
        ...


def location(name: str | os.PathLike[str]) -> Location:
    """``name``'s :class:`Location`: a URL's (:mod:`ckpttool.io.remote`, imported only here,
    only for a URL) or a local path's."""
    if is_url(name):
        from ckpttool.io.remote import RemoteSource  # fsspec and friends only for URLs

        return RemoteSource(os.fspath(name))
    return LocalSource(os.fspath(name))


@dataclass(frozen=True)
class LocalSource:
    """A local path (a ``file://`` URL opens as its path): the :class:`Location` on disk."""

    name: str

    def shown(self) -> str:
        return self.name

    def open(self) -> BinaryIO:
        return open_local(local_path(self.name))

    def is_dir(self) -> bool:
        return os.path.isdir(self.name)

    def is_file(self) -> bool:
        return os.path.isfile(self.name)

    def read_small(self, limit: int) -> bytes:
        size = os.path.getsize(self.name)
        if size > limit:
            raise ValueError(f"{size} bytes of JSON, more than any index needs")
        with open(self.name, "rb") as handle:
            return handle.read()

    def read_head(self, limit: int) -> bytes:
        with open(self.name, "rb") as handle:
            return handle.read(limit)

    def join(self, member: str) -> str:
        return os.path.join(self.name, member)

    def member_sizes(self, names: list[str]) -> dict[str, int]:
        sizes = {}
        for member in names:
            path = os.path.join(self.name, member)
            if os.path.isfile(path):
                sizes[member] = os.stat(path).st_size
        return sizes

    def can_list(self) -> bool:
        return True

    def list_names(self) -> list[str]:
        return sorted(entry.name for entry in os.scandir(self.name) if entry.is_file())

    def list_dirs(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.name) if e.is_dir(follow_symlinks=False))

    def open_member(self, member: str) -> int:
        return os.open(os.path.join(self.name, member), os.O_RDONLY)


def open_local(path: str) -> BinaryIO:
    """The local file ``path`` opened for reading, after the checks every command wants: it
    exists, is a regular file (a directory is refused with a generic message: the door words
    the kinds of directory it knows), and is not empty."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise MissingFileError(f"{path}: no such file") from None
    except PermissionError as error:
        raise UnreadableFileError(f"{path}: cannot access ({error.strerror})") from None
    except OSError as error:
        raise InputError(f"{path}: cannot access ({error.strerror})") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{path}: is a directory, not a checkpoint file")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file")
    try:
        handle = open(path, "rb")  # noqa: SIM115 - owned by the caller
    except PermissionError as error:
        raise UnreadableFileError(f"{path}: cannot open ({error.strerror})") from None
    except OSError as error:
        raise InputError(f"{path}: cannot open ({error.strerror})") from None
    if os.fstat(handle.fileno()).st_size == 0:
        handle.close()
        raise EmptyFileError(f"{path}: the file is empty (an interrupted save?)")
    return handle


# -- the verbs, for callers that hold a name -------------------------------------------------


def open_source(name: str) -> Any:
    """``name`` opened for reading: a local file, or a remote one read by ranges (a URL)."""
    return location(name).open()


def join(directory: str, name: str) -> str:
    """``directory/name`` for a local directory or a URL."""
    return location(directory).join(name)


def member_sizes(directory: str, names: list[str]) -> dict[str, int]:
    """Sizes of the regular files among ``names`` in ``directory`` (absent ones left out)."""
    return location(directory).member_sizes(names)


def can_list(directory: str) -> bool:
    """Whether ``directory``'s files can be listed: a local one, or a URL of an object store
    (not ``http(s)://`` or ``hf://``: HTTP has no listing)."""
    return location(directory).can_list()


def list_names(directory: str) -> list[str]:
    """Names of the files directly in ``directory`` (a URL's, where its protocol can list)."""
    return location(directory).list_names()


def list_dirs(directory: str) -> list[str]:
    """Names of the subdirectories directly in ``directory`` (local: not symlinks; a URL's: the
    prefixes its store lists, none over HTTP). OSError (local) or
    :class:`~ckpttool.errors.CkptError` (URL) if it cannot be listed."""
    return location(directory).list_dirs()


def open_member(directory: str, name: str) -> int | RangeReader:
    """A member file of ``directory`` opened for :func:`read_range`: a descriptor, or a remote
    file. Raises OSError for a local file that cannot be opened."""
    return location(directory).open_member(name)


def close_member(source: int | RangeReader) -> None:
    if isinstance(source, int):
        os.close(source)
    else:
        source.close()


def is_dir(path: str) -> bool:
    """``os.path.isdir`` for a local path; for a URL, whether its store lists it as a directory."""
    return location(path).is_dir()


def is_file(path: str) -> bool:
    """``os.path.isfile`` for a local path; for a URL, whether it is not a directory (a missing
    one is reported when it is read)."""
    return location(path).is_file()


def read_small(path: str, limit: int) -> bytes:
    """A small file's bytes (an index, a JSON state); ``ValueError`` if over ``limit``, OSError
    (local) or :class:`~ckpttool.errors.CkptError` (URL) if unreadable."""
    return location(path).read_small(limit)


def read_head(path: str, limit: int) -> bytes:
    """The first ``limit`` bytes of a file (a marker file such as DeepSpeed's ``latest``);
    OSError (local) or :class:`~ckpttool.errors.CkptError` naming the URL if unreadable."""
    return location(path).read_head(limit)


def shown_name(name: str) -> str:
    """How errors name ``name``: a URL without credentials or a presigned query."""
    return location(name).shown()


def read_into(source: int | RangeReader, offset: int, into: memoryview) -> int:
    """Up to ``len(into)`` bytes at ``offset`` of a descriptor or remote object, read into
    ``into`` (no new buffer for a descriptor); how many (fewer only at the end)."""
    if not isinstance(source, int):
        data = source.read_range(offset, len(into))
        into[: len(data)] = data
        return len(data)
    done = 0
    while done < len(into):
        got = os.preadv(source, [into[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def read_at(fd: int, length: int, offset: int) -> bytearray:
    """``length`` bytes at ``offset``, fewer only at the end of the file.

    One ``pread`` moves at most 2 GiB on Linux (a bf16 embedding of a large model is more), so
    this loops until the bytes are there or the file ends.
    """
    data = bytearray(length)
    view = memoryview(data)
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    view.release()
    del data[done:]
    return data
