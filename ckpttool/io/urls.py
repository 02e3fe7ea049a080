"""URLs: which names are read over the network, how messages show them, and the settings for
reading them that the command line sets.

The lowest of :mod:`ckpttool.io`'s modules: :mod:`ckpttool.io.source` (which re-exports these
names), :mod:`ckpttool.io.remote` and :mod:`ckpttool.io.remote_backends` all import it, and it
imports none of them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

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


def display_url(url: str) -> str:
    """``url`` as messages show it: no user:password, no query (a presigned URL's signature)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}" if parts.scheme else url


@dataclass
class RemoteSettings:
    """What the CLI's remote options set for the library calls of one command."""

    full_download: bool = False  # a server that ignores Range: download the file into memory
    verbose: bool = False


#: The settings :mod:`ckpttool.io.remote` reads when it opens a URL (the CLI sets them).
SETTINGS = RemoteSettings()
