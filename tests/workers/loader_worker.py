"""Learn which archives run their payload under their own loader: one fork each.

``python -m tests.workers.loader_worker FILES_DIR MARKERS_DIR LOADERS_JSON`` opens every file of
FILES_DIR with the loader ``LOADERS_JSON`` names for it (``export``: ``torch.export.load``;
``package``: ``PackageImporter(path).load_pickle`` of every resource in a package folder but source and READMEs; ``jit``: ``torch.jit.load``)
in a forked child (torch imported once, before forking; a fresh working directory; stdout kept
in ``MARKERS_DIR/<name>.stdout``; an alarm after ``HANG_SECONDS``) and prints one JSON object
``{file name: {"live": bool, "loaded": bool}}``: ``live`` when the marker ``MARKERS_DIR/<name>``
exists, or the child printed :data:`tests.support.loader_archives.MARKER_TEXT` with the name
(TorchScript code cannot write files). The only place these archives' code runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import zipfile
from pathlib import Path

HANG_SECONDS = 60
MARKER_TEXT = "ckpttool-test-marker:"  # tests.support.loader_archives.MARKER_TEXT


def _load(path: Path, loader: str) -> None:
    import torch

    if loader == "export":
        torch.export.load(path)
    elif loader == "jit":
        torch.jit.load(path)
    else:
        importer = torch.package.PackageImporter(path)
        with zipfile.ZipFile(path) as archive:
            names = [n.split("/", 1)[1] for n in archive.namelist()]
        for name in names:
            if (
                "/" in name
                and not name.endswith((".py", "README"))
                and not name.startswith(".data/")
            ):
                package, _, resource = name.rpartition("/")
                importer.load_pickle(package.replace("/", "."), resource)


def _child(path: Path, loader: str, stdout: Path) -> None:
    code = 1
    try:
        signal.alarm(HANG_SECONDS)
        os.chdir(tempfile.mkdtemp(prefix="loader-"))
        out = os.open(stdout, os.O_WRONLY | os.O_CREAT)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(null, 2)
        _load(path, loader)
        code = 0
    except BaseException:
        code = 1
    finally:
        sys.stdout.flush()
        os._exit(code)


def main(argv: list[str]) -> None:
    files, markers, loaders = Path(argv[0]), Path(argv[1]), json.loads(Path(argv[2]).read_text())
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401 - imported once, before forking

    found = {}
    for name, loader in sorted(loaders.items()):
        stdout = markers / f"{name}.stdout"
        pid = os.fork()
        if pid == 0:
            _child(files / name, loader, stdout)
        _, status = os.waitpid(pid, 0)
        printed = stdout.exists() and f"{MARKER_TEXT}{name}" in stdout.read_text()
        stdout.unlink(missing_ok=True)
        found[name] = {
            "live": (markers / name).exists() or printed,
            "loaded": os.waitstatus_to_exitcode(status) == 0,
        }
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
