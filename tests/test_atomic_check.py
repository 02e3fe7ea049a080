"""atomic_group's ``check`` runs while the temp files are fsynced on a second thread: both end
before anything is renamed, and an error from either leaves every target as it was."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ckpttool.io import atomic


def _write(target: Path, check: object, payload: bytes = b"new") -> None:
    with atomic.atomic_group([target], check=check) as (handle,):  # type: ignore[arg-type]
        handle.write(payload)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(atomic.TMP_SUFFIX))


def test_check_sees_the_complete_temp_while_it_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    syncing = threading.Event()
    release = threading.Event()
    real_fsync = os.fsync
    seen: list[bytes] = []

    def slow_fsync(fd: int) -> None:
        syncing.set()
        assert release.wait(10)
        real_fsync(fd)

    def check(temps: list[Path]) -> None:
        assert syncing.wait(10)  # the fsync has started and not returned
        seen.append(temps[0].read_bytes())
        assert target.read_bytes() == b"old"  # nothing renamed yet
        release.set()

    monkeypatch.setattr(atomic.os, "fsync", slow_fsync)
    _write(target, check)
    assert seen == [b"new"]
    assert target.read_bytes() == b"new"
    assert _leftovers(tmp_path) == []


def test_a_failed_fsync_leaves_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    checked: list[Path] = []

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(atomic.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output"):
        _write(target, checked.extend)
    assert len(checked) == 1  # the check ran; the fsync's error is raised after it
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_the_checks_error_wins_and_waits_for_the_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    synced = threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        threading.Event().wait(0.2)
        real_fsync(fd)
        synced.set()
        raise OSError(5, "Input/output error")

    def check(temps: list[Path]) -> None:
        raise ValueError("read back differs")

    monkeypatch.setattr(atomic.os, "fsync", slow_fsync)
    with pytest.raises(ValueError, match="read back differs"):
        _write(target, check)
    assert synced.is_set()  # the temp file was not closed and removed under its fsync
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []
