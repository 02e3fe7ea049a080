"""Checkpoints behind URLs, read by byte ranges: the remote side of :mod:`ckpttool.io.source`.

A :class:`RemoteFile` stands where an open local file stands: the format modules seek and read
it, and :func:`ckpttool.io.source.read_range` reads spans of it. It fetches only what is asked:

- small reads (a zip's end record and directory, ``data.pkl``, a local header, a safetensors
  header) go through a small cache of aligned blocks; missing neighbouring blocks are fetched
  in one request (coalesced), so the few kilobytes ``show`` needs cost a few round trips;
- large reads (tensor values, ``verify``'s streamed chunks) bypass the cache and are split into
  parts fetched concurrently, at most ``MAX_IN_FLIGHT`` at a time, into one buffer: memory is
  what a local read of the same span takes.

``http(s)://`` and ``hf://`` are read with the standard library's HTTP client (every response
is checked: ``206``, the ``Content-Range`` asked for, the size and ``ETag`` seen at open, the
body's length); every other protocol goes through fsspec (``pip install 'ckpttool[remote]'``),
which finds credentials where each protocol's own tools do. The requests themselves are made in
:mod:`ckpttool.io.remote_backends`. Transient faults (a dropped
connection, a short body, a 5xx, a timeout) are retried ``MAX_TRIES`` times with backoff, then
end in one :class:`~ckpttool.errors.InputError` naming the URL. A file that changes between
requests is refused, never mixed into one read. Nothing is written to disk.
"""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import ChangedError, CkptError, EmptyFileError, InputError
from ckpttool.io.remote_backends import TransientError
from ckpttool.io.urls import display_url, url_scheme

BLOCK = 16 << 10  # cache granularity: a zip directory or a pickle is read in a few blocks
CACHE_BLOCKS = 64  # 1 MiB of cache: the metadata of the largest files, never their values
SMALL_READ = 256 << 10  # reads up to this go through the cache; larger ones are fetched whole
PART = 2 << 20  # a large read is split into parts of this size, fetched concurrently
MAX_IN_FLIGHT = 4  # requests in flight at once for one file
# A caller that knows what it reads next (convert) may have one range fetched ahead, while it
# writes the current one: up to this size, so the extra memory stays a few MiB.
MAX_PREFETCH = 4 << 20
# A planned read (RemoteFile.plan: the regions of the records a command will read, in order)
# is fetched in windows of up to this size, one ahead of the reader; fetched windows are kept
# up to PLAN_KEPT bytes (a reader locates records' headers a little ahead of their data: up
# to 8 MiB, ckpttool.io.read_batch.LOOKAHEAD_BYTES), and never those from the window of the
# read before on.
WINDOW = 8 << 20
PLAN_KEPT = 40 << 20
PLAN_GAP = 64 << 10  # planned regions this close are fetched as one (the gap bytes too)
MAX_TRIES = 4  # attempts per request before a network fault is reported
BACKOFF = 0.25  # seconds before the second attempt, doubled before each further one


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
            from ckpttool.io.remote_backends import MemoryBackend

            self._backend = MemoryBackend(whole)
            backend.close()
        self.size = size
        self._position = threading.local()  # seek/read per thread: headers read concurrently
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, int, Future[bytearray]] | None = None
        self._plan: list[tuple[int, int]] = []  # windows to fetch, in the order of reading
        self._windows: dict[int, Future[bytearray]] = {}  # window index -> its bytes
        self._order: list[int] = []  # the windows' indexes by offset,
        self._starts: list[int] = []  # and their offsets, for finding a read's window
        self._previous = 0  # the window the last planned read began in
        self._dropped: set[int] = set()  # windows dropped for memory (not fetched again)
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
        pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="ckpttool-map")
        try:
            return list(pool.map(function, items))
        finally:  # after an error or Ctrl-C, the items not started are dropped, not run
            pool.shutdown(wait=True, cancel_futures=True)

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{display_url(self.name)} is remote: it has no descriptor")

    def close(self) -> None:
        if not self.closed:
            # parts not started are dropped (a read stopped by Ctrl-C or an error does not
            # fetch the rest of a tensor first); the requests in flight end before the backend
            if self._ahead_pool is not None:
                self._ahead_pool.shutdown(wait=True, cancel_futures=True)
            self._ahead = None
            self._windows.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
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
        if self._plan:
            planned = self._planned(offset, stop)
            if planned is not None:
                return planned
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

    def plan(self, regions: list[tuple[int, int]]) -> None:
        """A hint: the bytes of these ``(offset, length)`` regions will be read, in this order
        (by any number of reads inside them, headers before data). Neighbouring regions are
        joined into windows of up to :data:`WINDOW` bytes; each window is fetched once (its
        parts concurrently, the next window while the current one is read), and a read that
        lies in fetched windows is answered from them. Bytes already in the block cache are
        taken from it, not fetched again. A new plan replaces the previous one."""
        windows: list[tuple[int, int]] = []
        for offset, length in regions:
            start, stop = max(0, offset), min(self.size, offset + length)
            if stop <= start:
                continue
            if windows:
                first, last = windows[-1]
                if first <= start <= last + PLAN_GAP and max(stop, last) - first <= WINDOW:
                    windows[-1] = (first, max(stop, last))
                    continue
            # a region larger than a window (a large tensor) is fetched in windows
            windows.extend((at, min(stop, at + WINDOW)) for at in range(start, stop, WINDOW))
        order = sorted(range(len(windows)), key=lambda number: windows[number])
        with self._lock:
            self._plan, self._windows, self._previous = windows, {}, 0
            self._dropped = set()
            self._order, self._starts = order, [windows[number][0] for number in order]

    def _planned(self, offset: int, stop: int) -> bytearray | None:
        """``[offset, stop)`` from the plan's windows, fetching them as needed (None: not all
        of it is planned)."""
        import bisect

        plan, order, starts = self._plan, self._order, self._starts
        position = bisect.bisect_right(starts, offset) - 1
        if position < 0 or plan[order[position]][1] <= offset:
            return None
        numbers = [order[position]]
        while plan[numbers[-1]][1] < stop:  # a read across windows: they must join up
            position += 1
            if position == len(order) or starts[position] != plan[numbers[-1]][1]:
                return None
            numbers.append(order[position])
        if self._dropped.intersection(numbers):  # read again after it was dropped: only
            return None  # what is asked is fetched, not the whole window again
        pieces = []
        for number in numbers:
            begin, end = plan[number]
            data = self._window(number).result()
            pieces.append(memoryview(data)[max(offset, begin) - begin : min(stop, end) - begin])
        self._window(numbers[-1] + 1)  # the next one arrives while this one is read
        # a reader may look a little ahead (the next record's header) before it reads on from
        # the window it read last: that one, and those after it, are kept
        previous, self._previous = self._previous, numbers[0]
        self._keep_within(min(numbers[0], previous))
        return bytearray().join(pieces) if len(pieces) > 1 else bytearray(pieces[0])

    def _window(self, number: int) -> Future[bytearray]:
        """Window ``number`` of the plan: fetched (or being fetched) once."""
        with self._lock:
            if number >= len(self._plan):
                done: Future[bytearray] = Future()
                done.set_result(bytearray())
                return done
            found = self._windows.get(number)
            if found is None:
                if self._ahead_pool is None:
                    self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-ahead")
                found = self._windows[number] = self._ahead_pool.submit(
                    self._uncached, *self._plan[number]
                )
            return found

    def _keep_within(self, current: int) -> None:
        """Drop the oldest windows before ``current`` while more than :data:`PLAN_KEPT` bytes
        are kept."""
        with self._lock:
            kept = sorted(self._windows)
            total = sum(self._plan[n][1] - self._plan[n][0] for n in kept)
            for number in kept:
                if total <= PLAN_KEPT or current <= number:
                    break
                total -= self._plan[number][1] - self._plan[number][0]
                del self._windows[number]
                self._dropped.add(number)

    def _uncached(self, offset: int, stop: int) -> bytearray:
        """``[offset, stop)``: the parts in the block cache copied from it, the rest fetched
        (each missing run in concurrent parts)."""
        out = bytearray(stop - offset)
        first, last = offset // BLOCK, (stop - 1) // BLOCK
        with self._lock:
            cached = {i: self._cache[i] for i in range(first, last + 1) if i in self._cache}
        missing: list[tuple[int, int]] = []
        for index in range(first, last + 1):
            begin, end = max(offset, index * BLOCK), min(stop, (index + 1) * BLOCK)
            block = cached.get(index)
            if block is not None and len(block) >= end - index * BLOCK:
                out[begin - offset : end - offset] = block[
                    begin - index * BLOCK : end - index * BLOCK
                ]
            elif missing and missing[-1][1] == begin:
                missing[-1] = (missing[-1][0], end)
            else:
                missing.append((begin, end))
        for begin, end in missing:
            out[begin - offset : end - offset] = self._parallel(begin, end)
        return out

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
        """``request()``, retried on :class:`TransientError`. The caller counts the attempt
        that succeeds; each failed one is counted here, with the bytes it received, so the
        counts are what crossed the network (what the server sent and the client read)."""
        for attempt in range(MAX_TRIES):
            try:
                return request()
            except TransientError as error:
                self._count(1, error.received)
                if attempt == MAX_TRIES - 1:
                    raise InputError(
                        f"{display_url(self.name)}: network error after {MAX_TRIES} attempts "
                        f"({error})"
                    ) from None
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


def open_remote(url: str) -> RemoteFile:
    """Open ``url`` for ranged reads. Raises :class:`~ckpttool.errors.InputError` naming it."""
    from ckpttool.io.remote_backends import FsspecBackend, HttpBackend, hf_resolve_url, hf_token

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
        f"remote: {TOTALS.requests:,} request{'s' * (TOTALS.requests != 1)}, "
        f"{TOTALS.bytes_fetched:,} bytes fetched of "
        f"{TOTALS.bytes_total:,} ({share:.3f} %)"
    )


# -- directories (DCP, framework layouts) ------------------------------------------------------------------------


def is_directory(url: str) -> bool:
    """Whether ``url`` names a directory: one ending in ``/`` (HTTP cannot say otherwise), or
    one the store lists as a directory (prefix)."""
    from ckpttool.io.remote_backends import FsspecBackend

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


def list_directories(directory: str) -> list[str]:
    """The subdirectories (prefixes) directly in a remote directory ([] over HTTP)."""
    if url_scheme(directory) in ("http", "https", "hf"):
        return []
    return sorted(
        str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        for entry in _entries(directory)
        if entry.get("type") == "directory"
    )


def _entries(directory: str) -> list[dict[str, Any]]:
    from ckpttool.io.remote_backends import FsspecBackend

    backend = FsspecBackend(directory.rstrip("/"))
    try:
        return list(backend._call(lambda: backend.fs.ls(backend.path, detail=True)))
    except TransientError as error:
        raise InputError(f"{display_url(directory)}: network error ({error})") from None


def _listing(directory: str) -> dict[str, int]:
    return {
        str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
        for entry in _entries(directory)
        if entry.get("type") == "file"
    }


def member_listing(directory: str) -> dict[str, int]:
    """The files directly in a remote directory, by name, with sizes ({} over HTTP)."""
    if url_scheme(directory) in ("http", "https", "hf"):
        return {}
    return dict(sorted(_listing(directory).items()))


# -- the Location of a URL ---------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteSource:
    """A URL: the :class:`~ckpttool.io.source.Location` read by ranged requests (and listed,
    where its store can list). Errors are :class:`~ckpttool.errors.CkptError` s naming it."""

    name: str

    def shown(self) -> str:
        return display_url(self.name)

    def open(self) -> RemoteFile:
        handle = open_remote(self.name)
        if handle.size == 0:
            handle.close()
            raise EmptyFileError(f"{self.shown()}: the file is empty (an interrupted save?)")
        return handle

    def is_dir(self) -> bool:
        return is_directory(self.name)

    def is_file(self) -> bool:
        return not self.is_dir()

    def read_small(self, limit: int) -> bytes:
        with self.open() as handle:
            if handle.size > limit:
                raise ValueError(f"{handle.size} bytes of JSON, more than any index needs")
            return bytes(handle.read())

    def read_head(self, limit: int) -> bytes:
        with open_remote(self.name) as handle:
            return bytes(handle.read_range(0, limit))

    def join(self, member: str) -> str:
        return self.name.rstrip("/") + "/" + member

    def member_sizes(self, names: list[str]) -> dict[str, int]:
        return member_sizes(self.name, names)

    def can_list(self) -> bool:
        return url_scheme(self.name) not in ("http", "https", "hf")

    def list_names(self) -> list[str]:
        return list_names(self.name)

    def list_dirs(self) -> list[str]:
        return list_directories(self.name)

    def open_member(self, member: str) -> RemoteFile:
        return open_remote(self.join(member))
