"""Issue 49: every command given a hostile path (``.``, ``/``, ``/dev/zero``, a FIFO, a socket,
an unreadable folder, a symlink loop...) answers in one line: exit 1 or 2, one ``Error: ...``
line on stderr (``verify``/``scan``/``repair``: their report, each stderr line an ``Error:``),
no traceback, no hang, and every file as it was.

The commands come from the click group, so a new command joins by existing (its required
options must be known to :func:`_argv`, or this test fails saying so). The invocations run in
process with click's CliRunner; the FIFO's run in one subprocess bounded by a timeout (an open
of a FIFO blocks), the unreadable folder's in a forked child that dropped root (root reads a
``chmod 000`` folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from ckpttool.cli import cli
from tests.support.timeouts import scaled

ROOT = Path(__file__).resolve().parent.parent
#: Commands whose documented output is a report per path (stdout; a path that could not be
#: checked is in it, or an ``Error:`` line on stderr) and exit 1 or 2.
REPORTS = {"verify", "scan", "repair", "trend"}


def _commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> Iterator[
    tuple[tuple[str, ...], click.Command]
]:  # fmt: skip
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


def _option_value(option: click.Option, out: Path) -> list[str]:
    """A valid value for a required option; an unknown one fails the test, naming it."""
    if isinstance(option.type, click.Choice):
        return [option.opts[0], str(option.type.choices[0])]
    if option.name == "output":
        return [option.opts[0], str(out)]
    if isinstance(option.type, click.types.IntParamType):
        return [option.opts[0], "2"]
    raise AssertionError(f"the fuzz test does not know a value for {option.opts}: add one")


def _argv(words: tuple[str, ...], command: click.Command, path: str, out: Path) -> list[str]:
    argv = list(words)
    for param in command.params:
        if isinstance(param, click.Argument):
            argv += [path] * (2 if param.nargs == -1 else 1)
        elif isinstance(param, click.Option) and param.required:
            argv += _option_value(param, out)
    return argv


COMMANDS = list(_commands())


def _tree(top: Path) -> dict[str, Any]:
    """Every entry under ``top``: kind, mode and (files) digest, as the user left them."""
    state: dict[str, Any] = {}
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(root, name)
            info = path.lstat()
            digest = None
            if path.is_file() and not path.is_symlink() and os.access(path, os.R_OK):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            state[str(path.relative_to(top))] = (info.st_mode, info.st_size, digest)
    return state


def _check(words: tuple[str, ...], exit_code: int, stderr: str, exception: str | None) -> None:
    what = f"{' '.join(words)}: exit {exit_code}, stderr {stderr!r}"
    assert exception is None, f"{what}: raised {exception}"
    assert "Traceback" not in stderr, what
    assert exit_code in (1, 2), what
    lines = stderr.splitlines()
    assert all(line.startswith("Error: ") for line in lines), what
    if words[0] not in REPORTS:
        assert len(lines) == 1, what


def _invoke(argv: list[str]) -> tuple[int, str, str | None]:
    result = CliRunner().invoke(cli, argv)
    exception = result.exception
    raised = None if exception is None or isinstance(exception, SystemExit) else repr(exception)
    return result.exit_code, result.stderr, raised


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The paths, in a working directory of junk (``.`` is that directory)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("not a checkpoint\n")
    (work / "noise.pth").write_bytes(bytes(range(256)) * 4)
    (work / "empty.pth").write_bytes(b"")
    junk = work / "junk"
    junk.mkdir()
    (junk / "a.bin").write_bytes(b"\x80\x02}q\x00")  # a pickle cut short
    (junk / "b.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    (work / "loop1").symlink_to("loop2")
    (work / "loop2").symlink_to("loop1")
    (work / "dangling.pth").symlink_to("nowhere.pth")
    monkeypatch.chdir(work)
    listening = socket.socket(socket.AF_UNIX)
    listening.bind("sock")  # relative: a socket's path is short
    yield {
        "dot": ".",
        "dot-slash": "./",
        "dev-zero": "/dev/zero",
        "dev-null": "/dev/null",
        "socket": str(work / "sock"),
        "symlink-loop": str(work / "loop1"),
        "dangling-symlink": str(work / "dangling.pth"),
        "missing": str(work / "missing.pth"),
        "empty": str(work / "empty.pth"),
        "noise": str(work / "noise.pth"),
        "text": str(work / "notes.txt"),
        "junk-directory": str(junk),
    }
    listening.close()


def test_every_command_answers_a_hostile_path_in_one_line(
    hostile: dict[str, str], tmp_path: Path
) -> None:
    before = _tree(tmp_path)
    failures = []
    for kind, path in hostile.items():
        for words, command in COMMANDS:
            argv = _argv(words, command, path, tmp_path / "out" / "o.pth")
            try:
                _check(words, *_invoke(argv))
            except AssertionError as failure:
                failures.append(f"[{kind}] {failure}".splitlines()[0])
    assert not failures, "\n".join(failures)
    assert _tree(tmp_path) == before  # nothing written, nothing removed


def test_the_root_directory_is_one_line_for_the_commands_that_do_not_walk_it(
    tmp_path: Path,
) -> None:
    """``/`` as a file argument (verify and scan walk a directory's files: their ``/`` is the
    path without a name, tested below)."""
    for words, command in COMMANDS:
        if words[0] in REPORTS:
            continue
        _check(words, *_invoke(_argv(words, command, "/", tmp_path / "o.pth")))
    assert list(tmp_path.iterdir()) == []


def test_verify_of_a_path_without_a_name_lists_no_temp_files() -> None:
    from ckpttool.commands.verify import leftover_temp_files

    assert leftover_temp_files(Path("/")) == []  # was ValueError: PosixPath('/') has an empty name
    assert isinstance(leftover_temp_files(Path(".")), list)


_FIFO_DRIVER = """
import json, sys
from click.testing import CliRunner
from ckpttool.cli import cli
for argv in json.loads(sys.argv[1]):
    result = CliRunner().invoke(cli, argv)
    exc = result.exception
    raised = None if exc is None or isinstance(exc, SystemExit) else repr(exc)
    print(json.dumps([argv, result.exit_code, result.stderr, raised]), flush=True)
"""


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.pth"
    os.mkfifo(fifo)
    runs = [
        (words, _argv(words, command, str(fifo), tmp_path / "o.pth")) for words, command in COMMANDS
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FIFO_DRIVER, json.dumps([argv for _, argv in runs])],
            capture_output=True, text=True, timeout=scaled(300), cwd=tmp_path, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        answered = (expired.stdout or b"").decode().splitlines() if expired.stdout else []
        hung = runs[len(answered)][1] if len(answered) < len(runs) else "?"
        raise AssertionError(f"hung on a FIFO: {hung}") from None
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(answers) == len(runs), done.stderr[-2000:]
    for (words, _), (_, exit_code, stderr, raised) in zip(runs, answers):
        _check(words, exit_code, stderr, raised)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.pth"]


def test_an_unreadable_folder_and_file_are_one_line(tmp_path: Path) -> None:
    """As a user without the permission (root reads anything: the check runs in a forked
    child that dropped to ``nobody``)."""
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="ckpttool-fuzz-"))  # short, outside root-only tmp_path
    try:
        os.chmod(top, 0o755)
        locked_dir = top / "locked"
        locked_dir.mkdir()
        (locked_dir / "model.pth").write_bytes(b"x" * 64)
        locked_file = top / "locked.pth"
        locked_file.write_bytes(b"\x80\x02}q\x00.")
        out = top / "out"
        out.mkdir()
        os.chmod(out, 0o777)
        runs = [
            (words, _argv(words, command, str(path), out / "o.pth"))
            for path in (locked_dir, locked_file)
            for words, command in COMMANDS
        ]
        for _, argv in runs:  # as root, first: every lazy import done before the drop
            _invoke([a.replace(str(top), str(tmp_path)) for a in argv])
        os.chmod(locked_dir, 0)
        os.chmod(locked_file, 0)
        before = _tree(top)
        answers = _as_nobody(lambda: [_invoke(argv) for _, argv in runs])
        os.chmod(locked_dir, 0o755)
        failures = []
        for (words, _), answer in zip(runs, answers):
            try:
                _check(words, *answer)
            except AssertionError as failure:
                failures.append(str(failure).splitlines()[0])
        assert not failures, "\n".join(failures)
        os.chmod(locked_dir, 0)
        assert _tree(top) == before
    finally:
        import contextlib
        import shutil

        with contextlib.suppress(FileNotFoundError):
            os.chmod(top / "locked", 0o755)
        shutil.rmtree(top)


def _as_nobody(work: Any) -> Any:
    """``work()`` in a forked child as user ``nobody`` where this is root, else here; its
    JSON-able result."""
    if os.geteuid() != 0:
        return work()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with os.fdopen(write_end, "w") as pipe:
                json.dump(work(), pipe)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    import select
    import signal
    import time

    chunks = []
    deadline = time.monotonic() + scaled(300)  # bounds a hang (a lock held at the fork)
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the unprivileged child hung")
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    assert status == 0 and text, "the unprivileged child failed"
    return json.loads(text)
