"""Throughput (issue 33): the commands that read every byte against ``cat``, ``cmp`` and ``cp``.

Run from the repository root, under the shared bench lock::

    flock /tmp/bench.lock python -m bench.throughput [--runs 5]

One table per row of the issue, each command interleaved with its floor (bench/harness.py:
warm page cache, medians, peak RSS), all in one run:

* ``verify`` of the 1.25 GB resume file against ``cat FILE > /dev/null``;
* ``diff`` of two byte-identical resume files against ``cmp`` of the same two;
* ``diff`` of the pair that differs in one element (``bench.build --pair``) against ``cmp`` of
  the identical pair: ``cmp`` of this pair stops at the first byte that differs (torch wrote
  the changed file again, and its records start at other offsets), so reading two whole files
  is the floor;
* ``convert`` of the 218 MB fp16 weights to safetensors against ``cp`` + ``sync`` of the file;
* ``convert`` of the resume file's model to safetensors against ``cp`` + ``sync`` of the bytes
  written (the output of a first conversion).

Floors that are not commands a user runs are rows too: Python start-up with ckpttool's CLI
(``ckpttool --version``), and the same process reading the file(s) through
:mod:`ckpttool.io.blocks` (read + CRC-32, read + compare), which is what ``verify`` and ``diff``
cannot go below in one process on one core.

Every command that may exit 1 (``diff`` of files that differ, ``cmp``) runs under
``sh -c '...; test $? -le 1'``; ``cat`` and ``cp`` run under ``sh -c`` too, for the
redirection and the ``&&``: the shell's few milliseconds are in every row alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.build import build_resume_pair, weights_and_resume
from bench.harness import compare

# the floor rows' in-process work: ckpttool's own block reads, nothing else
READ_CRC = """
import os, sys
from ckpttool.io.blocks import crc_range
from ckpttool.io.source import read_into
fd = os.open(sys.argv[1], os.O_RDONLY)
crc_range(lambda offset, into: read_into(fd, offset, into), 0, os.fstat(fd).st_size)
"""
READ_COMPARE = """
import os, sys
from ckpttool.io.blocks import equal_ranges
from ckpttool.io.source import read_into
a, b = (os.open(name, os.O_RDONLY) for name in sys.argv[1:3])
size = os.fstat(a).st_size
equal_ranges(lambda at, into: read_into(a, at, into), 0, lambda at, into: read_into(b, at, into), 0, size)
"""


def _sh(script: str, *args: object) -> list[str]:
    return ["sh", "-c", script, "sh", *(str(arg) for arg in args)]


def _exit_0_or_1(*argv: object) -> list[str]:
    return _sh('"$@"; test $? -le 1', *argv)


def _ckpttool(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *(str(arg) for arg in args)]


def _before(before: Path | None, *args: object, exits_1: bool = False) -> dict[str, list[str]]:
    """The command run from the ckpttool in ``before`` (``--before DIR``), as an extra row
    (``-P``: not the one in the current directory)."""
    if before is None:
        return {}
    command = ["env", f"PYTHONPATH={before}", sys.executable, "-P", "-m", "ckpttool"]
    command += [str(arg) for arg in args]
    return {"ckpttool before #33": _exit_0_or_1(*command) if exits_1 else command}


def main(argv: list[str] | None = None) -> int:
    # A user's installed ckpttool has its bytecode; a development shell may say not to write it
    # (PYTHONDONTWRITEBYTECODE), which would add ~0.2 s of compiling to every Python row.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    before: Path | None = None
    if argv is None:
        argv = sys.argv[1:]
    if "--before" in argv:  # a checkout of ckpttool before issue 33 (git archive REV ckpttool)
        at = argv.index("--before")
        before, argv = Path(argv[at + 1]).resolve(), argv[:at] + argv[at + 2 :]
    args, weights, resume, work = weights_and_resume(
        argv, "python -m bench.throughput", __doc__, "throughput_out"
    )
    _, copy, changed = build_resume_pair(args.out)
    runs, warmup = args.runs, args.warmup
    cat = _sh('cat "$1" > /dev/null', resume)
    cmp_same = _exit_0_or_1("cmp", resume, copy)
    startup = _ckpttool("--version")

    print(f"\n#### `verify` of {resume.name} ({resume.stat().st_size / 1e9:.2f} GB)\n")
    rows = {
        "cat FILE > /dev/null": cat,
        "ckpttool verify": _exit_0_or_1(*_ckpttool("verify", resume)),
        **_before(before, "verify", resume, exits_1=True),
        "floor: ckpttool --version (start-up)": startup,
        "floor: python, read + CRC-32 (io.blocks)": [sys.executable, "-c", READ_CRC, str(resume)],
    }
    print(compare(rows, "cat FILE > /dev/null", runs=runs, warmup=warmup))

    print(f"\n#### `diff` of two byte-identical {resume.name} files\n")
    rows = {
        "cmp A B": cmp_same,
        "ckpttool diff": _exit_0_or_1(*_ckpttool("diff", resume, copy)),
        **_before(before, "diff", resume, copy, exits_1=True),
        "floor: ckpttool --version (start-up)": startup,
        "floor: python, read + compare (io.blocks)": [
            sys.executable, "-c", READ_COMPARE, str(resume), str(copy)
        ],
    }  # fmt: skip
    print(compare(rows, "cmp A B", runs=runs, warmup=warmup))

    print(f"\n#### `diff` of {resume.name} and {changed.name} (one element differs)\n")
    rows = {
        "cmp of the identical pair": cmp_same,
        "cmp A B (stops at the first difference)": _exit_0_or_1("cmp", resume, changed),
        "ckpttool diff": _exit_0_or_1(*_ckpttool("diff", resume, changed)),
        **_before(before, "diff", resume, changed, exits_1=True),
    }
    print(compare(rows, "cmp of the identical pair", runs=runs, warmup=warmup))

    print(
        f"\n#### `convert` of {weights.name} ({weights.stat().st_size / 1e6:.0f} MB) to safetensors\n"
    )
    rows = {
        "cp + sync": _sh('cp "$1" "$2" && sync "$2"', weights, work / "weights_cp.bin"),
        "ckpttool convert": _ckpttool("convert", weights, work / "weights.safetensors", "--force"),
        **_before(before, "convert", weights, work / "weights_b.safetensors", "--force"),
    }
    print(compare(rows, "cp + sync", runs=runs, warmup=warmup))

    model = work / "model.safetensors"
    subprocess.run(_ckpttool("convert", resume, model, "--force"), check=True, capture_output=True)
    print(
        f"\n#### `convert` of {resume.name}'s model to safetensors "
        f"({model.stat().st_size / 1e6:.0f} MB written)\n"
    )
    rows = {
        "cp + sync of the bytes written": _sh(
            'cp "$1" "$2" && sync "$2"', model, work / "model_cp.bin"
        ),
        "ckpttool convert": _ckpttool("convert", resume, model, "--force"),
        **_before(before, "convert", resume, work / "model_b.safetensors", "--force"),
    }
    print(compare(rows, "cp + sync of the bytes written", runs=runs, warmup=warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
