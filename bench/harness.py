"""Time commands and measure their peak memory, fairly, as subprocesses.

Each run is a fresh process, started by a small spawner process (see ``_SPAWNER``): wall time is
``time.perf_counter`` from spawn to reap, peak RSS is ``os.wait4``'s ``ru_maxrss`` (KiB on Linux;
it covers the command and any children it waited for). The spawner's own ~10 MB is the floor of
every RSS figure. Nothing is dropped from the page cache, so measured runs are warm-cache (the
warmup runs pull the file into memory): the numbers compare CPU and memory work, not disk speed.

Competing commands are interleaved (A, B, A, B, ...) so that a noisy neighbour or thermal drift
hits all of them alike; medians are reported. Library use::

    from bench.harness import compare
    print(compare({"torch.load": [...], "ckpttool": [...]}, baseline="torch.load"))

or from a shell (each row is NAME=COMMAND, split with shlex)::

    python -m bench.harness --runs 5 --baseline torch.load \\
        "torch.load=python -c 'import torch; torch.load(\\"bench/data/pretrain_768_resume.pth\\")'" \\
        "ckpttool show=ckpttool show bench/data/pretrain_768_resume.pth"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CommandFailed", "Result", "Sample", "compare", "measure", "measure_all", "table"]


class CommandFailed(RuntimeError):
    """A measured command exited non-zero; timing a failure would be meaningless."""


@dataclass(frozen=True)
class Sample:
    wall_s: float  # spawn to reap
    peak_rss_mb: float  # ru_maxrss, MiB


@dataclass(frozen=True)
class Result:
    command: tuple[str, ...]
    samples: tuple[Sample, ...]  # measured runs only, warmups excluded

    @property
    def median_wall_s(self) -> float:
        return statistics.median(s.wall_s for s in self.samples)

    @property
    def median_peak_rss_mb(self) -> float:
        return statistics.median(s.peak_rss_mb for s in self.samples)


# The measured command is spawned by this small helper, not by the harness: Linux starts a
# child's ru_maxrss at the peak RSS of the process that forked it (exec keeps the old mm's
# high-water mark), so a harness that once held 1 GB would report 1 GB for `true`. The helper's
# own peak is a few MB: that is the floor of every RSS reported.
_SPAWNER = """
import json, os, sys, time
cmd = json.loads(sys.argv[1])
start = time.perf_counter()
pid = os.posix_spawnp(cmd[0], cmd, os.environ,
                      file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
print(json.dumps([wall, usage.ru_maxrss, os.waitstatus_to_exitcode(status)]))
"""


def run_once(cmd: Sequence[str]) -> Sample:
    """Run ``cmd`` to completion (stdout discarded); raise :class:`CommandFailed` on failure."""
    if not cmd:
        raise ValueError("empty command")
    with tempfile.TemporaryFile() as stderr:
        spawner = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _SPAWNER, json.dumps(list(cmd))],
            stdout=subprocess.PIPE,
            stderr=stderr,
            check=False,
        )
        stderr.seek(0)
        tail = stderr.read()[-2000:].decode(errors="replace")
    if spawner.returncode != 0:
        raise CommandFailed(f"could not run {shlex.join(cmd)}:\n{tail}")
    wall_s, maxrss_kib, returncode = json.loads(spawner.stdout)
    if returncode != 0:
        raise CommandFailed(f"{shlex.join(cmd)} exited {returncode}:\n{tail}")
    return Sample(wall_s=wall_s, peak_rss_mb=maxrss_kib / 1024)


def measure_all(
    commands: Mapping[str, Sequence[str]], *, runs: int = 5, warmup: int = 1
) -> dict[str, Result]:
    """Measure several commands, interleaving their runs; results keyed like ``commands``."""
    if runs < 1:
        raise ValueError("runs must be at least 1")
    for _ in range(warmup):
        for cmd in commands.values():
            run_once(cmd)
    samples: dict[str, list[Sample]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, cmd in commands.items():
            samples[name].append(run_once(cmd))
    return {
        name: Result(command=tuple(cmd), samples=tuple(samples[name]))
        for name, cmd in commands.items()
    }


def measure(cmd: Sequence[str], runs: int = 5, warmup: int = 1) -> Result:
    """Median wall time and peak RSS of ``cmd`` over ``runs`` runs after ``warmup`` discarded."""
    return measure_all({"cmd": cmd}, runs=runs, warmup=warmup)["cmd"]


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "n/a"


def table(results: Mapping[str, Result], baseline: str) -> str:
    """A markdown table of ``results``, with ratios against the ``baseline`` row."""
    if baseline not in results:
        raise KeyError(f"baseline {baseline!r} is not one of {sorted(results)}")
    base = results[baseline]
    lines = [
        "| command | median wall (s) | median peak RSS (MB) | wall vs baseline | RSS vs baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        wall, rss = result.median_wall_s, result.median_peak_rss_mb
        lines.append(
            f"| {name} | {wall:.3f} | {rss:.1f} | {_ratio(wall, base.median_wall_s)} "
            f"| {_ratio(rss, base.median_peak_rss_mb)} |"
        )
    return "\n".join(lines)


def compare(
    rows: Mapping[str, Sequence[str]], baseline: str, *, runs: int = 5, warmup: int = 1
) -> str:
    """Measure ``rows`` (name -> argv) interleaved and render the markdown table."""
    if baseline not in rows:
        raise KeyError(f"baseline {baseline!r} is not one of {sorted(rows)}")
    return table(measure_all(rows, runs=runs, warmup=warmup), baseline)


def _parse_row(text: str) -> tuple[str, list[str]]:
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND, got {text!r}")
    return name, shlex.split(command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.harness", description="Compare commands' wall time and peak RSS."
    )
    parser.add_argument("rows", nargs="+", type=_parse_row, metavar="NAME=COMMAND")
    parser.add_argument("--baseline", help="row name the ratios refer to (default: the first)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    rows = dict(args.rows)
    try:
        print(compare(rows, args.baseline or args.rows[0][0], runs=args.runs, warmup=args.warmup))
    except (CommandFailed, KeyError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
