"""A ``--jobs`` worker process (:func:`ckpttool.io.units.process_map`) is set up as ckpttool's
own process: freed tensor-sized buffers are kept for reuse (a fresh process does not inherit
the parent's allocator setting), and the numerical libraries' thread pools hold one thread
(N workers each starting a pool of every core's threads took the cores the others needed)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from ckpttool.io import units
from tests.support.timeouts import scaled

ROOT = Path(__file__).parent.parent

BUFFER = 33 << 20  # over glibc's default mmap threshold: unmapped on free unless told
ROUNDS = 20
PAGES = ROUNDS * BUFFER // 4096


def faults_of_fresh_buffers(_: int) -> tuple[int, dict[str, str | None]]:
    """In a worker: page faults of ROUNDS buffers of BUFFER bytes, each freed before the next;
    and the thread settings the worker sees."""
    buffer = bytearray(BUFFER)  # the first faults its pages in either way
    del buffer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(ROUNDS):
        buffer = bytearray(BUFFER)  # zero-filled: every page touched
        del buffer
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults, {name: os.environ.get(name) for name in units.ONE_THREAD}


SCRIPT = """
import json
from ckpttool.io import units
from tests.test_worker_setup import faults_of_fresh_buffers
print(json.dumps(units.process_map(faults_of_fresh_buffers, [(0,), (1,)], 2)))
"""


def test_a_worker_reuses_freed_buffers_and_runs_libraries_on_one_thread() -> None:
    """In a fresh interpreter (its workers' environment is that of the forkserver it starts)."""
    env = {k: v for k, v in os.environ.items() if k not in units.ONE_THREAD}
    env.update(OMP_NUM_THREADS="3", PYTHONPATH=str(ROOT))  # the user's own setting is kept
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=scaled(120), check=True,
    )  # fmt: skip
    for faults, threads in json.loads(done.stdout):
        assert faults < PAGES // 10, faults
        assert threads == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "3",
                           "MKL_NUM_THREADS": "1"}  # fmt: skip


def test_without_the_set_up_a_fresh_process_faults_every_buffer_in() -> None:
    """The control: the same count in this process's own kind of fresh child, without it."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        faults, _ = pool.apply(faults_of_fresh_buffers, (0,))
    assert faults >= PAGES // 2, faults
