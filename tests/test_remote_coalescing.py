"""Reading the values of a URL in few large requests, each byte once (issue 33).

A file of 2,000 small tensors was read with about one request per tensor and twice its bytes:
each record's zip local header was fetched in a 16 KiB cache block, and its data again by the
read of its values. The records a command reads are now planned (``Checkpoint.plan_reads``,
``RemoteFile.plan``): the regions that hold them are fetched in windows, once. Each count is
the loopback server's own, and each report is compared with the same command on the local file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.support.range_server import RangeServer

TENSORS = 2000


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def server() -> Iterator[RangeServer]:
    started = RangeServer().start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two torch files of 2,000 tensors of 1 KiB (a cache block holds about 14 records), the
    second with one tensor changed."""
    directory = tmp_path_factory.mktemp("many")
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(256, generator=generator) for i in range(TENSORS)}
    torch.save(state, directory / "a.pth")
    state["layers.5.weight"] = state["layers.5.weight"] + 1
    torch.save(state, directory / "b.pth")
    return directory / "a.pth", directory / "b.pth"


def _report(result: Result, *paths: str) -> dict[str, Any]:
    text = result.stdout
    for number, path in enumerate(paths):
        text = text.replace(path, f"<{number}>")
    report: dict[str, Any] = json.loads(text)
    return report


def _requests_and_bytes(server: RangeServer) -> tuple[int, int]:
    return len(server.requests), server.bytes_sent


def test_verify_fetches_each_byte_once_in_few_requests(
    server: RangeServer, many: tuple[Path, Path]
) -> None:
    local = many[0]
    url = server.add("a.pth", local.read_bytes())
    remote_result = run("verify", url, "--json")
    requests, sent = _requests_and_bytes(server)
    assert remote_result.exit_code == 0, remote_result.output
    size = local.stat().st_size
    assert size <= sent <= 1.05 * size
    assert requests <= 20  # against about 2,000 before the plan
    local_result = run("verify", local, "--json")
    assert _report(remote_result, url) == _report(local_result, str(local))


def test_diff_fetches_each_byte_once_in_few_requests(
    server: RangeServer, many: tuple[Path, Path]
) -> None:
    url_a = server.add("a.pth", many[0].read_bytes())
    url_b = server.add("b.pth", many[1].read_bytes())
    remote_result = run("diff", url_a, url_b, "--json")
    requests, sent = _requests_and_bytes(server)
    assert remote_result.exit_code == 1, remote_result.output
    size = many[0].stat().st_size + many[1].stat().st_size
    assert size <= sent <= 1.05 * size
    assert requests <= 40
    local_result = run("diff", *many, "--json")
    assert _report(remote_result, url_a, url_b) == _report(local_result, *map(str, many))


def test_show_stats_fetches_each_byte_once_in_few_requests(
    server: RangeServer, many: tuple[Path, Path]
) -> None:
    local = many[0]
    url = server.add("a.pth", local.read_bytes())
    remote_result = run("show", url, "--stats", "--json")
    requests, sent = _requests_and_bytes(server)
    assert remote_result.exit_code == 0, remote_result.output
    assert sent <= 1.05 * local.stat().st_size
    assert requests <= 20
    assert _report(remote_result, url) == _report(
        run("show", local, "--stats", "--json"), str(local)
    )


def test_convert_fetches_each_byte_once_in_few_requests(
    server: RangeServer, many: tuple[Path, Path], tmp_path: Path
) -> None:
    local = many[0]
    url = server.add("a.pth", local.read_bytes())
    out, expected = tmp_path / "url.safetensors", tmp_path / "local.safetensors"
    converted = run("convert", url, out)
    requests, sent = _requests_and_bytes(server)
    assert converted.exit_code == 0, converted.output
    assert sent <= 1.05 * local.stat().st_size
    assert requests <= 20
    assert run("convert", local, expected).exit_code == 0
    assert out.read_bytes() == expected.read_bytes()


class CountingBackend:
    """A file in memory that records the ranges fetched from it."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.fetched: list[tuple[int, int]] = []

    def stat(self) -> tuple[int, str, None]:
        return len(self.data), "etag", None

    def fetch(self, start: int, stop: int) -> bytes:
        self.fetched.append((start, stop))
        return self.data[start:stop]

    def close(self) -> None:
        pass


def test_planned_reads_are_the_file_s_bytes_each_fetched_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reads inside one window, across two, in an order other than the plan's, and outside
    the plan (the old path) all give the file's bytes; no planned byte is fetched twice, even
    with windows dropped for memory (the reads move forward)."""
    from ckpttool.io import remote

    monkeypatch.setattr(remote, "WINDOW", 1000)
    monkeypatch.setattr(remote, "PLAN_KEPT", 2000)
    monkeypatch.setattr(remote, "PLAN_GAP", 10)
    data = bytes(range(256)) * 256  # 64 KiB: the read outside the plan is in a block of its own
    backend = CountingBackend(data)
    handle = remote.RemoteFile("memory://file", backend)
    try:
        regions = [(100, 300), (400, 500), (5000, 2500), (9000, 100), (2000, 50)]
        handle.plan(regions)
        reads = [(100, 10), (150, 250), (400, 100), (5000, 1500), (6400, 1100), (9000, 100)]
        reads += [(2000, 50), (40000, 10)]
        for offset, length in reads:
            assert handle.read_range(offset, length) == data[offset : offset + length]
        fetched = [0] * len(data)
        for start, stop in backend.fetched:
            for at in range(start, stop):
                fetched[at] += 1
        planned = {at for offset, length in regions for at in range(offset, offset + length)}
        assert all(fetched[at] == 1 for at in planned), backend.fetched
        assert (
            sum(fetched) <= len(planned) + 10 * 3 + remote.BLOCK
        )  # gaps, and the one read outside
    finally:
        handle.close()


def test_a_header_read_ahead_of_a_large_record_does_not_drop_its_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``verify``'s order: the next record's local header is read before this record's data.
    A record larger than a window is fetched in windows; the look ahead must not make the
    windows of the record about to be read be dropped (and fetched again)."""
    from ckpttool.io import remote

    monkeypatch.setattr(remote, "WINDOW", 1000)
    monkeypatch.setattr(remote, "PLAN_KEPT", 1500)
    data = bytes(range(256)) * 64
    backend = CountingBackend(data)
    handle = remote.RemoteFile("memory://file", backend)
    try:
        handle.plan([(0, 3000), (3000, 1000), (4000, 1000)])
        reads = [(0, 30), (3000, 30)]  # this record's header, then the next one's
        reads += [(at, min(800, 3000 - at)) for at in range(30, 3000, 800)]  # this record
        reads += [(3030, 970), (4000, 1000)]
        for offset, length in reads:
            assert handle.read_range(offset, length) == data[offset : offset + length]
        fetched = [0] * 5000
        for start, stop in backend.fetched:
            for at in range(start, stop):
                fetched[at] += 1
        assert fetched == [1] * 5000, backend.fetched
        assert all(stop - start <= 1000 for start, stop in backend.fetched)  # windows, not 3000
    finally:
        handle.close()


def test_a_read_in_a_dropped_window_fetches_only_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A window dropped for memory and read again (a pair diff compares once more) costs the
    read's own bytes (through the cache), not the whole window again."""
    from ckpttool.io import remote

    monkeypatch.setattr(remote, "WINDOW", 1000)
    monkeypatch.setattr(remote, "PLAN_KEPT", 1500)
    monkeypatch.setattr(remote, "BLOCK", 64)
    data = bytes(range(256)) * 64
    backend = CountingBackend(data)
    handle = remote.RemoteFile("memory://file", backend)
    try:
        handle.plan([(0, 1000), (1000, 1000), (2000, 1000), (3000, 1000)])
        for offset in (0, 1000, 2000, 3000):
            assert handle.read_range(offset, 1000) == data[offset : offset + 1000]
        assert 0 not in handle._windows  # dropped
        backend.fetched.clear()
        assert handle.read_range(10, 20) == data[10:30]
        assert sum(stop - start for start, stop in backend.fetched) <= 64
    finally:
        handle.close()
