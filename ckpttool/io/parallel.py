"""``--jobs N``: a directory checkpoint's members worked on by N threads, results in order.

The heavy parts of checking a member release the GIL (reading, ISA-L's CRC-32), so threads
suffice. :func:`ordered_map` gives exactly what a loop would: results in the items' order, and
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


def ordered_map(function: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
    """``[function(item) for item in items]`` on :func:`jobs` threads: the same results in the
    same order, and the same first error (the one of the earliest item that fails)."""
    count = min(jobs(), len(items))
    if count <= 1:
        return [function(item) for item in items]
    pool = ThreadPoolExecutor(count, thread_name_prefix="ckpttool-jobs")
    try:
        futures = [pool.submit(_in_worker(function), item) for item in items]
        return [future.result() for future in futures]
    finally:  # after an error or Ctrl-C: items not started are dropped, running ones end
        pool.shutdown(wait=True, cancel_futures=True)


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
