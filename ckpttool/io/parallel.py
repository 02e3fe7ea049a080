"""``--jobs N``: a directory checkpoint's members worked on by N threads, results in order.

The heavy parts of checking a member release the GIL (reading, ISA-L's CRC-32), so threads
suffice; a long pickle walk (scan) holds it, and runs on forked processes where that is safe
(``processes=True``). :func:`ordered_map` gives exactly what a loop would: results in the items' order, and
the first error in that order raised (the others' work is dropped), so a report, and an error
line, are the same with any N. A worker's own calls to :func:`ordered_map` run in that worker,
one after the other: N threads at most, and memory at most N times what one member's check
holds (its read block). :func:`jobs` is the N in force: what :func:`using` set (the CLI's
``--jobs``), else the CPU count.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

_setting = threading.local()  # jobs set by using(); a worker thread sees 1


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    counted = getattr(os, "process_cpu_count", None)  # Python 3.13
    if counted is not None:
        return max(1, counted() or 1)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def jobs() -> int:
    """The number of threads :func:`ordered_map` uses here."""
    value = getattr(_setting, "jobs", None)
    return cpu_count() if value is None else value


def chosen() -> int | None:
    """What :func:`using` set here (the CLI's ``--jobs``), or None: the commands whose threads
    each hold much memory (average, merge) use one thread unless asked for more, and convert
    uses processes only where asked."""
    value: int | None = getattr(_setting, "jobs", None)
    return value


@contextmanager
def using(count: int | None) -> Iterator[None]:
    """Within this block (this thread), :func:`ordered_map` uses ``count`` threads (None: the
    CPU count)."""
    if count is not None and count < 1:
        raise ValueError(f"jobs must be at least 1, not {count}")
    previous = getattr(_setting, "jobs", None)
    _setting.jobs = count
    try:
        yield
    finally:
        _setting.jobs = previous


def _in_worker(function: Callable[[Item], Result]) -> Callable[[Item], Result]:
    def run(item: Item) -> Result:
        _setting.jobs = 1  # nested maps run in this worker: N threads in all
        return function(item)

    return run


def ordered_map(
    function: Callable[[Item], Result],
    items: Sequence[Item],
    *,
    processes: bool = False,
    stop: threading.Event | None = None,
) -> list[Result]:
    """``[function(item) for item in items]`` on :func:`jobs` threads: the same results in the
    same order, and the same first error (the one of the earliest item that fails).

    ``processes``: on :func:`jobs` forked processes instead, where the work is Python that
    holds the GIL (scan's pickle walks) and a fork is safe here (:func:`_can_fork`), else on
    threads. The results must pickle; ``function`` and ``items`` are inherited, not sent.
    ``stop`` (threads): set when the map ends with an error or Ctrl-C, before it waits for the
    items running, so that long ones that look at it end early."""
    count = min(jobs(), len(items))
    if count <= 1:
        return [function(item) for item in items]
    if processes and _can_fork():
        return _forked_map(function, items, count)
    pool = ThreadPoolExecutor(count, thread_name_prefix="ckpttool-jobs")
    try:
        futures = [pool.submit(_in_worker(function), item) for item in items]
        return [future.result() for future in futures]
    except BaseException:
        if stop is not None:
            stop.set()
        raise
    finally:  # after an error or Ctrl-C: items not started are dropped, running ones end
        pool.shutdown(wait=True, cancel_futures=True)


# -- forked workers -------------------------------------------------------------------------
# Measured in bench/README.md (issue 43, "threads or a fork pool"): a fork costs a few
# milliseconds where a spawned worker re-imports ckpttool; on a long pickle walk two forked
# workers beat two threads, which contend for the GIL.

_forked: tuple[Callable[[Any], Any], Sequence[Any]] | None = None  # set before the fork


def _can_fork() -> bool:
    """A fork copies only the calling thread: safe while this process runs no other thread
    (a progress bar's, a reader's) and has not imported torch (its thread pools and locks).
    Linux only: macOS's system libraries are not safe across a fork (Python spawns there)."""
    import multiprocessing
    import sys

    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and "torch" not in sys.modules
        and threading.active_count() == 1
    )


def _start_worker() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which ends them
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as a closed terminal does
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler: it ends a worker
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (blocked at the fork)
    _setting.jobs = 1  # nested maps run in this worker


def _call_forked(index: int) -> Any:
    assert _forked is not None
    function, items = _forked
    return function(items[index])


def _forked_map(
    function: Callable[[Item], Result], items: Sequence[Item], count: int
) -> list[Result]:
    import multiprocessing
    import signal
    from concurrent.futures import ProcessPoolExecutor

    global _forked
    _forked = (function, items)
    pool = ProcessPoolExecutor(
        count, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker
    )
    try:
        # the first submit forks every worker, then starts the pool's thread: a Ctrl-C there
        # would land in an at-fork hook, which drops it; held until all is started instead
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            futures = [pool.submit(_call_forked, index) for index in range(len(items))]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        results = []
        for index, future in enumerate(futures):
            try:
                results.append(future.result())
            except Exception:
                # the earliest failing item, run again here: its own error, as a loop raises
                # it (one a worker raised may not survive the pickling back, or be its pipe's)
                results.append(function(items[index]))
                raise
        return results
    finally:  # after an error or Ctrl-C: items not started are dropped, running ones end
        pool.shutdown(wait=True, cancel_futures=True)
        _forked = None


def serialized(callback: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """``callback`` (a progress bar's advance) made safe to call from several threads."""
    if callback is None:
        return None
    lock = threading.Lock()

    def call(*args: Any) -> Any:
        with lock:
            return callback(*args)

    return call


class AheadMap(Generic[Item, Result]):
    """``function(item)`` for ``items``, which will be asked for in this order (:meth:`take`),
    computed up to ``depth`` items ahead on ``workers`` threads: reading the next tensors while
    this one is written. An item asked for out of turn is computed on the spot; an error is
    raised when its item is taken, so in the order a loop would raise it. Memory: ``depth``
    results held at most."""

    def __init__(
        self, function: Callable[[Item], Result], items: Sequence[Item], workers: int, depth: int
    ) -> None:
        from collections import deque

        self._function = function
        self._items = iter(items)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="ckpttool-jobs")
        self._pending: deque[tuple[Item, Any]] = deque()
        for _ in range(depth):
            self._submit()

    def _submit(self) -> None:
        for item in self._items:
            self._pending.append((item, self._pool.submit(_in_worker(self._function), item)))
            return

    def take(self, item: Item) -> Result:
        if self._pending and self._pending[0][0] is item:
            _, future = self._pending.popleft()
            self._submit()
            result: Result = future.result()
            return result
        return self._function(item)

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def read_ahead(iterator: Iterator[Item], depth: int) -> Iterator[Item]:
    """``iterator``'s items, in order, produced up to ``depth`` ahead on a thread of its own
    (``depth`` < 1: on the caller's). Its error is raised where the loop would meet it."""
    if depth < 1:
        yield from iterator
        return
    from collections import deque

    pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-ahead")
    done = object()

    def step() -> Any:
        return next(iterator, done)

    pending = deque(pool.submit(step) for _ in range(depth))
    try:
        while True:
            value = pending.popleft().result()
            if value is done:
                return
            pending.append(pool.submit(step))
            yield value
    finally:  # the consumer stopped (an error, or it has what it needs): no more steps
        pool.shutdown(wait=True, cancel_futures=True)
