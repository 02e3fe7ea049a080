"""Checkpoints behind URLs, read by byte ranges: the remote side of :mod:`ckpttool.source`.

A :class:`RemoteFile` stands where an open local file stands: the format modules seek and read
it, and :func:`ckpttool.source.read_range` reads spans of it. It fetches only what is asked:

- small reads (a zip's end record and directory, ``data.pkl``, a local header, a safetensors
  header) go through a small cache of aligned blocks; missing neighbouring blocks are fetched
  in one request (coalesced), so the few kilobytes ``show`` needs cost a few round trips;
- large reads (tensor values, ``verify``'s streamed chunks) bypass the cache and are split into
  parts fetched concurrently, at most ``MAX_IN_FLIGHT`` at a time, into one buffer: memory is
  what a local read of the same span takes.

``http(s)://`` and ``hf://`` are read with the standard library's HTTP client (every response
is checked: ``206``, the ``Content-Range`` asked for, the size and ``ETag`` seen at open, the
body's length); every other protocol goes through fsspec (``pip install 'ckpttool[remote]'``),
which finds credentials where each protocol's own tools do. Transient faults (a dropped
connection, a short body, a 5xx, a timeout) are retried ``MAX_TRIES`` times with backoff, then
end in one :class:`~ckpttool.errors.InputError` naming the URL. A file that changes between
requests is refused, never mixed into one read. Nothing is written to disk.
"""

from __future__ import annotations

import http.client
import io
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

from ckpttool.errors import CkptError, InputError
from ckpttool.source import SETTINGS, url_scheme

BLOCK = 16 << 10  # cache granularity: a zip directory or a pickle is read in a few blocks
CACHE_BLOCKS = 64  # 1 MiB of cache: the metadata of the largest files, never their values
SMALL_READ = 256 << 10  # reads up to this go through the cache; larger ones are fetched whole
PART = 2 << 20  # a large read is split into parts of this size, fetched concurrently
MAX_IN_FLIGHT = 4  # requests in flight at once for one file
# A caller that knows what it reads next (convert) may have one range fetched ahead, while it
# writes the current one: up to this size, so the extra memory stays a few MiB.
MAX_PREFETCH = 4 << 20
MAX_TRIES = 4  # attempts per request before a network fault is reported
BACKOFF = 0.25  # seconds before the second attempt, doubled before each further one
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
    """A fault worth another attempt (dropped connection, 5xx, short body, timeout)."""


class ChangedError(InputError):
    """The remote file is not the one opened any more (size or ETag changed)."""


@dataclass
class Totals:
    """Requests made and bytes fetched, over every remote file opened (``--verbose``)."""

    requests: int = 0
    bytes_fetched: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # each file opened (once, if reopened)

    @property
    def files(self) -> int:
        return len(self.sizes)

    @property
    def bytes_total(self) -> int:
        return sum(self.sizes.values())


TOTALS = Totals()
_TOTALS_LOCK = threading.Lock()


def reset_totals() -> None:
    """Start counting afresh (one process may run several commands: the tests do)."""
    with _TOTALS_LOCK:
        TOTALS.requests = TOTALS.bytes_fetched = 0
        TOTALS.sizes.clear()


def display_url(url: str) -> str:
    """``url`` as messages show it: no user:password, no query (a presigned URL's signature)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}" if parts.scheme else url


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
            raise TransientError(f"{type(error).__name__}: {error}") from None
        if got != stop - start or extra:
            self._drop_connection()
            raise TransientError(f"short body ({got:,} of {stop - start:,} bytes)")

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
            raise TransientError(f"short body ({len(data):,} of {stop - start:,} bytes)")
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


# -- the file ---------------------------------------------------------------------------------


class RemoteFile(io.RawIOBase):
    """A remote object opened for reading: ``seek``/``read`` and ``read_range``, by ranges."""

    def __init__(self, url: str, backend: Any) -> None:
        super().__init__()
        self.name = url
        self._backend = backend
        self.requests = 0
        self.bytes_fetched = 0
        size, self.etag, whole = self._retry(backend.stat)
        if whole is not None:
            self._backend = MemoryBackend(whole)
            backend.close()
        self.size = size
        self._position = threading.local()  # seek/read per thread: headers read concurrently
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, int, Future[bytearray]] | None = None
        with _TOTALS_LOCK:
            TOTALS.sizes[url] = size
        self._count(1, 1 if whole is None else size)

    # -- io.RawIOBase ------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def _pos(self) -> int:
        return getattr(self._position, "value", 0)

    @_pos.setter
    def _pos(self, value: int) -> None:
        self._position.value = value

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        position = self._pos
        data = self.read_range(position, len(buffer))
        buffer[: len(data)] = data
        self._pos = position + len(data)
        return len(data)

    def readall(self) -> bytes:
        position = self._pos
        data = self.read_range(position, max(0, self.size - position))
        self._pos = position + len(data)
        return bytes(data)

    def map_concurrently(self, function: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``function`` over ``items`` on this file's request threads (``seek``/``read`` keep a
        position per thread): many small reads, e.g. every storage's local header, in
        ``MAX_IN_FLIGHT`` streams instead of one."""
        with ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="ckpttool-map") as pool:
            return list(pool.map(function, items))

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{display_url(self.name)} is remote: it has no descriptor")

    def close(self) -> None:
        if not self.closed:
            if self._ahead_pool is not None:
                self._ahead_pool.shutdown(wait=True)
            self._ahead = None
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._backend.close()
            self._cache.clear()
        super().close()

    # -- ranges ------------------------------------------------------------------------------
    def read_range(self, offset: int, length: int) -> bytearray:
        """``length`` bytes at ``offset``, fewer only at the end of the file."""
        stop = min(self.size, offset + max(length, 0))
        if stop <= offset:
            return bytearray()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (offset, stop):
            return ahead[2].result()
        if stop - offset <= SMALL_READ:
            return self._cached(offset, stop)
        return self._parallel(offset, stop)

    def _cached(self, offset: int, stop: int) -> bytearray:
        first, last = offset // BLOCK, (stop - 1) // BLOCK
        with self._lock:
            blocks = {i: self._cache[i] for i in range(first, last + 1) if i in self._cache}
        missing = [i for i in range(first, last + 1) if i not in blocks]
        runs: list[tuple[int, int]] = []  # consecutive missing blocks: one request each
        for index in missing:
            if runs and runs[-1][1] == index:
                runs[-1] = (runs[-1][0], index + 1)
            else:
                runs.append((index, index + 1))
        for begin, end in runs:
            data = self._fetch(begin * BLOCK, min(self.size, end * BLOCK))
            for index in range(begin, end):
                blocks[index] = data[(index - begin) * BLOCK : (index - begin + 1) * BLOCK]
        with self._lock:
            for index, block in blocks.items():
                self._cache[index] = block
                self._cache.move_to_end(index)
            while len(self._cache) > CACHE_BLOCKS:
                self._cache.popitem(last=False)
        joined = b"".join(blocks[i] for i in range(first, last + 1))
        return bytearray(joined[offset - first * BLOCK : stop - first * BLOCK])

    def prefetch(self, offset: int, length: int) -> None:
        """Start fetching ``[offset, offset + length)``, which the next :meth:`read_range` will
        ask for (one range at a time; a larger one or a cached one is left alone)."""
        stop = min(self.size, offset + length)
        if not SMALL_READ < stop - offset <= MAX_PREFETCH:
            return
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-ahead")
        self._ahead = (offset, stop, self._ahead_pool.submit(self._parallel, offset, stop))

    def _parallel(self, offset: int, stop: int) -> bytearray:
        out = bytearray(stop - offset)
        view = memoryview(out)
        parts = [(start, min(stop, start + PART)) for start in range(offset, stop, PART)]

        def fill(part: tuple[int, int]) -> None:
            start, end = part
            target = view[start - offset : end - offset]
            fetch_into = getattr(self._backend, "fetch_into", None)
            if fetch_into is None:
                target[:] = self._fetch(start, end)
                return
            self._retry(lambda: fetch_into(start, end, target))
            self._count(1, end - start)

        if len(parts) == 1:
            fill(parts[0])
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="ckpttool-get")
            # map keeps at most MAX_IN_FLIGHT requests running; the first error is raised
            # after the others finish, so no thread writes into a buffer being discarded
            futures = [self._pool.submit(fill, part) for part in parts]
            errors = [f.exception() for f in futures]
            view.release()
            for error in errors:
                if error is not None:
                    raise error
            return out
        view.release()
        return out

    def _fetch(self, start: int, stop: int) -> bytes:
        data: bytes = self._retry(lambda: self._backend.fetch(start, stop))
        self._count(1, len(data))
        return data

    def _retry(self, request: Callable[[], Any]) -> Any:
        for attempt in range(MAX_TRIES):
            try:
                return request()
            except TransientError as error:
                if attempt == MAX_TRIES - 1:
                    raise InputError(
                        f"{display_url(self.name)}: network error after {MAX_TRIES} attempts "
                        f"({error})"
                    ) from None
                self._count(1, 0)
                time.sleep(BACKOFF * (2**attempt))
        raise AssertionError("unreachable")

    def _count(self, requests: int, nbytes: int) -> None:
        with _TOTALS_LOCK:
            self.requests += requests
            self.bytes_fetched += nbytes
            TOTALS.requests += requests
            TOTALS.bytes_fetched += nbytes

    def check_unchanged(self) -> None:
        """Raise :class:`ChangedError` if the object's size or ETag is not what was opened
        (for protocols whose ranged reads do not carry the check themselves)."""
        identity = getattr(self._backend, "identity", None)
        if identity is None:
            return
        size, etag = self._retry(identity)
        self._count(1, 0)
        if size != self.size or etag != self.etag:
            raise ChangedError(
                f"{display_url(self.name)}: the file changed while it was being read; run again"
            )


# -- opening ----------------------------------------------------------------------------------


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


def open_remote(url: str) -> RemoteFile:
    """Open ``url`` for ranged reads. Raises :class:`~ckpttool.errors.InputError` naming it."""
    scheme = url_scheme(url)
    try:
        if scheme in ("http", "https"):
            return RemoteFile(url, HttpBackend(url))
        if scheme == "hf":
            token = hf_token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return RemoteFile(url, HttpBackend(hf_resolve_url(url), headers))
        return RemoteFile(url, FsspecBackend(url))
    except CkptError as error:
        where = display_url(url)
        if where not in str(error):
            error.args = (f"{where}: {error}",)
        raise


def totals_line() -> str:
    """``remote: 3 requests, 68,203 bytes fetched of 1,436,000,123 (0.005 %)`` (``--verbose``)."""
    share = 100 * TOTALS.bytes_fetched / TOTALS.bytes_total if TOTALS.bytes_total else 0.0
    return (
        f"remote: {TOTALS.requests:,} requests, {TOTALS.bytes_fetched:,} bytes fetched of "
        f"{TOTALS.bytes_total:,} ({share:.3f} %)"
    )


# -- directories (DCP) ------------------------------------------------------------------------


def is_directory(url: str) -> bool:
    """Whether ``url`` names a directory: one ending in ``/`` (HTTP cannot say otherwise), or
    one the store lists as a directory (prefix)."""
    if url.endswith("/"):
        return True
    if url_scheme(url) in ("http", "https", "hf"):
        return False
    backend = FsspecBackend(url)
    try:
        return bool(backend._call(lambda: backend.fs.isdir(backend.path)))
    except TransientError as error:
        raise InputError(f"{display_url(url)}: network error ({error})") from None


def member_sizes(directory: str, names: list[str]) -> dict[str, int]:
    """Sizes of the members of a remote directory that exist: one listing where the store can
    list, else one ranged request per file."""
    if url_scheme(directory) not in ("http", "https", "hf"):
        listed = _listing(directory)
        return {name: listed[name] for name in names if name in listed}
    sizes = {}
    for name in names:
        try:
            with open_remote(directory.rstrip("/") + "/" + name) as member:
                sizes[name] = member.size
        except InputError as error:
            if "no such file" not in str(error):
                raise
    return sizes


def list_names(directory: str) -> list[str]:
    """The files directly in a remote directory ([] over HTTP, which cannot list)."""
    if url_scheme(directory) in ("http", "https", "hf"):
        return []
    return sorted(_listing(directory))


def _listing(directory: str) -> dict[str, int]:
    backend = FsspecBackend(directory.rstrip("/"))
    try:
        entries = backend._call(lambda: backend.fs.ls(backend.path, detail=True))
    except TransientError as error:
        raise InputError(f"{display_url(directory)}: network error ({error})") from None
    return {
        str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
        for entry in entries
        if entry.get("type") == "file"
    }


def member_listing(directory: str) -> dict[str, int]:
    """The files directly in a remote directory, by name, with sizes ({} over HTTP)."""
    if url_scheme(directory) in ("http", "https", "hf"):
        return {}
    return dict(sorted(_listing(directory).items()))
