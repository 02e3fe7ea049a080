"""Where checkpoint bytes come from: a local file (``pread``) or a URL (ranged reads).

The reader and the format modules read through two calls, :func:`read_range` and
:func:`source_size`, on either an open local file or a remote file (:mod:`ckpttool.io.remote`,
imported only when a URL is opened). Which names are URLs is decided here, in one place
(:func:`is_url`); plain local use imports nothing more than this module.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

# scheme://... (s3, gs, az, abfs, hf, http, https, and any other fsspec protocol). A Windows
# drive ("C:\\x") has no "//" after the colon; "file://" is a URL to fsspec but read locally.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(name: str | os.PathLike[str]) -> str | None:
    """The protocol of ``name`` if it is a URL (``"s3"``, ``"https"``...), else None."""
    match = _URL.match(os.fspath(name)) if isinstance(name, str) else None
    return match.group(1).lower() if match else None


def is_url(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` is read over the network (a ``file://`` URL is a local path)."""
    scheme = url_scheme(name)
    return scheme is not None and scheme != "file"


def local_path(name: str) -> str:
    """``file:///x`` -> ``/x``; any other name unchanged."""
    return name[len("file://") :] if url_scheme(name) == "file" else name


class RangeReader(Protocol):
    """A file read by byte ranges (a remote object): what replaces ``pread`` on a descriptor."""

    size: int

    def read_range(self, offset: int, length: int) -> bytearray:
        """``length`` bytes at ``offset``, fewer only at the end of the file."""
        ...

    def close(self) -> None: ...


@dataclass
class RemoteSettings:
    """What the CLI's remote options set for the library calls of one command."""

    full_download: bool = False  # a server that ignores Range: download the file into memory
    verbose: bool = False


#: The settings :mod:`ckpttool.io.remote` reads when it opens a URL (the CLI sets them).
SETTINGS = RemoteSettings()


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


# -- directories: a DCP checkpoint's members, local or under a URL ----------------------------


def join(directory: str, name: str) -> str:
    """``directory/name`` for a local directory or a URL."""
    if is_url(directory):
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)


def member_sizes(directory: str, names: list[str]) -> dict[str, int]:
    """Sizes of the regular files among ``names`` in ``directory`` (absent ones left out)."""
    if is_url(directory):
        from ckpttool.io.remote import member_sizes as remote_sizes

        return remote_sizes(directory, names)
    sizes = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            sizes[name] = os.stat(path).st_size
    return sizes


def can_list(directory: str) -> bool:
    """Whether ``directory``'s files can be listed: a local one, or a URL of an object store
    (not ``http(s)://`` or ``hf://``: HTTP has no listing)."""
    return url_scheme(directory) not in ("http", "https", "hf")


def list_names(directory: str) -> list[str]:
    """Names of the files directly in ``directory`` (a URL's, where its protocol can list)."""
    if is_url(directory):
        from ckpttool.io.remote import list_names as remote_names

        return remote_names(directory)
    return sorted(entry.name for entry in os.scandir(directory) if entry.is_file())


def list_dirs(directory: str) -> list[str]:
    """Names of the subdirectories directly in ``directory`` (local: not symlinks; a URL's: the
    prefixes its store lists, none over HTTP). OSError (local) or
    :class:`~ckpttool.errors.CkptError` (URL) if it cannot be listed."""
    if is_url(directory):
        from ckpttool.io.remote import list_directories

        return list_directories(directory)
    return sorted(e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False))


def open_member(directory: str, name: str) -> int | RangeReader:
    """A member file of ``directory`` opened for :func:`read_range`: a descriptor, or a remote
    file. Raises OSError for a local file that cannot be opened."""
    if is_url(directory):
        from ckpttool.io.remote import open_remote

        return open_remote(join(directory, name))
    return os.open(os.path.join(directory, name), os.O_RDONLY)


def close_member(source: int | RangeReader) -> None:
    if isinstance(source, int):
        os.close(source)
    else:
        source.close()


# -- framework directories (Hugging Face, Trainer, accelerate): listing and small files ------


def is_dir(path: str) -> bool:
    """``os.path.isdir`` for a local path; for a URL, whether its store lists it as a directory."""
    if is_url(path):
        from ckpttool.io.remote import is_directory

        return is_directory(path)
    return os.path.isdir(path)


def is_file(path: str) -> bool:
    """``os.path.isfile`` for a local path; for a URL, whether it is not a directory (a missing
    one is reported when it is read)."""
    if is_url(path):
        return not is_dir(path)
    return os.path.isfile(path)


def read_small(path: str, limit: int) -> bytes:
    """A small file's bytes (an index, a JSON state); ``ValueError`` if over ``limit``, OSError
    (local) or :class:`~ckpttool.errors.CkptError` (URL) if unreadable."""
    if is_url(path):
        from ckpttool.checkpoint import open_source

        with open_source(path) as handle:
            if handle.size > limit:
                raise ValueError(f"{handle.size} bytes of JSON, more than any index needs")
            return bytes(handle.read())
    size = os.path.getsize(path)
    if size > limit:
        raise ValueError(f"{size} bytes of JSON, more than any index needs")
    with open(path, "rb") as handle:
        return handle.read()


def read_head(path: str, limit: int) -> bytes:
    """The first ``limit`` bytes of a file (a marker file such as DeepSpeed's ``latest``);
    OSError (local) or :class:`~ckpttool.errors.CkptError` naming the URL if unreadable."""
    if is_url(path):
        from ckpttool.io.remote import open_remote

        with open_remote(path) as handle:
            return bytes(handle.read_range(0, limit))
    with open(path, "rb") as handle:
        return handle.read(limit)


def shown_name(name: str) -> str:
    """How errors name ``name``: a URL without credentials or a presigned query."""
    if is_url(name):
        from ckpttool.io.remote import display_url

        return display_url(name)
    return name


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
