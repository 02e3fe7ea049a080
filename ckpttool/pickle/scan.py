"""``scan``'s walk of one pickle: every global it names, counted, in scan mode (nothing refused
but an attack on the walker itself), and what a linear read finds past where a walk stopped.

Format-agnostic: each format's scan hook (:meth:`ckpttool.formats.base.FileFormat.scan`) hands
it the pickles ``torch.load`` would run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ckpttool.errors import CkptError, UnsafePickleError
from ckpttool.model.records import StorageRecord
from ckpttool.pickle.interpreter import PickleResult, SafeUnpickler
from ckpttool.pickle.names import linear_globals
from ckpttool.pickle.policy import Verdict, classify_global, python3_name

#: The globals a checkpoint's pickles name, counted, and how the pickles wrote the renamed ones.
Counts = Counter[tuple[str, str, Verdict]]
Written = dict[tuple[str, str], tuple[str, str]]

_STORAGE = StorageRecord("?", "uint8", 0, "cpu", "", 0)  # storages are not read here


def persistent_placeholder(pid: Any) -> Any:
    """What a persistent id stands for in a scan: a storage, or, for a legacy file's
    ``('module', class, source file, source)``, the class (torch.load returns it; the pickle
    then calls it, and its name is already among the globals)."""
    if isinstance(pid, tuple) and len(pid) > 1 and pid[0] == "module":
        return pid[1]
    return _STORAGE


def add_linear_globals(counts: Counts, data: bytes, start: int) -> None:
    """Add to ``counts`` the globals a linear read of the pickle at ``start`` finds that the
    walk, stopped early, did not (:func:`ckpttool.pickle.names.linear_globals`)."""
    known = {(module, name) for module, name, _ in counts}
    # the protocol its PROTO opcode declares (0 without one): it decides Python 2's names
    protocol = (
        data[start + 1] if data[start : start + 1] == b"\x80" and len(data) > start + 1 else 0
    )
    for written_module, written_name in linear_globals(data, start):
        module, name = python3_name(written_module, written_name, protocol)
        if (module, name) not in known:
            known.add((module, name))
            counts[(module, name, classify_global(module, name))] += 1


def tally(counts: Counts, written: Written, result: PickleResult) -> None:
    counts.update(result.globals_seen)
    written.update(result.renamed)


def walk_globals(data: bytes, written: Written) -> tuple[Counts, str | None, str | None]:
    """Globals named by one pickle (their Python 2 spellings into ``written``); an attack found
    in it; why it stopped early."""
    unpickler = SafeUnpickler(data, persistent_load=persistent_placeholder, refuse_dangerous=False)
    attack = problem = None
    try:
        unpickler.load()
    except UnsafePickleError as error:  # BUILD on a global: an attack even in scan mode
        attack = str(error)
    except CkptError as error:
        problem = f"pickle not fully readable: {error}"
    counts: Counts = Counter()
    tally(counts, written, unpickler.result)
    if attack or problem:  # what torch.load may still import past the point the walk stopped
        add_linear_globals(counts, data, 0)
    return counts, attack, problem


#: A legacy torch.save stream's pickles: magic number, protocol, system info, the object, keys.
STREAM_PICKLES = 5


def walk_stream_globals(data: bytes, written: Written) -> tuple[Counts, str | None, str | None]:
    """:func:`walk_globals` over the consecutive pickles of ``data`` (at most
    ``STREAM_PICKLES``: a legacy ``torch.save`` stream's; a bare pickle is one), for bytes a
    loader hands to ``torch.load`` when they are not a zip."""
    counts: Counts = Counter()
    start = 0
    for _ in range(STREAM_PICKLES):
        unpickler = SafeUnpickler(
            data, start, persistent_load=persistent_placeholder, refuse_dangerous=False
        )
        try:
            result = unpickler.load()
        except UnsafePickleError as error:
            tally(counts, written, unpickler.result)
            add_linear_globals(counts, data, start)
            return counts, str(error), None
        except CkptError as error:
            tally(counts, written, unpickler.result)
            add_linear_globals(counts, data, start)
            return counts, None, f"pickle not fully readable: {error}"
        tally(counts, written, result)
        start = result.end
        if start >= len(data):
            break
    return counts, None, None


__all__ = [
    "Counts",
    "Written",
    "add_linear_globals",
    "persistent_placeholder",
    "tally",
    "walk_globals",
    "walk_stream_globals",
]
