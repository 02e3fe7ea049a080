"""A real HTTP server on the loopback address for the remote tests and the benchmark.

It serves files (bytes in memory, or paths on disk) by ``GET``, honouring ``Range`` (one
range, ``206`` with ``Content-Range``), ``If-Match`` against the file's ``ETag`` (``412``), and
redirects, and records every request. Faults are scripted per test: a queue of what the next
ranged requests get (``"close"``: the connection is dropped mid-body; ``"500"``; ``"short"``:
the body stops early and the connection closes; ``"stall"``: nothing is sent until the client
gives up and hangs up, a request it cancels), ``honour_range = False`` for a server that always
sends the whole file, ``replace()`` to swap a file's bytes (and ETag) between requests,
``require_token`` for a server that wants a bearer token, and ``hold`` to keep requests
waiting, for as long as a test wants, once a condition holds (a command stopped mid-read).

``bytes_sent`` counts every body byte written, those of the faults' cut bodies too, and is read
once no request is being answered: a handler counts a write after it returns, by which time the
client may have read the bytes, finished, and been compared with the count.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.timeouts import expired, scaled

CHUNK = 1 << 20


@dataclass
class Served:
    data: bytes | None  # in memory, or
    path: Path | None  # read from disk (the benchmark's 1.4 GB file)
    etag: str

    @property
    def size(self) -> int:
        if self.data is not None:
            return len(self.data)
        assert self.path is not None
        return self.path.stat().st_size

    def read(self, start: int, stop: int) -> bytes:
        if self.data is not None:
            return self.data[start:stop]
        assert self.path is not None
        with open(self.path, "rb") as handle:
            handle.seek(start)
            return handle.read(stop - start)


@dataclass
class RangeServer:
    files: dict[str, Served] = field(default_factory=dict)
    honour_range: bool = True
    faults: deque[str] = field(default_factory=deque)
    redirects: dict[str, str] = field(default_factory=dict)
    require_token: str | None = None
    # (path, first byte, end) -> whether to keep this ranged request waiting until `release`
    hold: Callable[[str, int, int], bool] | None = None
    holding: threading.Event = field(default_factory=threading.Event)  # a request is held
    release: threading.Event = field(default_factory=threading.Event)
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range)
    _sent: int = 0
    _in_flight: int = 0
    _idle: threading.Condition = field(default_factory=threading.Condition)

    @property
    def bytes_sent(self) -> int:
        """Body bytes written, once every request received has been answered."""
        with self._idle:
            bound = scaled(60)
            if not self._idle.wait_for(lambda: self._in_flight == 0, bound):
                raise AssertionError(expired("the server's answers", bound))
            return self._sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        with self._idle:
            self._sent = value

    def _count(self, nbytes: int) -> None:
        with self._idle:
            self._sent += nbytes

    def add(self, name: str, data: bytes) -> str:
        self.files["/" + name] = Served(data, None, _etag(data))
        return self.url(name)

    def add_path(self, name: str, path: Path) -> str:
        stat = path.stat()
        self.files["/" + name] = Served(None, path, f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"')
        return self.url(name)

    def replace(self, name: str, data: bytes) -> None:
        self.files["/" + name] = Served(data, None, _etag(data))

    def url(self, name: str) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/{name}"

    def start(self) -> RangeServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out in two writes: without this, Nagle's algorithm holds
            # the body of a small response until the client's delayed ACK (40 ms)
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with server._idle:
                    server._in_flight += 1
                try:
                    self._answer()
                finally:
                    with server._idle:
                        server._in_flight -= 1
                        server._idle.notify_all()

            def _answer(self) -> None:
                server.requests.append((self.path, self.headers.get("Range")))
                if self.path in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                token = server.require_token
                if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                    self._empty(401)
                    return
                served = server.files.get(self.path.split("?", 1)[0])
                if served is None:
                    self._empty(404)
                    return
                size = served.size
                wanted = self.headers.get("Range")
                if not server.honour_range or wanted is None:
                    self._send(200, served, 0, size, size)
                    return
                if_match = self.headers.get("If-Match")
                if if_match is not None and if_match != served.etag:
                    self._empty(412)
                    return
                first_text, _, last_text = wanted.removeprefix("bytes=").partition("-")
                start, stop = int(first_text), min(size, int(last_text) + 1)
                if start >= size:
                    self._empty(416)
                    return
                if server.hold is not None and server.hold(self.path, start, stop):
                    server.holding.set()
                    server.release.wait(scaled(120))
                fault = server.faults.popleft() if server.faults else None
                if fault == "500":
                    self._empty(500)
                    return
                if fault == "stall":
                    self._wait_for_hang_up()
                    return
                self._send(206, served, start, stop, size, fault)

            def _wait_for_hang_up(self) -> None:
                """Answer nothing until the client closes the connection (its timeout)."""
                self.close_connection = True
                self.connection.settimeout(scaled(120))
                try:
                    while self.connection.recv(1 << 16):
                        pass
                except OSError:  # the client hung up hard, or never did (the bound)
                    pass

            def _empty(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _send(
                self, status: int, served: Served, start: int, stop: int, size: int,
                fault: str | None = None,
            ) -> None:  # fmt: skip
                self.send_response(status)
                self.send_header("Content-Length", str(stop - start))
                self.send_header("ETag", served.etag)
                self.send_header("Accept-Ranges", "bytes" if server.honour_range else "none")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
                self.end_headers()
                if fault in ("close", "short"):
                    cut = start + max(1, (stop - start) // 2) if fault == "close" else stop - 1
                    self.wfile.write(served.read(start, cut))
                    self.wfile.flush()
                    server._count(cut - start)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                try:
                    for at in range(start, stop, CHUNK):
                        piece = served.read(at, min(stop, at + CHUNK))
                        self.wfile.write(piece)
                        server._count(len(piece))
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that hung up on purpose (the tests' faults), not news

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
