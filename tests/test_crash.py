"""Crash safety of every write: real SIGKILLs mid-write, simulated full disks and exceptions, and
the order of the durability calls.

What must hold: a checkpoint being replaced is, at every moment, either the complete old file
or the complete new one (byte for byte), readable by ckpttool's reader and by ``torch.load``;
an interrupted write leaves at most a temp file beside it, which ``verify`` reports; a failed
write (exception, ENOSPC) leaves the old file untouched and no temp file; and the temp file is
fsynced before it is renamed over the target, the directory after.

The kill tests run :mod:`tests.workers.crash_worker` (one process per operation, a fork per kill).
``CKPTTOOL_CRASH_KILLS`` sets the kills per operation (30 by default; the long run in
README.md used 300).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpttool.io import atomic
from ckpttool.io.atomic import atomic_group, atomic_write, temp_name_pattern
from tests.support import timeouts
from tests.support.helpers import FIXTURES

REPO = Path(__file__).resolve().parent.parent
KILLS = int(os.environ.get("CKPTTOOL_CRASH_KILLS", "30"))
RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"
WEIGHTS = FIXTURES / "minimind/pretrain_32.pth"


def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{atomic.TMP_SUFFIX}"))


# --- real kills ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("operation", ["save", "async_save", "convert", "rescale", "repair"])
def test_sigkill_mid_write_leaves_old_or_new_never_partial(tmp_path: Path, operation: str) -> None:
    worker = "tests.workers.crash_worker"
    argv = [sys.executable, "-m", worker, operation, str(KILLS), str(tmp_path)]
    done = timeouts.run(argv, 1800, cwd=REPO, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    report = json.loads(done.stdout)
    assert report["untouched"], "an input of the operation changed"  # repair's cut file
    trials: list[dict[str, Any]] = report["trials"]
    assert sum(t["killed"] for t in trials) >= KILLS
    mid_write = 0
    states: set[str] = set()
    for trial in trials:
        for name, target in trial["targets"].items():
            where = f"{name} after a kill at {trial['delay']} s"
            assert target["state"] in ("old", "new"), f"{where}: a partial file"
            assert target["reader"], f"{where}: ckpttool cannot read it"
            assert target["torch_load"] in (True, None), f"{where}: torch.load fails on it"
            assert target["verify_leftovers"] == target["temps"], f"{where}: verify missed temps"
            mid_write += bool(target["temps"])
            states.add(target["state"])
        if operation in ("save", "async_save"):  # the weights file first, the resume file second
            pair = trial["targets"]
            assert not (
                pair["pretrain_1024_resume.pth"]["state"] == "new"
                and pair["pretrain_1024.pth"]["state"] == "old"
            )
    # Not vacuous: some kills landed inside a write (a temp file was left), some after it.
    assert mid_write >= 1 and states == {"old", "new"}, (mid_write, states)


# --- failures while writing ---------------------------------------------------------------


class DiskFull:
    """A disk with ``budget`` bytes free: writes past it fail with ENOSPC, as a full disk does."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.hit = False

    def take(self, size: int) -> None:
        if size > self.left:
            self.left = 0
            self.hit = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= size


class FullDiskFile:
    """The temp file's handle, with ``write`` charged against a :class:`DiskFull`."""

    def __init__(self, handle: Any, disk: DiskFull) -> None:
        self._handle = handle
        self._disk = disk

    def write(self, data: Any) -> int:
        self._disk.take(memoryview(data).nbytes)
        return int(self._handle.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> FullDiskFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], DiskFull]:
    """Install a full disk: buffered writes, the kernel copy and pwrite all charge it."""

    def install(budget: int) -> DiskFull:
        disk = DiskFull(budget)
        real_fdopen, real_copy, real_pwrite = os.fdopen, os.copy_file_range, os.pwrite

        def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
            return FullDiskFile(real_fdopen(fd, *args, **kwargs), disk)

        def copy_file_range(src: int, dst: int, count: int, *args: Any) -> int:
            disk.take(count)
            return real_copy(src, dst, count, *args)

        def pwrite(fd: int, data: Any, offset: int) -> int:
            disk.take(memoryview(data).nbytes)
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(atomic.os, "fdopen", fdopen)
        monkeypatch.setattr(os, "copy_file_range", copy_file_range)
        monkeypatch.setattr(os, "pwrite", pwrite)
        return disk

    return install


def test_atomic_write_disk_full_keeps_old_target(
    tmp_path: Path, full_disk: Callable[[int], DiskFull]
) -> None:
    target = tmp_path / "ckpt.pth"
    target.write_bytes(b"old checkpoint")
    disk = full_disk(1000)
    with pytest.raises(OSError) as raised, atomic_write(target) as handle:
        for _ in range(100):
            handle.write(b"x" * 100)
    assert raised.value.errno == errno.ENOSPC and disk.hit
    assert target.read_bytes() == b"old checkpoint"
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("budget", [100_000, 700_000])  # in the weights file, in the resume file
def test_save_checkpoint_disk_full_keeps_old_files(
    tmp_path: Path, full_disk: Callable[[int], DiskFull], budget: int
) -> None:
    import torch

    from ckpttool import save_checkpoint

    model = torch.nn.Linear(256, 256)  # 256 KB of fp32 weights, 128 KB as fp16
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    save = dict(save_dir=tmp_path, weight="pretrain", hidden_size=256, epoch=0, step=1)
    weights, resume = save_checkpoint(model, optimizer, **save)  # type: ignore[arg-type]
    old = {weights: weights.read_bytes(), resume: resume.read_bytes()}
    with torch.no_grad():
        model.weight.add_(1.0)
    disk = full_disk(budget)
    with pytest.raises((OSError, RuntimeError)):
        save_checkpoint(model, optimizer, **save)  # type: ignore[arg-type]
    assert disk.hit
    assert resume.read_bytes() == old[resume]
    if budget == 100_000:
        assert weights.read_bytes() == old[weights]
    else:  # the weights file (written first) completed; the resume file is the old one
        assert weights.read_bytes() != old[weights]
        torch.load(weights, weights_only=True)
    assert _temps(tmp_path) == []


def test_convert_disk_full_keeps_old_target(
    tmp_path: Path, full_disk: Callable[[int], DiskFull]
) -> None:
    from ckpttool.commands.convert.run import convert
    from ckpttool.errors import InputError

    target = tmp_path / "model.safetensors"
    convert(WEIGHTS, target, dtype="fp32")
    old = target.read_bytes()
    disk = full_disk(20_000)
    with pytest.raises(InputError, match="No space left on device"):
        convert(WEIGHTS, target, force=True)
    assert disk.hit and target.read_bytes() == old and _temps(tmp_path) == []


def test_rescale_disk_full_keeps_old_file(
    tmp_path: Path, full_disk: Callable[[int], DiskFull]
) -> None:
    from ckpttool.commands.rescale.run import rescale_step
    from ckpttool.errors import InputError

    path = tmp_path / "pretrain_32_resume.pth"
    shutil.copyfile(RESUME, path)
    disk = full_disk(100_000)
    with pytest.raises(InputError, match="No space left on device"):
        rescale_step(path, 2, backup=True)
    assert disk.hit and path.read_bytes() == RESUME.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_32_resume.pth"]  # no .bak


def test_save_checkpoint_exception_mid_pickle_keeps_old_resume(tmp_path: Path) -> None:
    import torch

    from ckpttool import save_checkpoint

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save = dict(save_dir=tmp_path, weight="pretrain", hidden_size=8, epoch=0, step=1)
    _, resume = save_checkpoint(model, optimizer, **save)  # type: ignore[arg-type]
    old = resume.read_bytes()
    # extra_state is pickled last, after the model and optimizer: a lambda fails there
    with pytest.raises((pickle.PicklingError, AttributeError), match=r"Can't pickle"):
        save_checkpoint(model, optimizer, extra_state={"hook": lambda: 0}, **save)  # type: ignore[arg-type]
    assert resume.read_bytes() == old and _temps(tmp_path) == []


def _fail_on_call(number: int, error: BaseException) -> Callable[..., Any]:
    calls = {"n": 0}

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def failing(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == number:
                raise error
            return real(*args, **kwargs)

        return failing

    return wrap


def test_convert_exception_mid_write_keeps_old_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpttool.commands.convert.run as convert_module

    target = tmp_path / "model.safetensors"
    convert_module.convert(WEIGHTS, target, dtype="fp16")
    old = target.read_bytes()
    failing = _fail_on_call(3, KeyboardInterrupt())(convert_module.tensor_bytes)
    monkeypatch.setattr(convert_module, "tensor_bytes", failing)  # Ctrl-C at the third tensor
    with pytest.raises(KeyboardInterrupt):
        convert_module.convert(WEIGHTS, target, force=True)
    assert target.read_bytes() == old and _temps(tmp_path) == []


def test_rescale_exception_mid_copy_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpttool.formats.torch_zip.zip_writer as zip_writer
    from ckpttool.commands.rescale.run import rescale_step

    path = tmp_path / "pretrain_32_resume.pth"
    shutil.copyfile(RESUME, path)
    failing = _fail_on_call(5, KeyboardInterrupt())(zip_writer.copy_range)
    monkeypatch.setattr(zip_writer, "copy_range", failing)
    with pytest.raises(KeyboardInterrupt):
        rescale_step(path, 2)
    assert path.read_bytes() == RESUME.read_bytes() and _temps(tmp_path) == []


# --- order of durability calls -----------------------------------------------------------


@pytest.fixture
def durability_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, ...]]]:
    """Record fsync (with the path and size of what is synced) and replace, in call order."""
    calls: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        size = "dir" if os.path.isdir(path) else str(os.fstat(fd).st_size)
        calls.append(("fsync", path, size))
        real_fsync(fd)

    def replace(source: Any, target: Any) -> None:
        calls.append(("replace", str(source), str(target)))
        real_replace(source, target)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    yield calls


def test_atomic_write_fsyncs_file_then_replaces_then_fsyncs_directory(
    tmp_path: Path, durability_calls: list[tuple[str, ...]]
) -> None:
    target = tmp_path / "model.pth"
    target.write_bytes(b"old")
    with atomic_write(target) as handle:
        handle.write(b"n" * 100_000)  # more than the buffer: some of it is still in Python
    temp, *_ = durability_calls[0][1:]
    assert Path(temp).match(temp_name_pattern(target))
    assert durability_calls == [
        ("fsync", temp, "100000"),  # the whole content reached the file before its fsync
        ("replace", temp, str(target)),
        ("fsync", str(tmp_path), "dir"),
    ]
    assert target.read_bytes() == b"n" * 100_000


def test_atomic_group_fsyncs_every_file_checks_then_renames_index_last(
    tmp_path: Path, durability_calls: list[tuple[str, ...]]
) -> None:
    targets = [tmp_path / "model-00001-of-00002.safetensors",
               tmp_path / "model-00002-of-00002.safetensors",
               tmp_path / "model.safetensors.index.json"]  # fmt: skip

    def check(temps: list[Path]) -> None:
        durability_calls.append(("check", *map(str, temps)))

    with atomic_group(targets, check=check) as handles:
        for number, handle in enumerate(handles, start=1):
            handle.write(b"x" * number * 1000)
    temps = [call[1] for call in durability_calls if call[0] == "fsync"][:3]
    # convert's read-back runs on complete files while a second thread fsyncs them: the
    # two in either order, both before any rename
    assert sorted(durability_calls[:4]) == sorted([
        ("fsync", temps[0], "1000"),
        ("fsync", temps[1], "2000"),
        ("fsync", temps[2], "3000"),
        ("check", *temps),
    ])  # fmt: skip
    assert [call for call in durability_calls[:4] if call[0] == "fsync"] == [
        ("fsync", temps[0], "1000"),
        ("fsync", temps[1], "2000"),
        ("fsync", temps[2], "3000"),
    ]
    assert durability_calls[4:] == [
        ("replace", temps[0], str(targets[0])),
        ("replace", temps[1], str(targets[1])),
        ("replace", temps[2], str(targets[2])),  # the index readers start from: last
        ("fsync", str(tmp_path), "dir"),
    ]


def test_failed_check_renames_nothing_and_removes_temps(
    tmp_path: Path, durability_calls: list[tuple[str, ...]]
) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def check(temps: list[Path]) -> None:
        raise ValueError("read-back differs")

    with pytest.raises(ValueError), atomic_group([target], check=check) as (handle,):
        handle.write(b"new")
    assert [call[0] for call in durability_calls] == ["fsync"]
    assert target.read_bytes() == b"old" and _temps(tmp_path) == []
