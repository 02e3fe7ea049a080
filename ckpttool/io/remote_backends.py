"""The requests behind :mod:`ckpttool.io.remote`: one range per request, checked.

``HttpBackend`` (``http(s)://`` and ``hf://``, the standard library's HTTP client: every
response checked for ``206``, the ``Content-Range`` asked for, the size and ``ETag`` seen at
open, the body's length), ``FsspecBackend`` (every other protocol, through fsspec and the
protocol's package), ``MemoryBackend`` (a file a server sent whole, ``--full-download``), and
how ``hf://`` URLs become the hub's resolve URLs with the token the hub's own client would send.
Each backend has ``stat()`` and ``fetch(start, stop)``; faults worth another attempt raise
:class:`TransientError`, and :class:`~ckpttool.io.remote.RemoteFile` retries.
"""

from __future__ import annotations

import http.client
import os
import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

from ckpttool.errors import ChangedError, InputError
from ckpttool.io.urls import SETTINGS, display_url, url_scheme

TIMEOUT = 30.0  # seconds a request may wait for the server before it counts as a fault
MAX_REDIRECTS = 5
MAX_FULL_DOWNLOAD = 8 << 30  # --full-download keeps the file in memory: refuse beyond this

# Protocols fsspec reads through a package of their own: named in the message when it is missing.
PROTOCOL_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "adl": "adlfs", "oci": "ocifs", "webdav": "webdav4", "sftp": "paramiko",
    "ssh": "paramiko", "smb": "smbprotocol",
}  # fmt: skip


class TransientError(Exception):
    """A fault worth another attempt (dropped connection, 5xx, short body, timeout).

    ``received``: the body bytes the failed attempt brought before it failed (a dropped
    connection's first half): fetched, so counted in ``--verbose``, though not used.
    """

    def __init__(self, message: str, received: int = 0) -> None:
        super().__init__(message)
        self.received = received


# -- backends: one request for one range ------------------------------------------------------


class HttpBackend:
    """Ranged GETs with ``http.client``: one keep-alive connection per thread."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = dict(headers or {})
        self.etag: str | None = None
        self.size = -1
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connection(self, url: str) -> http.client.HTTPConnection:
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname, parts.port)
        cached = getattr(self._local, "connection", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None:
            cached[1].close()
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = cls(parts.hostname or "", parts.port, timeout=TIMEOUT)
        self._local.connection = (key, connection)
        with self._lock:
            self._connections.append(connection)
        return connection

    def _drop_connection(self) -> None:
        cached = getattr(self._local, "connection", None)
        if cached is not None:
            cached[1].close()
            self._local.connection = None

    def _get(self, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, str]:
        """The response to a GET of the file, redirects followed (credentials kept on one host)."""
        url = self.url
        sent = {**self.headers, **headers}
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            connection = self._connection(url)
            try:
                connection.request("GET", target, headers=sent)
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as error:
                self._drop_connection()
                raise TransientError(f"{type(error).__name__}: {error}") from None
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                response.read()
                if not location:
                    raise InputError(f"{display_url(self.url)}: a redirect without a Location")
                new_url = urljoin(url, location)
                if urlsplit(new_url).netloc != parts.netloc:
                    sent.pop("Authorization", None)  # never hand a token to another host
                url = new_url
                continue
            return response, url
        raise InputError(f"{display_url(self.url)}: more than {MAX_REDIRECTS} redirects")

    def _check_status(self, response: http.client.HTTPResponse) -> None:
        status = response.status
        if status in (200, 206):
            return
        self._discard(response)
        where = display_url(self.url)
        if status in (401, 403):
            raise InputError(
                f"{where}: access denied (HTTP {status}); check the credentials for this server"
            )
        if status == 404:
            raise InputError(f"{where}: no such file (HTTP 404)")
        if status in (412, 416):
            raise ChangedError(f"{where}: the file changed while it was being read; run again")
        if status >= 500 or status in (408, 429):
            raise TransientError(f"HTTP {status}")
        raise InputError(f"{where}: the server answered HTTP {status} {response.reason}")

    def _discard(self, response: http.client.HTTPResponse) -> None:
        """Drop a response without reading a body that may be the whole file."""
        response.close()
        self._drop_connection()

    def stat(self) -> tuple[int, str | None, bytes | None]:
        """(size, ETag, the whole file when the server ignored Range and that was allowed)."""
        response, final_url = self._get({"Range": "bytes=0-0"})
        self._check_status(response)
        self.url = final_url  # later ranges go straight to where the redirects led
        self.etag = response.getheader("ETag")
        if response.status == 200:
            length = response.getheader("Content-Length")
            if not SETTINGS.full_download:
                self._discard(response)
                raise InputError(
                    f"{display_url(self.url)}: the server does not honour Range requests (it "
                    "sends the whole file); pass --full-download to download it into memory"
                )
            if length is not None and int(length) > MAX_FULL_DOWNLOAD:
                self._discard(response)
                raise InputError(
                    f"{display_url(self.url)}: --full-download keeps the file in memory, and it "
                    f"has {int(length):,} bytes (limit {MAX_FULL_DOWNLOAD:,})"
                )
            try:
                body = response.read()
            except (OSError, http.client.HTTPException) as error:
                self._drop_connection()
                raise TransientError(f"{type(error).__name__}: {error}") from None
            if length is not None and len(body) != int(length):
                raise TransientError("short body")
            self.size = len(body)
            return self.size, self.etag, body
        first, last, total = _content_range(response)
        response.read()
        if (first, last) != (0, 0):
            raise InputError(f"{display_url(self.url)}: the server answered another range")
        self.size = total
        return total, self.etag, None

    def fetch(self, start: int, stop: int) -> bytes:
        buffer = bytearray(stop - start)
        self.fetch_into(start, stop, memoryview(buffer))
        return bytes(buffer)

    def fetch_into(self, start: int, stop: int, target: memoryview) -> None:
        """Bytes [start, stop) into ``target`` (no intermediate copy: values go straight into
        the buffer the reader returns)."""
        headers = {"Range": f"bytes={start}-{stop - 1}"}
        if self.etag and not self.etag.startswith("W/"):
            headers["If-Match"] = self.etag  # a changed file answers 412, not other bytes
        response, _ = self._get(headers)
        self._check_status(response)
        if response.status == 200:
            self._discard(response)
            raise ChangedError(
                f"{display_url(self.url)}: the server stopped honouring Range requests"
            )
        etag = response.getheader("ETag")
        first, last, total = _content_range(response)
        if total != self.size or (self.etag is not None and etag not in (None, self.etag)):
            self._discard(response)
            raise ChangedError(
                f"{display_url(self.url)}: the file changed while it was being read "
                f"(size {self.size:,} -> {total:,}); run again"
                if total != self.size
                else f"{display_url(self.url)}: the file changed while it was being read "
                "(its ETag changed); run again"
            )
        if (first, last) != (start, stop - 1):
            self._discard(response)
            raise TransientError(f"asked for bytes {start}-{stop - 1}, got {first}-{last}")
        got = 0
        try:
            while got < stop - start:
                count = response.readinto(target[got:])
                if not count:
                    break
                got += count
            extra = response.read(1)  # an honest server has nothing more
        except (OSError, http.client.HTTPException) as error:
            self._drop_connection()
            raise TransientError(f"{type(error).__name__}: {error}", received=got) from None
        if got != stop - start or extra:
            self._drop_connection()
            raise TransientError(
                f"short body ({got:,} of {stop - start:,} bytes)", received=got + len(extra)
            )

    def close(self) -> None:
        with self._lock:
            for connection in self._connections:
                connection.close()
            self._connections.clear()


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+)\s*$")


def _content_range(response: http.client.HTTPResponse) -> tuple[int, int, int]:
    header = response.getheader("Content-Range") or ""
    match = _CONTENT_RANGE.match(header)
    if match is None:
        response.close()
        raise TransientError(f"a 206 response without a usable Content-Range ({header!r:.60})")
    first, last, total = (int(group) for group in match.groups())
    return first, last, total


class FsspecBackend:
    """Any protocol fsspec knows (s3, gs, az, ...): ``cat_file`` of one range per request."""

    def __init__(self, url: str) -> None:
        scheme = url_scheme(url) or ""
        package = PROTOCOL_PACKAGES.get(scheme)
        try:
            import fsspec
        except ImportError:
            extra = f" and {package}" if package else ""
            raise InputError(
                f"{display_url(url)}: reading {scheme}:// URLs needs fsspec{extra}: "
                "pip install 'ckpttool[remote]'"
            ) from None
        try:
            self.fs, self.path = fsspec.core.url_to_fs(url)
        except ImportError:
            need = package or f"the fsspec package for {scheme}://"
            raise InputError(
                f"{display_url(url)}: reading {scheme}:// URLs needs {need}: "
                f"pip install 'ckpttool[remote]' (or pip install {need})"
            ) from None
        except ValueError as error:  # fsspec: "Protocol not known"
            raise InputError(f"{display_url(url)}: {error}") from None
        self.url = url
        self.etag: str | None = None
        self.size = -1

    def stat(self) -> tuple[int, str | None, bytes | None]:
        info = self._call(lambda: self.fs.info(self.path))
        if info.get("type") == "directory":
            raise InputError(
                f"{display_url(self.url)}: is a directory; remote directory checkpoints are "
                "not read yet: name a checkpoint file in it"
            )
        self.size = int(info["size"])
        self.etag = _identity(info)
        return self.size, self.etag, None

    def identity(self) -> tuple[int, str | None]:
        """Size and ETag as the store reports them now (uncached)."""
        self.fs.invalidate_cache(self.path)
        info = self._call(lambda: self.fs.info(self.path))
        return int(info["size"]), _identity(info)

    def fetch(self, start: int, stop: int) -> bytes:
        data = self._call(lambda: self.fs.cat_file(self.path, start=start, end=stop))
        if len(data) != stop - start:
            raise TransientError(
                f"short body ({len(data):,} of {stop - start:,} bytes)", received=len(data)
            )
        return bytes(data)

    def _call(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except FileNotFoundError:
            raise InputError(f"{display_url(self.url)}: no such file") from None
        except PermissionError:
            raise InputError(
                f"{display_url(self.url)}: access denied; check this protocol's credentials "
                "(environment, profile files)"
            ) from None
        except (OSError, TimeoutError, ConnectionError) as error:
            raise TransientError(f"{type(error).__name__}: {error}") from None
        except Exception as error:  # botocore's and the SDKs' own hierarchies
            if _looks_like_auth(error):
                raise InputError(
                    f"{display_url(self.url)}: access denied or no credentials found; check "
                    "this protocol's credentials (environment, profile files)"
                ) from None
            raise TransientError(f"{type(error).__name__}") from None

    def close(self) -> None:
        pass


def _identity(info: dict[str, Any]) -> str | None:
    for key in ("ETag", "etag", "md5", "generation", "version_id", "mtime", "LastModified"):
        if info.get(key) is not None:
            return str(info[key])
    return None


def _looks_like_auth(error: Exception) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return any(word in text for word in ("credential", "accessdenied", "forbidden", "signature"))


class MemoryBackend:
    """A file a server sent whole (``--full-download``): ranges are slices of it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def fetch(self, start: int, stop: int) -> bytes:
        return self.data[start:stop]

    def close(self) -> None:
        self.data = b""


def hf_resolve_url(url: str) -> str:
    """``hf://[datasets/|spaces/]org/repo[@revision]/path`` -> the hub's resolve URL, on
    ``HF_ENDPOINT`` when set (a mirror, a private hub, a test server)."""
    rest = url[len("hf://") :]
    kind = ""
    for prefix in ("datasets/", "spaces/"):
        if rest.startswith(prefix):
            kind, rest = prefix, rest[len(prefix) :]
    pieces = rest.split("/")
    if len(pieces) < 3:
        raise InputError(f"{url}: an hf:// URL is hf://org/repo[@revision]/path/in/repo")
    org, repo, path = pieces[0], pieces[1], "/".join(pieces[2:])
    repo, _, revision = repo.partition("@")
    from urllib.parse import quote

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    return f"{endpoint}/{kind}{org}/{repo}/resolve/{quote(revision or 'main', safe='')}/{path}"


def hf_token() -> str | None:
    """The token the hub's own client would send: ``HF_TOKEN``, else the saved login."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None
