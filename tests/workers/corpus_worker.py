"""Run one ckpttool command over every file of the adversarial corpus, one fork per file.

``python -m tests.workers.corpus_worker COMMAND CORPUS_DIR WORK_DIR GOOD_FILE`` prints one JSON
object: ``{"baseline_mb": ..., "results": [{"file", "args", "exit_code", "signal", "stdout",
"stderr", "seconds", "peak_rss_mb"}, ...]}``.

Why a fork per file: each child starts from this process (ckpttool, click, NumPy and tabulate
already imported, so it measures the command's work and not imports) and its peak resident
memory comes back exactly through ``os.wait4``: one file's bomb cannot hide behind another's,
and a crash or hang kills only that child (an alarm ends it after ``HANG_SECONDS``). The child
runs the real click entry point with its stdout and stderr on files, so what is checked is
exactly what a user would see, exit code included.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

#: A child still running after this long is killed by SIGALRM and reported as hung.
HANG_SECONDS = 60
#: Address-space ceiling of each child: a safety net for the machine, far above the 200 MB
#: the test asserts (a bomb under this limit shows up in peak_rss_mb; above it the child gets
#: MemoryError, which the test also rejects).
ADDRESS_SPACE = 8 << 30
COMMANDS = ("show", "diff-a", "diff-b", "convert", "rescale-step", "verify", "scan")
OUTPUT_CHARS = 4000


def command_args(command: str, path: Path, work: Path, good: Path) -> list[str]:
    """The ckpttool arguments for ``command`` on corpus file ``path``."""
    if command == "show":
        return ["show", str(path)]
    if command == "diff-a":
        return ["diff", str(path), str(good)]
    if command == "diff-b":
        return ["diff", str(good), str(path)]
    if command == "convert":
        return ["convert", str(path), str(work / f"{path.name}.converted.safetensors")]
    if command == "rescale-step":
        copy = work / f"copy-{path.name}"
        shutil.copyfile(path, copy)
        return [
            "rescale-step",
            str(copy),
            "--world-size",
            "2",
            "-o",
            str(work / f"{path.name}.out"),
        ]
    if command == "verify":
        return ["verify", str(path)]
    if command == "scan":
        return ["scan", str(path)]
    raise SystemExit(f"unknown command {command!r}; one of {', '.join(COMMANDS)}")


def _child(args: list[str], out: Path, err: Path) -> None:
    """Runs in the forked child: never returns."""
    code = 70
    try:
        signal.alarm(HANG_SECONDS)
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        for fd, target in ((1, out), (2, err)):
            handle = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(handle, fd)
            os.close(handle)
        from ckpttool.cli import cli

        try:
            cli.main(args=args, prog_name="ckpttool")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # what the test looks for: a traceback reaching the user
            traceback.print_exc()
            code = 99
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run_one(args: list[str], work: Path) -> dict[str, Any]:
    out, err = work / "stdout.txt", work / "stderr.txt"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(args, out, err)
    _, status, usage = os.wait4(pid, 0)
    seconds = time.monotonic() - start
    return {
        "args": args,
        "exit_code": os.waitstatus_to_exitcode(status),
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "stdout": out.read_text(errors="replace")[:OUTPUT_CHARS],
        "stderr": err.read_text(errors="replace")[:OUTPUT_CHARS],
        "seconds": round(seconds, 3),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
    }


def preload() -> None:
    """Import what the commands import lazily, once, before forking."""
    import numpy  # noqa: F401
    import tabulate  # noqa: F401


def main(argv: list[str]) -> None:
    command, corpus_dir, work_dir, good = argv
    corpus, work = Path(corpus_dir), Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    preload()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results = []
    for path in sorted(p for p in corpus.iterdir() if p.is_file()):
        args = command_args(command, path, work, Path(good))
        results.append({"file": path.name, **run_one(args, work)})
    json.dump({"baseline_mb": round(baseline, 1), "results": results}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
