"""How a command ends when the user stops it (Ctrl-C) or stops reading it (``| head``).

Real subprocesses of the CLI: the exit code, the one line (or none) on stderr, and the files
left behind are what a shell and a user see. Neither test waits on a clock: the interrupted
command is held by the loopback server until the test has sent SIGINT, and the pipe is closed
before the command has written what it has to write.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpttool.errors import EXIT_INTERRUPTED, EXIT_PIPE_CLOSED
from ckpttool.io.atomic import TMP_SUFFIX
from tests.support import timeouts
from tests.support.helpers import FIXTURES
from tests.support.range_server import RangeServer

REPO = Path(__file__).resolve().parents[2]
RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"
WEIGHTS = FIXTURES / "minimind/pretrain_32.pth"
CKPTTOOL = [sys.executable, "-m", "ckpttool"]


# -- Ctrl-C -------------------------------------------------------------------------------------


def _safetensors(tensors: int, elements: int) -> bytes:
    """A safetensors file of ``tensors`` float32 tensors, large enough to be read in parts."""
    size = 4 * elements
    header = {
        f"t{i}": {"dtype": "F32", "shape": [elements], "data_offsets": [i * size, (i + 1) * size]}
        for i in range(tensors)
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + bytes(tensors * size)


# `python -m ckpttool` with Python's own Ctrl-C handler, as in a terminal: a test run started in
# the background inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored
CKPTTOOL_WITH_SIGINT = [
    sys.executable, "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('ckpttool', run_name='__main__', alter_sys=True)",
]  # fmt: skip


def _temps(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX)]


def test_ctrl_c_exits_130_with_one_line_and_leaves_no_temp_file(tmp_path: Path) -> None:
    """convert from a URL to an existing file, stopped while its temp file is being written:
    exit 130 (not 1, which means "found"), one line, the temp file removed, the user's file as
    it was."""
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.safetensors"
    target.write_bytes(b"the user's own file")
    server = RangeServer().start()
    # every request made once the temp file exists waits for the test: the command is stopped
    # in the middle of the read that fills it, whatever the machine's speed
    server.hold = lambda path, start, stop: bool(_temps(out))
    try:
        url = server.add("big.safetensors", _safetensors(tensors=2, elements=1 << 20))
        command = subprocess.Popen(
            [*CKPTTOOL_WITH_SIGINT, "convert", url, target, "--force"], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            held = server.holding.wait(timeouts.scaled(120))
            if not held:
                command.kill()
                pytest.fail(timeouts.expired("convert's read", timeouts.scaled(120)))
            assert len(_temps(out)) == 1  # what the interrupt has to clean up
            command.send_signal(signal.SIGINT)
            server.release.set()  # requests in flight end; the command stops at its next step
            stdout, stderr = command.communicate(timeout=timeouts.scaled(120))
        finally:
            if command.poll() is None:
                command.kill()
                command.wait()
    finally:
        server.stop()
    assert command.returncode == EXIT_INTERRUPTED, stderr
    assert stderr == "Error: interrupted\n"
    assert stdout == ""
    assert _temps(out) == []
    assert target.read_bytes() == b"the user's own file"


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux's /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.update(int(c) for c in (task / "children").read_text().split())
    return found


def _interrupt_when(command: subprocess.Popen[str], ready: Callable[[], bool]) -> tuple[str, str]:
    """SIGINT to ``command`` once ``ready()`` (polled), then its output; a test that misses
    the moment fails rather than passes."""
    deadline = time.monotonic() + timeouts.scaled(120)
    try:
        while not ready():
            if command.poll() is not None or time.monotonic() > deadline:
                command.kill()
                _, err = command.communicate()
                pytest.fail(f"the command ended ({command.returncode}) before its moment: {err}")
            time.sleep(0.002)
        command.send_signal(signal.SIGINT)
        return command.communicate(timeout=timeouts.scaled(120))
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_ctrl_c_stops_an_edit_with_jobs_and_leaves_nothing(tmp_path: Path) -> None:
    """edit of a 4-shard directory with --jobs 2, stopped once its members are being written
    into the staged directory: exit 130, one line, no output, no staged directory or temp
    file, no process left in its group."""
    source = tmp_path / "model"
    source.mkdir()
    weight_map = {}
    for shard in range(4):
        name = f"model-{shard + 1:05d}-of-00004.safetensors"
        (source / name).write_bytes(_safetensors(tensors=4, elements=2 << 20))
        weight_map.update({f"layers.{shard}.t{i}": name for i in range(4)})
    index = {"metadata": {}, "weight_map": weight_map}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    (source / "config.json").write_text('{"torch_dtype": "float32"}')
    before, listed = sorted(os.listdir(tmp_path)), sorted(os.listdir(source))
    command = subprocess.Popen(
        [*CKPTTOOL_WITH_SIGINT, "edit", source, "--dtype", "bf16", "-o", tmp_path / "out",
         "--jobs", "2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip

    def writing() -> bool:  # a member's file exists in the staged directory
        return any(any(stage.iterdir()) for stage in _temps(tmp_path) if stage.is_dir())

    stdout, stderr = _interrupt_when(command, writing)
    assert command.returncode == EXIT_INTERRUPTED, stderr
    assert (stdout, stderr) == ("", "Error: interrupted\n")
    assert sorted(os.listdir(tmp_path)) == before  # no out, no staged directory
    assert sorted(os.listdir(source)) == listed  # the input as it was
    with pytest.raises(ProcessLookupError):
        os.killpg(command.pid, 0)  # nothing of its group is left


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_ctrl_c_stops_a_scan_on_forked_workers_and_leaves_none(tmp_path: Path) -> None:
    """scan of 8 long pickles with --jobs 2 runs on two forked workers; Ctrl-C once both are
    running: exit 130, one line, and both workers gone."""
    import pickle

    table = pickle.dumps({f"layers.{i}.weight": [i, i + 1] for i in range(200_000)}, protocol=2)
    for number in range(8):
        (tmp_path / f"table_{number}.pkl").write_bytes(table)
    command = subprocess.Popen(
        [*CKPTTOOL_WITH_SIGINT, "scan", tmp_path, "--jobs", "2"], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    workers: set[int] = set()

    def both_running() -> bool:
        workers.update(_children(command.pid))
        return len(workers) >= 2

    stdout, stderr = _interrupt_when(command, both_running)
    assert command.returncode == EXIT_INTERRUPTED, stderr
    assert (stdout, stderr) == ("", "Error: interrupted\n")
    with pytest.raises(ProcessLookupError):
        os.killpg(command.pid, 0)  # the workers (in its group) are gone too


# -- a closed stdout ----------------------------------------------------------------------------


def _run_into_closed_pipe(*args: object) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose reader has already gone (``| head -0``)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return timeouts.run(
            [*CKPTTOOL, *map(str, args)], 120, cwd=REPO, stdout=write_end, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "args",
    [
        ["show", RESUME],
        ["show", RESUME, "--json"],
        ["show", RESUME, "--tree"],
        ["diff", RESUME, WEIGHTS],  # they differ: would exit 1
        ["diff", RESUME, WEIGHTS, "--json"],
        ["verify", RESUME, "--json"],
        ["scan", RESUME],
        ["--help"],
    ],
    ids=lambda args: " ".join(str(a).rsplit("/", 1)[-1] for a in args),
)
def test_a_closed_stdout_ends_the_command_quietly(args: list[object]) -> None:
    result = _run_into_closed_pipe(*args)
    assert (result.returncode, result.stderr) == (EXIT_PIPE_CLOSED, "")


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETPIPE_SZ"), reason="Linux pipes")
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_reader_that_stops_early_ends_show_quietly(as_json: bool, unbuffered: str) -> None:
    """``show | head -1``: the reader takes one line and goes while the command still writes
    (the pipe holds one page, less than the output: the command cannot have finished). Under
    ``PYTHONUNBUFFERED`` too, where Python's own stdout would drop the rest of a short write
    and exit 0."""
    import fcntl

    args = ["show", str(RESUME), *(["--json"] if as_json else [])]
    read_end, write_end = os.pipe()
    page = fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    command = subprocess.Popen(
        [*CKPTTOOL, *args], cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
    )  # fmt: skip
    os.close(write_end)
    try:
        first = b""
        while not first.endswith(b"\n"):  # byte by byte: nothing more is taken from the pipe
            byte = os.read(read_end, 1)
            if not byte:
                break
            first += byte
        os.close(read_end)
        _, stderr = command.communicate(timeout=timeouts.scaled(120))
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    whole = subprocess.run([*CKPTTOOL, *args], cwd=REPO, capture_output=True, check=True)
    assert len(whole.stdout) > len(first) + page  # more than was read and the pipe holds
    assert first == whole.stdout.splitlines(keepends=True)[0]
    assert (command.returncode, stderr) == (EXIT_PIPE_CLOSED, "")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_output_to_a_full_disk_is_one_line_and_exit_2(as_json: bool, unbuffered: str) -> None:
    """Every write fails (ENOSPC): one line, exit 2, and nothing retried at exit (Python's
    "Exception ignored" and exit 120)."""
    with open("/dev/full", "w") as full:
        result = timeouts.run(
            [*CKPTTOOL, "show", RESUME, *(["--json"] if as_json else [])], 120, cwd=REPO,
            stdout=full, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
        )  # fmt: skip
    assert (result.returncode, result.stderr) == (2, "Error: No space left on device\n")
