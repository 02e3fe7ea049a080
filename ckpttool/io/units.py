"""A job split into units of work, run on processes (``--jobs N``) or on torchrun's ranks.

A job is a deterministic list of units, each with a weight in bytes. :func:`assign` shares
them out, the heaviest first, each to the least loaded worker (ties: the lower index), so that
every rank computes the same assignment from the same list without talking to the others.

Two backends:

* :func:`process_map`: a pool of N processes started by ``forkserver`` (``spawn`` where there
  is none; never ``fork``: a process that imported torch or started threads is not safe to
  fork). The function and its arguments are pickled, so they are module-level.
* :class:`Ranks`: the processes ``torchrun`` started, one ``torch.distributed`` process group
  on the gloo backend (CPU only). Every rank runs the same code; at each :meth:`Ranks.agree`
  they exchange what each did (a result or a :class:`Failure`), so that when one fails every
  rank stops at the same step and raises the same error, which names the rank.

Errors cross process boundaries as :class:`Failure` (a message and an exit code), raised again
as :class:`UnitError`: the same one line and exit code as the error itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import EXIT_ERROR, CkptError

#: Seconds a rank waits for the others at a step before it gives up (exit 2): how soon a
#: killed rank is noticed when its peers do not see its connection close.
TIMEOUT_ENV = "CKPTTOOL_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 300.0


def assign(weights: Sequence[int], workers: int) -> list[list[int]]:
    """The unit indices each of ``workers`` runs (each list in ascending order): heaviest unit
    first onto the least loaded worker, ties by index. Deterministic."""
    loads = [0] * workers
    shares: list[list[int]] = [[] for _ in range(workers)]
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        shares[worker].append(index)
        loads[worker] += weights[index]
    return [sorted(share) for share in shares]


def runs(weights: Sequence[int], pieces: int) -> list[tuple[int, int]]:
    """Items of these weights cut into at most ``pieces`` runs of neighbours of about equal
    weight: ``(first, stop)`` index pairs that cover every item, in order. An item of at least
    a run's share starts a run of its own, and the runs after it share out the rest."""
    total = sum(weights)
    pieces = max(1, min(pieces, len(weights)))
    bounds: list[tuple[int, int]] = []
    first = done = 0
    cut = 1  # the next run ends where the weight so far reaches cut * total / pieces
    for index, weight in enumerate(weights):
        if index > first and weight * pieces >= total > 0 and len(bounds) + 1 < pieces:
            bounds.append((first, index))  # a heavy item: not the tail of a light run
            first = index
        done += weight
        if (
            total
            and done * pieces >= total * cut
            and index + 1 < len(weights)
            and len(bounds) + 1 < pieces
        ):
            bounds.append((first, index + 1))
            first = index + 1
            cut = done * pieces // total + 1
    bounds.append((first, len(weights)))
    return bounds


@dataclass(frozen=True)
class Failure:
    """A unit's error as it crosses to another process: its line and its exit code."""

    message: str
    exit_code: int = EXIT_ERROR


class Delegated(BaseException):
    """Raised off the lead once this rank's share of the work is done and agreed: the lead
    finishes (commits, reports) and :meth:`Ranks.lead_result` hands its result to every rank."""


class UnitError(CkptError):
    """An error raised in another process or rank, raised again here with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR, *, lost: bool = False) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.lost = lost  # the other ranks were lost (one killed, or stopped answering)


def failure_of(error: BaseException) -> Failure:
    """``error`` as a :class:`Failure`: a ckptool error keeps its exit code, a disk or
    permission problem is an error (2), anything else too, with its type named."""
    if isinstance(error, CkptError):
        return Failure(str(error), error.exit_code)
    if isinstance(error, OSError):
        where = f": {error.filename}" if error.filename else ""
        return Failure(f"{error.strerror or error}{where}")
    return Failure(f"{type(error).__name__}: {error}")


def guarded(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, or its error as a :class:`Failure` (run in a worker process)."""
    try:
        return function(*args)
    except Exception as error:  # it crosses to the parent, which raises it
        return failure_of(error)


def raise_first(results: Sequence[Any], where: Callable[[int], str] | None = None) -> None:
    """Raise the first :class:`Failure` in ``results`` (``where(i)`` prefixes its line)."""
    for index, result in enumerate(results):
        if isinstance(result, Failure):
            prefix = f"{where(index)}: " if where is not None else ""
            raise UnitError(prefix + result.message, result.exit_code)


def process_map(
    function: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], workers: int
) -> list[Any]:
    """``[function(*a) for a in arguments]`` on ``workers`` processes, in order; an error in a
    worker comes back as a :class:`Failure` in its place (the caller raises it). The workers
    ignore Ctrl-C: the parent, which gets it, stops them all (SIGTERM) before it goes on, so
    that its cleanup runs once no worker writes any more."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if context.get_start_method() == "forkserver":
        # the server imports the function's module once; each worker is forked from it
        # instead of importing it again (measured: most of a worker's start-up)
        context.set_forkserver_preload([function.__module__])
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(
        min(workers, len(arguments)), mp_context=context, initializer=_start_worker
    )
    try:
        futures = [pool.submit(guarded, function, *args) for args in arguments]
        return [future.result() for future in futures]
    except BrokenProcessPool:
        raise UnitError("a worker process died (killed, or out of memory)") from None
    except BaseException:
        for process in multiprocessing.active_children():  # the pool's workers
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


#: Thread pools of the numerical libraries a worker may load (NumPy's BLAS), held to one
#: thread: a worker's work is elementwise, and N workers each starting a pool of every core's
#: threads take the cores the other workers need (measured: BLAS threads spinning).
ONE_THREAD = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _start_worker() -> None:
    """A worker process's set-up: Ctrl-C and SIGHUP ignored, SIGTERM ends it (the parent stops
    the workers, and cleans up, :func:`ckpttool.cli.app._stop_like_ctrl_c`); freed
    buffers kept for reuse (:mod:`ckpttool.io.memory`: the worker is ckpttool's own process,
    and a fresh one, so the parent's setting is not inherited); numerical libraries on one
    thread (:data:`ONE_THREAD`, where the user has not set them), before they are loaded."""
    import signal

    from ckpttool.io.memory import reuse_freed_memory

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as a closed terminal does
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler: it ends a worker
    reuse_freed_memory()
    for name in ONE_THREAD:
        os.environ.setdefault(name, "1")


# --- torchrun's ranks -----------------------------------------------------------------------


#: Set to 1 to join the ranks that ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
#: describe when this process was not started by torchrun itself (another launcher); set to 0
#: never to join (the command runs alone whatever started it).
JOIN_ENV = "CKPTTOOL_DIST"


def launched_ranks() -> tuple[int, int] | None:
    """``(rank, world size)`` when torchrun started this process as one of several ranks (or
    :data:`JOIN_ENV` is 1); else None. A process that merely inherited a training rank's
    variables (a ``ckpttool`` run from inside a training job) runs alone, as always."""
    join = os.environ.get(JOIN_ENV)
    if join == "0":
        return None
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    if world < 2 or not 0 <= rank < world:
        return None
    if join != "1" and not _parent_is_torchrun():
        return None
    return rank, world


def _parent_is_torchrun() -> bool:
    """Whether the parent process is torchrun's agent (``torchrun`` or ``python -m
    torch.distributed.run``), from its command line (:func:`parent_command`); a parent whose
    command line cannot be read is taken not to be (the command runs alone: :data:`JOIN_ENV`
    makes it join)."""
    words = parent_command()
    return any(w.endswith("torchrun") or w == "torch.distributed.run" for w in words[:4])


def parent_command(ppid: int | None = None, *, proc: str = "/proc") -> list[str]:
    """The words of the parent process's command line: from ``/proc`` (Linux), else from
    ``ps`` (macOS, the BSDs; its words split at spaces); ``[]`` where neither tells."""
    ppid = os.getppid() if ppid is None else ppid
    try:
        with open(f"{proc}/{ppid}/cmdline", "rb") as handle:
            return [w.decode("utf-8", "replace") for w in handle.read().split(b"\0") if w]
    except OSError:
        pass
    import subprocess

    try:
        found = subprocess.run(
            ["ps", "-ww", "-o", "command=", "-p", str(ppid)],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return found.stdout.split() if found.returncode == 0 else []


def timeout_seconds() -> float:
    """:data:`TIMEOUT_ENV`, or :data:`DEFAULT_TIMEOUT`."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise CkptError(f"{TIMEOUT_ENV}={text!r}: a number of seconds is expected") from None
    if value <= 0:
        raise CkptError(f"{TIMEOUT_ENV}={text!r}: must be positive")
    return value


class Ranks:
    """The ranks of this torchrun job, joined in a gloo process group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.steps = 0  # the exchanges made: every rank makes them in the same order
        self.failed = False  # an exchange has shown a failure: no more exchanges
        self.lost = False  # an exchange failed: the other ranks are gone

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, rank: int, world: int) -> Ranks:
        """Join the process group torchrun's variables describe (MASTER_ADDR, MASTER_PORT)."""
        from datetime import timedelta

        import torch.distributed as dist
        import torch.distributed.nn  # noqa: F401  (before the group: see below)

        # torch.distributed.nn (which torch.distributed.checkpoint imports: edit of a DCP
        # directory) imported once the group is up made a rank abort at exit ("terminate
        # called without an active exception") in about 4 runs of 10 on torch 2.13; imported
        # before, in none of 12 (a few milliseconds)
        seconds = timeout_seconds()
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))
        except Exception as error:  # any failure to rendezvous is one line
            raise CkptError(f"rank {rank}: could not join the other ranks: {error}") from None
        return cls(dist.get_rank(), dist.get_world_size())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def exchange(self, outcome: Any) -> list[Any]:
        """Every rank's ``outcome``, by rank. A rank that died or hangs: a :class:`UnitError`
        (exit 2) after at most the timeout."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        self.steps += 1
        try:
            dist.all_gather_object(gathered, outcome)
        except Exception as error:  # gloo's connection errors and timeouts
            self.failed = self.lost = True
            line = (
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            )
            raise UnitError(
                f"rank {self.rank}: lost the other ranks at step {self.steps} (a rank was "
                f"killed or stopped answering): {line}",
                lost=True,
            ) from None
        if any(isinstance(item, Failure) for item in gathered):
            self.failed = True
        return gathered

    def finish(self) -> None:
        """The last exchange: every rank waits here until every rank is done (rank 0 has
        printed); skipped once the others are lost."""
        if self.lost:
            return
        try:
            self.exchange(None)
        except UnitError:
            pass

    def agree(self, work: Callable[[], Any]) -> list[Any]:
        """Run ``work`` here, exchange its result (or its error) with every rank's, and return
        them by rank; if any rank failed, raise the first failure (lowest rank) on every rank."""
        try:
            outcome = work()
        except Exception as error:  # sent to every rank, raised below
            outcome = failure_of(error)
        gathered = self.exchange(outcome)
        raise_first(gathered, lambda rank: f"rank {rank}")
        return gathered

    def send_failure(self, error: BaseException) -> None:
        """After an error here that no exchange has shown yet: show it to the other ranks at
        their next exchange, so that they stop too (the error is raised by the caller)."""
        if self.failed:
            return
        try:
            self.exchange(failure_of(error))
        except UnitError:
            pass

    def lead_result(self, function: Callable[[], Any]) -> Any:
        """``function()`` on every rank (off the lead it ends with :class:`Delegated`), then the
        lead's result on every rank; an error on any rank raised on every rank."""
        try:
            result = function() if self.leads else _delegated(function)
        except BaseException as error:
            self.send_failure(error)
            raise
        return self.agree(lambda: result)[0]


def _delegated(function: Callable[[], Any]) -> Any:
    try:
        return function()
    except Delegated:
        return None


def shared_map(
    function: Callable[[Any], Any],
    items: Sequence[Any],
    weights: Sequence[int] | None = None,
    *,
    processes: bool = False,
) -> list[Any]:
    """``[function(item) for item in items]``, the same list on every rank: under torchrun,
    each rank computes its share (:func:`assign` by ``weights``, default equal) and the
    results are exchanged; else, and inside a share (a nested call), :func:`ordered_map`
    (``--jobs`` threads, or forked processes with ``processes``). Every rank must make the same calls in the same order (they are
    collective). The first error in item order is raised on every rank, naming the rank.
    Results and errors cross processes: they must pickle."""
    from ckpttool.io.parallel import ordered_map

    ranks = _current
    if ranks is None or _inside:
        return ordered_map(function, items, processes=processes)
    share = assign(list(weights) if weights is not None else [1] * len(items), ranks.world)
    mine = share[ranks.rank]

    def work() -> list[tuple[int, Any]]:
        global _inside
        _inside = True
        try:
            done: list[tuple[int, Any]] = []
            for index in mine:  # stops at the first error, as a loop would
                try:
                    done.append((index, function(items[index])))
                except Exception as error:  # sent to every rank, raised in item order
                    done.append((index, failure_of(error)))
                    break
            return done
        finally:
            _inside = False

    gathered = ranks.exchange(work())
    found: dict[int, Any] = {}
    where: dict[int, int] = {}
    for rank, done in enumerate(gathered):
        if isinstance(done, Failure):  # the rank failed outside this map
            raise UnitError(f"rank {rank}: {done.message}", done.exit_code)
        for index, result in done:
            found[index] = result
            where[index] = rank
    for index in sorted(found):
        if isinstance(found[index], Failure):
            failure = found[index]
            raise UnitError(f"rank {where[index]}: {failure.message}", failure.exit_code)
    return [found[index] for index in range(len(items))]


def lead_only() -> None:
    """Under torchrun, off rank 0: raise :class:`Delegated` (what follows is rank 0's alone:
    work that is not shared, done once)."""
    if _current is not None and not _current.leads:
        raise Delegated


def from_lead(value: Any) -> Any:
    """Under torchrun, rank 0's ``value`` on every rank (a collective call); else ``value``."""
    if _current is None:
        return value
    return _current.agree(lambda: value)[0]


_inside = False  # in a rank's share of a shared_map: nested maps run here
_current: Ranks | None = None


def current() -> Ranks | None:
    """The ranks this process runs among (set by the command line under torchrun), or None."""
    return _current


def sharing() -> Ranks | None:
    """The ranks a collective call made here is made among: None off torchrun, and inside a
    rank's share of a :func:`shared_map` (where each rank works on its own items)."""
    return None if _inside else _current


def set_current(ranks: Ranks | None) -> None:
    global _current
    _current = ranks
