"""Commands under ``torchrun``: the ranks joined, the work shared, one report printed.

A command that shares its work over torchrun's ranks (``convert``, ``verify``, ``scan``,
``edit``) is wrapped by :func:`on_ranks`. Every other command (``show``, ``diff``, ``trend``,
``average``...) runs on rank 0 alone: the other ranks exit 0 at once, without reading or
writing anything and without joining a process group (:func:`runs_alone_off_lead`), so that
a report is printed once and an output is written once. When torchrun's variables say there are several ranks,
the ranks join one gloo process group (:class:`ckpttool.io.units.Ranks`); rank 0 prints the
report and every error, once (the error names the rank it happened on); the other ranks print
nothing (no progress bar) and exit with the same code. A rank that loses the others (one was
killed) says so on its stderr and exits 2.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Seconds a failing rank other than 0 waits after rank 0 let it go, before it exits.
LEAD_GRACE = 1.0


def on_ranks(command: F) -> F:
    """Run ``command`` as one rank of torchrun's job when there is one (see the module doc)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from ckpttool.io import units

        launched = units.launched_ranks()
        if launched is None:
            return command(*args, **kwargs)
        ranks = units.Ranks.join(*launched)
        units.set_current(ranks)
        try:
            if ranks.leads:
                return _leading(ranks, command, args, kwargs)
            return _quietly(ranks, command, args, kwargs)
        finally:
            units.set_current(None)
            ranks.close()

    run.shares_ranks = True  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def shares_ranks(callback: Callable[..., Any] | None) -> bool:
    """Whether a command's callback is wrapped by :func:`on_ranks` (through any wrappers
    made with :func:`functools.wraps`, which copy the mark)."""
    return bool(getattr(callback, "shares_ranks", False))


def runs_alone_off_lead(callback: Callable[..., Any] | None) -> bool:
    """Whether this process is a rank other than 0 of a torchrun job and the command does not
    share its work over ranks: then it has nothing to do (rank 0 does the whole command)."""
    from ckpttool.io import units

    if shares_ranks(callback):
        return False
    launched = units.launched_ranks()
    return launched is not None and launched[0] != 0


def lead_result(function: Callable[[], Any]) -> Any:
    """Under torchrun, ``function()`` on every rank and rank 0's result on all; else just
    ``function()``."""
    from ckpttool.io import units

    ranks = units.current()
    if ranks is None:
        return function()
    return ranks.lead_result(function)


def _leading(ranks: Any, command: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Rank 0: the command, its report or its error line, then the others let go (so that
    torchrun sees rank 0 end first, with its own exit code, and stops nobody)."""
    from ckpttool.errors import CkptError

    try:
        result = command(*args, **kwargs)
    except CkptError as error:
        sys.stdout.flush()
        print("Error: " + " ".join(str(error).split()), file=sys.stderr, flush=True)
        ranks.finish()
        raise SystemExit(error.exit_code) from None
    except SystemExit:  # a verdict's exit code (verify: 1, found)
        sys.stdout.flush()
        ranks.finish()
        raise
    ranks.finish()
    return result


def _quietly(ranks: Any, command: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Off rank 0: no report, no progress bar, no error line (rank 0 prints it), the same exit
    code, after rank 0 has ended; only a lost connection to the others is said here, where rank
    0 may be gone."""
    from ckpttool.errors import CkptError
    from ckpttool.io.units import UnitError

    stdout, stderr = sys.stdout, sys.stderr
    code: int | None = None
    result = None
    with open(os.devnull, "w") as null:
        sys.stdout = sys.stderr = null
        try:
            result = command(*args, **kwargs)
        except UnitError as error:
            if error.lost:
                print(f"Error: {error}", file=stderr)
            code = error.exit_code
        except CkptError as error:
            code = error.exit_code
        except SystemExit as stop:  # the same verdict as rank 0's
            code = stop.code if isinstance(stop.code, int) else 2
        finally:
            sys.stdout, sys.stderr = stdout, stderr
    ranks.finish()
    if code:
        time.sleep(LEAD_GRACE)  # rank 0 ends first: torchrun names it, with its error, first
    if code is not None:
        raise SystemExit(code)
    return result
