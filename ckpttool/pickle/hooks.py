"""What a format may hand the walker: a fast path for objects only it knows (:class:`CompactCall`).

The walker names no format. A format whose pickles hold many objects of a few known classes
(DCP's ``.metadata``: a dozen objects and 70 opcodes per chunk entry) may read each such object
in one step into a compact record of its own, by handing the walker a :class:`CompactCall`:
``load_pickle(data, compact=HOOK)`` or ``SafeUnpickler(data, compact=HOOK)``. The order of calls:

1. The walker walks as ever. When a memo GET fetches a :class:`~ckpttool.model.records.GlobalRef`
   whose module is in ``HOOK.modules`` (the only per-opcode cost, paid only where a hook was
   given), it calls ``HOOK.call(unpickler, raw, pos, cls)``: ``raw`` the pickle's bytes,
   ``pos`` the offset just past the GET, ``cls`` the class fetched.
2. The call either reads the object's whole opcode sequence and returns ``(offset past it,
   record)``, having appended to ``unpickler.memo_list`` what those opcodes would have memoized
   (:data:`ELIDED` for the objects the record replaces) and added one to
   ``unpickler.compacts``; or returns ``None`` having changed nothing (the general loop then
   reads the bytes). It may keep state across calls in ``unpickler.call_state`` (a dict, fresh
   per walk). The walker counts ``HOOK.opcodes`` opcodes per record for its periodic checks.
3. A record is an instance of one of ``HOOK.records`` and carries what ``finalize`` would have
   counted for the objects it replaces: ``nodes``, ``depth`` and ``shared`` (objects it refers
   to that ``finalize`` must still visit).
4. A record is only equivalent where the general loop's objects would have been left alone. The
   walker raises :class:`Redo` where they would not (a memo GET of :data:`ELIDED`, a call given
   a record, a record reached twice by ``finalize``); that, or any error in a walk that made
   records, makes the walker throw the walk away and do it again without the hook, within the
   same time budget: a file reads the same, error for error, with or without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Redo(Exception):
    """A compact record cannot stand for the objects it replaced: walk again without them."""


class _Elided:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<elided>"


#: What the memo holds for an object a compact record replaced (a GET of it means ``Redo``).
ELIDED = _Elided()


@dataclass(frozen=True)
class CompactCall:
    """A format's fast path for the objects of a few classes (see the module docstring)."""

    modules: frozenset[str]  # the modules of the classes it reads (the walker's cheap test)
    opcodes: int  # what one record counts towards the walker's periodic checks
    records: tuple[type, ...]  # the record types it makes
    call: Callable[[Any, bytes, int, Any], tuple[int, Any] | None]


__all__ = ["ELIDED", "CompactCall", "Redo"]
