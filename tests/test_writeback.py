"""Large writes ask the kernel to start writing them to the disk at once
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the fsync which commits a file has less
to wait for (bench/README.md, issue 43). A hint only: the bytes written are the same, and the
fsync is still what makes them durable."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpttool.io import blocks


class Asked:
    """Records the ranges the kernel is asked to write back."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int, int]] = []

    def __call__(self, fd: int, offset: int, length: int, flags: int) -> int:
        self.ranges.append((fd, offset, length, flags))
        return 0


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Asked:
    recorder = Asked()
    monkeypatch.setattr(blocks, "_sync_file_range", recorder)
    return recorder


def test_a_large_write_is_handed_to_the_disk_as_it_is_written(tmp_path: Path, asked: Asked) -> None:
    small, large = b"h" * 100, os.urandom(blocks._WRITEBACK_MIN + 5)
    view = memoryview(bytearray(os.urandom(blocks._WRITEBACK_MIN))).cast("I")  # nbytes, not len
    with open(tmp_path / "out", "wb") as handle:
        blocks.write_data(handle, small)
        blocks.write_data(handle, large)
        blocks.write_data(handle, view)
        fd = handle.fileno()
    assert asked.ranges == [
        (fd, 100, len(large), 2),
        (fd, 100 + len(large), view.nbytes, 2),
    ]
    assert (tmp_path / "out").read_bytes() == small + large + view.tobytes()


def test_a_kernel_copy_is_handed_to_the_disk_chunk_by_chunk(
    tmp_path: Path, asked: Asked, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "_COPY_CHUNK", 1 << 20)
    data = os.urandom((5 << 20) // 2)
    (tmp_path / "src").write_bytes(b"x" * 7 + data)
    with open(tmp_path / "src", "rb") as source, open(tmp_path / "dst", "wb") as dest:
        dest.write(b"y" * 3)
        dest.flush()
        blocks.write_data(dest, blocks.FileRange(source.fileno(), 7, len(data)))
        fd = dest.fileno()
    if not hasattr(os, "copy_file_range"):
        pytest.fail("this test needs os.copy_file_range (Linux)")
    assert [(at, length) for _, at, length, _ in asked.ranges] == [
        (3, 1 << 20), (3 + (1 << 20), 1 << 20), (3 + (2 << 20), len(data) - (2 << 20))
    ]  # fmt: skip
    assert {(f, flags) for f, _, _, flags in asked.ranges} == {(fd, 2)}
    assert (tmp_path / "dst").read_bytes() == b"y" * 3 + data


def test_the_kernel_takes_the_hint_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On Linux the libc function is found and accepts the call (no error is ignored here)."""
    monkeypatch.setattr(blocks, "_sync_file_range", None)
    path = tmp_path / "out"
    with open(path, "wb") as handle:
        handle.write(b"z" * 8192)
        handle.flush()
        blocks.start_writeback(handle.fileno(), 0, 8192)
        function: Any = blocks._sync_file_range
        if sys.platform.startswith("linux"):
            assert function, "sync_file_range was not found in libc"
            assert function(handle.fileno(), 0, 8192, 2) == 0
        else:
            assert function is False
    assert path.read_bytes() == b"z" * 8192
