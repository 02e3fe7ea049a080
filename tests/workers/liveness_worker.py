"""Learn which files run their payload under ``torch.load(weights_only=False)``: one fork each.

``python -m tests.workers.liveness_worker FILES_DIR MARKERS_DIR`` loads every file of FILES_DIR
with ``torch.load(path, weights_only=False)`` in a forked child (torch imported once, before
forking; the child's working directory is a fresh temporary one, its output discarded, an alarm
ends it after ``HANG_SECONDS``) and prints one JSON object ``{file name: {"live": bool,
"loaded": bool}}``: ``live`` when the file's marker, ``MARKERS_DIR/<file name>``, exists once
every child is done (a payload may start a process that creates it a moment later), ``loaded``
when torch.load returned. This is the only place the test suite runs a hostile file's code, and
only in these children.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

HANG_SECONDS = 30
ADDRESS_SPACE = 8 << 30
#: How long the marker of a payload that starts a process may take to appear.
SETTLE_SECONDS = 3.0


def _child(path: Path) -> None:
    code = 1
    try:
        signal.alarm(HANG_SECONDS)
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        os.chdir(tempfile.mkdtemp(prefix="liveness-"))
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        import torch

        torch.load(path, weights_only=False)
        code = 0
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def main(argv: list[str]) -> None:
    files, markers = Path(argv[0]), Path(argv[1])
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401 - imported once, before forking

    loaded = {}
    for path in sorted(p for p in files.iterdir() if p.is_file()):
        pid = os.fork()
        if pid == 0:
            _child(path)
        _, status = os.waitpid(pid, 0)
        loaded[path.name] = os.waitstatus_to_exitcode(status) == 0
    time.sleep(SETTLE_SECONDS)
    json.dump(
        {name: {"live": (markers / name).exists(), "loaded": ok} for name, ok in loaded.items()},
        sys.stdout,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
