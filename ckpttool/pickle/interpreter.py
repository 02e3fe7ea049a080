"""A pickle reader that runs nothing: the allow-list walker every torch format shares.

``pickle.Unpickler`` imports whatever module a pickle names and calls whatever it is told to;
that is how a checkpoint runs ``os.system``. This module interprets the opcodes itself instead.
A ``GLOBAL`` becomes a :class:`~ckpttool.model.records.GlobalRef` (a name, never imported). Calls
(``REDUCE``, ``NEWOBJ``, ``INST``, ``OBJ``) are *emulated* for a short allow-list of data
constructs (tensor rebuilders, ``OrderedDict``, NumPy arrays and scalars, ``set``...); any other
call yields an :class:`~ckpttool.model.records.OpaqueObject` that records the class name and
arguments. Names that only make sense as an attack (``os.system``, ``builtins.eval``...) are
refused outright. ``BUILD`` is applied only to objects this reader created. What is emulated
lives in :mod:`ckpttool.pickle.emulation`, what is refused in :mod:`ckpttool.pickle.policy`.

Resources are bounded: every length prefix is checked against the bytes that remain (a
``BINBYTES8`` claiming a terabyte fails at once), the memo is a list for the
indices torch.save uses (0, 1, 2...) and a dict past its end (``LONG_BINPUT 0x7fffffff`` costs
one entry), nesting depth and the size of the expanded tree are capped, and
an object that refers back to one containing it (a parent link) becomes a
:class:`~ckpttool.model.records.BackReference` leaf, so the tree every consumer walks has no cycle.
"""

from __future__ import annotations

import codecs
import gc
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import (
    CkptError,
    CorruptCheckpointError,
    ResourceLimitError,
    TruncatedPickleError,
    UnsafePickleError,
)
from ckpttool.model.records import (
    BackReference,
    CalledObject,
    GlobalRef,
    NumpyDtypeText,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    TorchDtypeText,
)
from ckpttool.pickle.callables import ContextualUses, is_contextual
from ckpttool.pickle.emulation import (
    NdarrayBuilder,
    NumpyDtype,
    TorchDtype,
    TorchLayout,
    emulate_call,
    global_value,
    set_state,
)
from ckpttool.pickle.frames import ambiguous, check_frame, ends_an_opcode
from ckpttool.pickle.hooks import ELIDED, CompactCall, Redo
from ckpttool.pickle.inert import CLASS, inert_kind
from ckpttool.pickle.policy import UNRESOLVED, Verdict, classify_global, python3_name
from ckpttool.pickle.tensor_call import OPCODES as TENSOR_CALL_OPCODES
from ckpttool.pickle.tensor_call import tensor_call

MAX_DEPTH = 200  # nesting of containers; real checkpoints stay under 20
MAX_NODES = 20_000_000  # nodes of the fully expanded tree (shared references counted each time)
# Every object a pickle creates costs it bytes; what it refers to again (memo GET, DUP) is
# free, and every consumer (show's table, --json, diff) then expands it once per reference: a
# 3 KB "billion laughs" list became 19 million nodes, a 1.4 KB file 100,000 tensors. Real
# checkpoints refer again to little (a tied weight, a shared config dict), so the nodes reached
# a second time are bounded by REUSE_BASE + (pickle bytes) // REUSE_BYTES. Strings and bytes
# weigh one node per 64 bytes, so a large string referred to 10,000 times counts as such.
REUSE_BASE = 10_000
REUSE_BYTES = 16
MAX_SECONDS = 60.0  # wall-clock budget for one pickle
MAX_STACK = 1_000_000  # items on the stack (checked every CHECK_EVERY opcodes)
MAX_MARKS = MAX_DEPTH * 10  # MARKs open at once
CHECK_EVERY = 16_384  # opcodes between checks of the clock and the stack's size
#: Whether walkers read tensor calls with ``tensor_call`` and a format's objects with the
#: :class:`~ckpttool.pickle.hooks.CompactCall` it hands them unless told (the differential tests turn it off to compare every reader's output
#: with and without them).
FAST_PATH = True


@dataclass
class ItemSpan:
    """Where one item of the top-level dict sits in the pickle bytes (for in-place edits)."""

    key: Any
    key_start: int
    value_start: int
    value_end: int


@dataclass
class PickleResult:
    root: Any
    end: int  # offset just past STOP
    # (module, name, verdict) of each global the pickle names, in order, by its Python 3 name
    globals_seen: list[tuple[str, str, Verdict]] = field(default_factory=list)
    # (module, name) of globals_seen -> as the pickle wrote it, where that differs (``__builtin__
    # long`` in protocol 2 is ``builtins.int``: ``policy.python3_name``)
    renamed: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    root_items: list[ItemSpan] = field(default_factory=list)
    stop_at: int = -1  # offset of the STOP opcode
    frames: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) of FRAME ops
    memo_puts: dict[int, int] = field(default_factory=dict)  # memo index -> offset of its PUT
    memo_gets: list[tuple[int, int]] = field(default_factory=list)  # (memo index, offset)
    # opaque objects (OpaqueObject, subclasses included) in ``root``, each counted once: none,
    # and no question about objects needs a walk of the tree (bench/object_table.py); -1 until
    # finalize counted them
    objects: int = -1


PersistentLoad = Callable[[Any], Any]

_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_F64 = struct.Struct(">d").unpack_from


#: What a call may make that ``BUILD`` may later set state on (``SafeUnpickler.created``).
_MUTABLE = (dict, list, set, OpaqueObject, NdarrayBuilder, NumpyDtype)


def _verdict_of(qualname: str) -> Verdict:
    module, _, name = qualname.rpartition(".")
    return classify_global(module, name)


def _refused(qualname: str) -> UnsafePickleError:
    return UnsafePickleError(
        f"refusing to read: the pickle calls {qualname}, which can run code or "
        "touch your system (nothing was run). Do not load this file with torch.load; "
        "`ckpttool scan` lists everything it references"
    )


def _bad(pos: int, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"invalid pickle at byte {pos}: {what}")


class SafeUnpickler:
    """Interprets one pickle in ``data`` starting at ``start``. See the module docstring.

    ``refuse_dangerous=False`` records dangerous globals instead of raising (for ``scan``).
    """

    def __init__(
        self,
        data: bytes | memoryview,
        start: int = 0,
        *,
        persistent_load: PersistentLoad | None = None,
        refuse_dangerous: bool = True,
        track_spans: bool = False,
        fast_path: bool | None = None,
        compact: CompactCall | None = None,
    ) -> None:
        self.data = memoryview(data)
        # text opcodes search for their newline in the bytes themselves (memoryview has no
        # find); copying a window per line made protocol-0 pickles quadratic to read
        self.raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.start = start
        self.persistent_load = persistent_load
        self.refuse_dangerous = refuse_dangerous
        self.track_spans = track_spans
        # tensors read by ``tensor_call``, a format's objects by its ``compact`` hook (off: every opcode
        # through the general loop; the differential tests compare both; span tracking needs
        # the general loop)
        self.fast_path = FAST_PATH if fast_path is None else fast_path
        # ``compact`` (:mod:`ckpttool.pickle.hooks`): only where a format hands one (DCP's
        # .metadata, whose reader knows its records: in any other tree they would stand where
        # readers expect the general loop's objects); off for a redo
        self.compact = compact if self.fast_path and not track_spans else None
        self._reset()

    def _reset(self) -> None:
        """The walk's state, fresh (``__init__``, and a walk done again without ``compact``)."""
        self.pos = self.start
        self.protocol = 0  # as the last PROTO opcode said (none: 0), for ``python3_name``
        self.compacts = 0  # records the ``compact`` hook made
        self.call_state: dict[str, Any] = {}  # the hook's own state for this walk
        self.overwrites = 0  # PUTs onto a memo index already PUT (layouts check it)
        self.layouts: list[Any] = []  # ``tensor_call``'s layouts for this pickle
        self.shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # and its shared shapes
        self.stack: list[Any] = []
        self.starts: list[int] = []  # byte offset where each stack item began
        self.metastack: list[tuple[list[Any], list[int], int]] = []
        # The memo in two parts. Pickles number their memo entries 0, 1, 2...: those live in a
        # list (8 bytes an entry; a dict of int keys took ~60 bytes, 50 MB at 100,000 tensors).
        # An index past the list's end goes to a dict, so LONG_BINPUT 0x7fffffff still costs
        # one entry. The list is authoritative below its length: growing it onto an index the
        # dict holds moves that entry out of the dict (``_memo_put``).
        self.memo_list: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.created: set[int] = set()  # ids of objects BUILD may touch (made by this reader)
        # the FRAME the walk is in (-1: none) and where the loop next stops to look: the end
        # of the data, or the frame's, whose end must fall between two opcodes (frames.py)
        self.frame_pos = self.frame_end = -1
        self.limit = len(self.data)
        self.result = PickleResult(root=None, end=self.start)
        self.contextual = ContextualUses(
            self.result.globals_seen, Verdict.SAFE, Verdict.DANGEROUS, Verdict.UNKNOWN,
            classify_global,
        )  # fmt: skip
        # globals a call makes dangerous (unknown ones, classes known inert only as data):
        # id(ref) -> (ref, its entry in globals_seen); and the entries by qualname, for BUILD
        self.judged: dict[int, tuple[GlobalRef, int]] = {}
        self.judged_names: dict[str, list[int]] = {}

    # -- reading primitives ---------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise TruncatedPickleError(
                f"pickle truncated or corrupt: an item at byte {self.pos} claims {n:,} bytes "
                f"but only {len(self.data) - self.pos:,} remain"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _line(self) -> bytes:
        end = self.raw.find(b"\n", self.pos, self.pos + 65536)
        if end < 0:
            if len(self.data) - self.pos < 65536:
                raise TruncatedPickleError("pickle truncated inside a text line")
            raise _bad(self.pos, "unterminated text line")
        line = bytes(self.raw[self.pos : end])
        self.pos = end + 1
        return line

    def _u(self, fmt: str, n: int) -> int:
        return int(struct.unpack(fmt, self._take(n))[0])

    # -- stack helpers --------------------------------------------------------------------
    def _push(self, value: Any, start: int) -> None:
        # the stack's size is checked every few thousand opcodes in load()
        self.stack.append(value)
        self.starts.append(start)

    def _pop(self) -> tuple[Any, int]:
        if not self.stack:
            raise _bad(self.pos, "stack underflow")
        return self.stack.pop(), self.starts.pop()

    def _pop_mark(self) -> tuple[list[Any], list[int], int]:
        if not self.metastack:
            raise _bad(self.pos, "no MARK on the stack")
        items, starts = self.stack, self.starts
        self.stack, self.starts, mark_pos = self.metastack.pop()
        return items, starts, mark_pos

    def _new(self, obj: Any) -> Any:
        self.created.add(id(obj))
        return obj

    # -- globals and calls ----------------------------------------------------------------
    def _global(self, written_module: str, written_name: str) -> Any:
        module, name = python3_name(written_module, written_name, self.protocol)
        if (module, name) != (written_module, written_name):
            self.result.renamed[module, name] = (written_module, written_name)
        verdict = classify_global(module, name)
        self.result.globals_seen.append((module, name, verdict))
        if is_contextual(f"{module}.{name}"):  # partial, getattr: settled by their uses
            ref = GlobalRef(module, name)
            self.contextual.named(ref, verdict)
            return ref
        if verdict is Verdict.DANGEROUS and self.refuse_dangerous:
            raise _refused(f"{module}.{name}")
        value = global_value(module, name)
        self._judge_by_effect(value, verdict)
        return value

    def _judge_by_effect(self, ref: Any, verdict: Verdict) -> None:
        """Remember a global named last (the last entry of ``globals_seen``) whose verdict a
        call of it changes: an unknown one, or a class known inert only as data."""
        if isinstance(ref, GlobalRef) and (
            verdict is Verdict.UNKNOWN
            or (verdict is Verdict.SAFE and inert_kind(ref.qualname) == CLASS)
        ):
            index = len(self.result.globals_seen) - 1
            self.judged[id(ref)] = (ref, index)
            self.judged_names.setdefault(ref.qualname, []).append(index)

    def _called(self, index: int) -> None:
        """The global at ``globals_seen[index]`` is called: it runs whatever it does."""
        module, name, _ = self.result.globals_seen[index]
        self.result.globals_seen[index] = (module, name, Verdict.DANGEROUS)

    def unresolved(self, what: str) -> GlobalRef:
        """What a static reading cannot resolve (an ``EXT1`` code, a name computed at load
        time, a call of an object the pickle built): a dangerous pseudo-global
        ``<unresolved>.WHAT``, and a name the walk goes on with."""
        self.result.globals_seen.append((UNRESOLVED, what, Verdict.DANGEROUS))
        return GlobalRef(UNRESOLVED, what)

    def call(self, func: Any, args: Any, new: bool = False, effect: bool = True) -> Any:
        """What ``func(*args)`` builds (``new``: ``NEWOBJ``'s ``func.__new__(func, *args)``).
        ``effect``: the opcode runs ``func`` (``REDUCE``, ``NEWOBJ_EX`` with keywords,
        ``OBJ``/``INST`` with arguments), which makes an unknown ``func`` dangerous; ``NEWOBJ``
        and an argument-less ``OBJ`` only construct."""
        if not isinstance(args, tuple):
            raise _bad(self.pos, "call arguments are not a tuple")
        if not isinstance(func, GlobalRef):
            if not self.refuse_dangerous:  # scan: what it runs cannot be known statically
                self.unresolved(f"a call of an object the pickle built ({type(func).__name__})")
            if not isinstance(func, OpaqueObject):
                if self.refuse_dangerous:
                    raise _bad(self.pos, f"call of a non-global ({type(func).__name__})")
                return OpaqueObject(UNRESOLVED, ())
            # an object the file built, called (cloudpickle's ``_builtin_type('MethodType')``):
            # nothing is called; what it would build is as opaque as what it was built from
            result = CalledObject(f"{func.cls}(...)", (func, *args), new=new)
            self.created.add(id(result))
            return result
        if self.compacts and _holds_compact(args, self._records()):
            raise Redo  # the emulation would have seen the objects a record replaced
        if self.contextual.refs:
            resolved = self.contextual.call(func, args, _verdict_of)
            if resolved is not None:  # getattr(namespace, 'name'): the global it names
                self._judge_by_effect(resolved, self.result.globals_seen[-1][2])
                return resolved
            if self.refuse_dangerous and self.contextual.refused(func):
                raise _refused(func.qualname)
        if effect and self.judged:
            judged = self.judged.get(id(func))
            if judged is not None and judged[0] is func:
                self._called(judged[1])
        result = emulate_call(self.call, func, args)
        if isinstance(result, _MUTABLE):  # what BUILD may then touch
            self.created.add(id(result))
            if result.__class__ is OpaqueObject and result.new is None:
                result.new = new  # REDUCE or NEWOBJ: written back the same way
        return result

    def _records(self) -> tuple[type, ...]:
        """The record types the ``compact`` hook makes (none without one)."""
        return self.compact.records if self.compact is not None else ()

    def _frame_passed(self, op_pos: int, pos: int) -> int:
        """The walk reached the open frame's end (``pos``), or stepped past it from the opcode
        (or the fast path's run of opcodes) at ``op_pos``: refuse the pickle unless an opcode
        ends exactly there. Returns the loop's next limit."""
        end = self.frame_end
        if pos != end and not ends_an_opcode(self.raw, op_pos, end):
            check_frame(self.raw, self.frame_pos, end - self.frame_pos - 9)  # says why
            raise ambiguous(self.frame_pos, f"no opcode ends at its end (byte {end})")
        self.frame_pos = self.frame_end = -1
        self.limit = len(self.data)
        return self.limit

    def _build(self, obj: Any, state: Any) -> Any:
        if isinstance(obj, (GlobalRef, TorchDtype, TorchLayout)) or id(obj) not in self.created:
            name = obj.qualname if isinstance(obj, GlobalRef) else type(obj).__name__
            raise UnsafePickleError(
                f"refusing to read: the pickle uses BUILD to modify {name}, an object it did "
                "not create (an attack on the reading process; nothing was modified)"
            )
        if (
            isinstance(obj, OpaqueObject)
            and obj.cls in self.judged_names
            and not _default_state(state)
        ):  # only a __setstate__ takes such a state: BUILD calls it
            for index in self.judged_names[obj.cls]:
                self._called(index)
        set_state(obj, state, self.pos)
        return obj

    # -- main loop ------------------------------------------------------------------------
    def load(self) -> PickleResult:
        """Interpret opcodes until STOP; finalize the tree.

        A walk in which the ``compact`` hook made records and that then fails (any error, or a
        :class:`~ckpttool.pickle.hooks.Redo`: a record met where the objects it replaced
        would not have been left alone) is done again without it, within the same time budget:
        the result, or the error, is the general loop's.
        """
        deadline = time.monotonic() + MAX_SECONDS
        try:
            try:
                return self._load(deadline)
            except (CkptError, Redo):
                if not self.compacts:
                    raise
            self.compact = None
            self._reset()
            return self._load(deadline)
        except CkptError:
            if self.frame_pos >= 0:  # stopped inside a frame: is it one torch.load reads alike?
                check_frame(self.raw, self.frame_pos, self.frame_end - self.frame_pos - 9)
            raise

    def _load(self, deadline: float) -> PickleResult:
        """Interpret opcodes until STOP.

        The opcodes ``torch.save`` emits most (protocol 2: memo PUT/GET, small ints, MARK and
        TUPLE, strings, REDUCE, BINPERSID; and the floats and SETITEMS of a pickle of many small
        objects, bench/object_table.py: ``INLINE_OPCODES``) are handled inline with the
        stack in local variables: listing a checkpoint is this loop, and a function call per
        opcode was half its cost. Every other opcode goes through ``DISPATCH``. Both paths check
        lengths, the stack and the memo the same way.
        """
        data = self.raw  # bytes: cheaper to index and slice than the memoryview
        size = len(data)
        dispatch = DISPATCH
        memo = self.memo
        memo_list = self.memo_list
        metastack = self.metastack
        created = self.created
        track = self.track_spans
        stack, starts = self.stack, self.starts
        pos = self.pos
        op_pos = pos
        ops = 0
        next_check = CHECK_EVERY
        raw = self.raw
        fast = self.fast_path and not track
        compact = self.compact
        compact_modules = compact.modules if compact is not None else frozenset()
        limit = self.limit
        try:
            while True:
                if pos >= limit:
                    if pos >= size:
                        raise TruncatedPickleError(
                            "pickle truncated: it ends before its STOP opcode"
                        )
                    limit = self._frame_passed(op_pos, pos)
                op_pos = pos
                code = data[pos]
                pos += 1
                ops += 1
                if ops >= next_check:
                    next_check = ops + CHECK_EVERY
                    if time.monotonic() > deadline:
                        raise ResourceLimitError(f"pickle takes over {MAX_SECONDS:.0f} s to walk")
                    if len(stack) > MAX_STACK:
                        raise ResourceLimitError(f"pickle stack grows past {MAX_STACK:,} items")
                if code == 0x72 or code == 0x71:  # LONG_BINPUT, BINPUT
                    width = 4 if code == 0x72 else 1
                    if pos + width > size:
                        raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                    index = _U32(data, pos)[0] if width == 4 else data[pos]
                    pos += width
                    if not stack:
                        raise _bad(op_pos, "memo PUT on an empty stack")
                    if index < len(memo_list):
                        memo_list[index] = stack[-1]
                        self.overwrites += 1
                    elif index == len(memo_list):
                        memo_list.append(stack[-1])
                        if memo:
                            memo.pop(index, None)
                    else:
                        memo[index] = stack[-1]
                    if track:
                        self.result.memo_puts[index] = op_pos
                elif code == 0x68 or code == 0x6A:  # BINGET, LONG_BINGET
                    width = 1 if code == 0x68 else 4
                    if pos + width > size:
                        raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                    index = data[pos] if width == 1 else _U32(data, pos)[0]
                    pos += width
                    if index < len(memo_list):
                        value = memo_list[index]
                    elif index in memo:
                        value = memo[index]
                    else:
                        raise _bad(op_pos, f"memo GET of index {index} that was never PUT")
                    if value.__class__ is GlobalRef:
                        if (
                            value.name == "_rebuild_tensor_v2"
                            and fast
                            and value.module == "torch._utils"
                            and len(metastack) + 3 <= MAX_MARKS
                        ):  # a tensor: its whole call in one step (``tensor_call``)
                            made = tensor_call(self, raw, pos, value)
                            if made is not None:
                                pos, value = made
                                ops += TENSOR_CALL_OPCODES
                        elif (
                            compact is not None
                            and value.module in compact_modules
                            and len(metastack) + 3 <= MAX_MARKS
                        ):  # a format's object, as one compact record (pickle/hooks.py)
                            made = compact.call(self, raw, pos, value)
                            if made is not None:
                                pos, value = made
                                ops += compact.opcodes
                    elif value is ELIDED:
                        raise Redo  # an object a compact record replaced
                    stack.append(value)
                    starts.append(op_pos)
                    if track:
                        self.result.memo_gets.append((index, op_pos))
                elif code == 0x94:  # MEMOIZE (protocol 4: DCP's .metadata, 27 per entry)
                    if not stack:
                        raise _bad(op_pos, "MEMOIZE on an empty stack")
                    if memo:  # sparse indices were PUT: count them (``_op_memoize``)
                        _op_memoize(self, op_pos)
                    else:
                        if track:
                            self.result.memo_puts[len(memo_list)] = op_pos
                        memo_list.append(stack[-1])
                elif code == 0x4B:  # BININT1
                    if pos >= size:
                        raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                    stack.append(data[pos])
                    starts.append(op_pos)
                    pos += 1
                elif code == 0x28:  # MARK
                    metastack.append((stack, starts, op_pos))
                    stack, starts = [], []
                    self.stack, self.starts = stack, starts
                    if len(metastack) > MAX_MARKS:
                        raise ResourceLimitError("pickle nests MARKs deeper than any checkpoint")
                elif code == 0x74:  # TUPLE
                    if not metastack:
                        raise _bad(op_pos, "no MARK on the stack")
                    items = tuple(stack)
                    stack, starts, mark_pos = metastack.pop()
                    self.stack, self.starts = stack, starts
                    stack.append(items)
                    starts.append(mark_pos)
                elif code == 0x4D or code == 0x4A:  # BININT2, BININT
                    width = 2 if code == 0x4D else 4
                    if pos + width > size:
                        raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                    stack.append((_U16 if width == 2 else _I32)(data, pos)[0])
                    starts.append(op_pos)
                    pos += width
                elif code == 0x58 or code == 0x8C:  # BINUNICODE, SHORT_BINUNICODE
                    if code == 0x58:
                        if pos + 4 > size:
                            raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                        length = _U32(data, pos)[0]
                        pos += 4
                    else:
                        if pos >= size:
                            raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                        length = data[pos]
                        pos += 1
                    if pos + length > size:
                        raise TruncatedPickleError(
                            f"pickle truncated or corrupt: an item at byte {pos} claims "
                            f"{length:,} bytes but only {size - pos:,} remain"
                        )
                    stack.append(str(data[pos : pos + length], "utf-8", "surrogatepass"))
                    starts.append(op_pos)
                    pos += length
                elif code == 0x47:  # BINFLOAT
                    if pos + 8 > size:
                        raise TruncatedPickleError(f"pickle truncated at byte {pos}")
                    stack.append(_F64(data, pos)[0])
                    starts.append(op_pos)
                    pos += 8
                elif code == 0x75:  # SETITEMS
                    if not metastack:
                        raise _bad(pos, "no MARK on the stack")
                    marked, marked_starts = stack, starts
                    stack, starts, _ = metastack.pop()
                    self.stack, self.starts = stack, starts
                    if len(marked) % 2:
                        raise _bad(op_pos, "SETITEMS with an odd number of items")
                    if stack[-1].__class__ is dict and not track:
                        stack[-1].update(zip(marked[::2], marked[1::2]))
                    else:  # an object's items, or spans to record (for edits)
                        _set_items(self, marked, marked_starts, op_pos, op_pos)
                elif code == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                    starts.append(op_pos)
                elif 0x85 <= code <= 0x87:  # TUPLE1, TUPLE2, TUPLE3
                    n = code - 0x84
                    if len(stack) < n:
                        raise _bad(op_pos, "stack underflow")
                    items = tuple(stack[-n:])
                    start = starts[-n]
                    del stack[-n:]
                    del starts[-n:]
                    stack.append(items)
                    starts.append(start)
                elif code == 0x89 or code == 0x88 or code == 0x4E:  # NEWFALSE, NEWTRUE, NONE
                    stack.append(None if code == 0x4E else code == 0x88)
                    starts.append(op_pos)
                elif code == 0x52:  # REDUCE: the callable stays where it was, as its result
                    if len(stack) < 2:
                        raise _bad(op_pos, "stack underflow")
                    args = stack.pop()
                    starts.pop()
                    self.pos = pos
                    stack[-1] = self.call(stack[-1], args)
                elif code == 0x51:  # BINPERSID
                    if not stack:
                        raise _bad(op_pos, "stack underflow")
                    if self.persistent_load is None:
                        raise _no_persistent_load()
                    self.pos = pos
                    stack[-1] = self.persistent_load(stack[-1])
                elif code == 0x7D or code == 0x5D:  # EMPTY_DICT, EMPTY_LIST
                    container: dict[Any, Any] | list[Any] = {} if code == 0x7D else []
                    created.add(id(container))
                    stack.append(container)
                    starts.append(op_pos)
                else:
                    handler = dispatch.get(code)
                    if handler is None:
                        raise _bad(op_pos, f"unknown opcode 0x{code:02x}")
                    self.pos = pos
                    if handler(self, op_pos):
                        break
                    pos = self.pos
                    limit = self.limit  # a FRAME sets it
                    stack, starts = self.stack, self.starts
        except (IndexError, KeyError, TypeError, ValueError, struct.error, OverflowError,
                UnicodeDecodeError, AttributeError, RecursionError) as error:  # fmt: skip
            raise _bad(op_pos, f"{type(error).__name__}: {error}") from None
        unsafe = self.contextual.unsafe() if self.refuse_dangerous else None
        if unsafe:  # a partial, getattr or torch namespace not (only) used as data
            raise _refused(unsafe[0])
        # the memo held every intermediate object (torch memoizes each tensor's argument
        # tuples): free them before finalize copies the tree, which is when memory peaks
        memo.clear()
        memo_list.clear()
        created.clear()
        try:
            reuse = REUSE_BASE + (self.pos - self.start) // REUSE_BYTES
            objects: list[int] = []
            self.result.root = _finalize(
                self.result.root, MAX_NODES, reuse, self.compacts, self._records(), objects
            )[0]
            self.result.objects = objects[0]
        except (TypeError, ValueError, RecursionError) as error:
            raise _bad(self.pos, f"{type(error).__name__}: {error}") from None
        self.result.end = self.pos
        return self.result


# ---------------------------------------------------------------------------------------
# Opcode handlers: each takes (unpickler, offset of the opcode) and returns True on STOP.


def _op_stop(u: SafeUnpickler, pos: int) -> bool:
    root, _ = u._pop()
    if u.frame_end > pos + 1:  # bytes after the STOP inside its frame
        raise ambiguous(u.frame_pos, f"{u.frame_end - pos - 1} bytes follow the STOP at byte {pos}")
    if u.stack or u.metastack:
        raise _bad(pos, "STOP with items left on the stack")
    u.result.root = root
    u.result.stop_at = pos
    return True


def _op_proto(u: SafeUnpickler, pos: int) -> bool:
    version = u._take(1)[0]
    if version > 5:
        raise _bad(pos, f"unsupported pickle protocol {version}")
    u.protocol = version
    return False


def _op_frame(u: SafeUnpickler, pos: int) -> bool:
    length = u._u("<Q", 8)
    if length > len(u.data) - u.pos:
        raise _bad(pos, f"FRAME claims {length:,} bytes past the end")
    if u.frame_end > pos:  # torch.load would skip the rest of the open frame
        raise ambiguous(u.frame_pos, f"a FRAME begins inside it, at byte {pos}")
    # torch.load and a linear reader read the same opcodes only if the frame ends between two
    # of them (checked when the walk gets there: ``_frame_passed``, ``_op_stop``, ``load``)
    u.frame_pos, u.frame_end = pos, u.pos + length
    u.limit = u.frame_end
    u.result.frames.append((pos, length))
    return False


def _push_read(read: Callable[[SafeUnpickler], Any]) -> Callable[[SafeUnpickler, int], bool]:
    def handler(u: SafeUnpickler, pos: int) -> bool:
        u._push(read(u), pos)
        return False

    return handler


def _read_int_text(u: SafeUnpickler) -> Any:
    line = u._line()
    if line == b"00":
        return False
    if line == b"01":
        return True
    return int(line)


def _read_long_text(u: SafeUnpickler) -> int:
    line = u._line()
    return int(line[:-1] if line.endswith(b"L") else line)


def _read_string_text(u: SafeUnpickler) -> str:
    line = u._line()
    if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
        raise ValueError("badly quoted STRING")
    return str(codecs.escape_decode(line[1:-1])[0].decode("latin-1"))


def _op_pop(u: SafeUnpickler, pos: int) -> bool:
    if u.stack:
        u._pop()
    else:
        u._pop_mark()
    return False


def _op_pop_mark(u: SafeUnpickler, pos: int) -> bool:
    u._pop_mark()
    return False


def _op_dup(u: SafeUnpickler, pos: int) -> bool:
    value, start = u._pop()
    u._push(value, start)
    u._push(value, pos)
    return False


def _memo_store(u: SafeUnpickler, index: int, value: Any) -> None:
    """The memo's PUT (see ``SafeUnpickler.__init__``; ``load`` inlines the same steps)."""
    if 0 <= index < len(u.memo_list):
        u.memo_list[index] = value
        u.overwrites += 1
    elif index == len(u.memo_list):
        u.memo_list.append(value)
        u.memo.pop(index, None)
    else:
        u.memo[index] = value


def _memo_put(index_reader: Callable[[SafeUnpickler], int]) -> Callable[[SafeUnpickler, int], bool]:
    def handler(u: SafeUnpickler, pos: int) -> bool:
        index = index_reader(u)
        if not u.stack:
            raise _bad(pos, "memo PUT on an empty stack")
        _memo_store(u, index, u.stack[-1])
        if u.track_spans:
            u.result.memo_puts[index] = pos
        return False

    return handler


def _memo_get(index_reader: Callable[[SafeUnpickler], int]) -> Callable[[SafeUnpickler, int], bool]:
    def handler(u: SafeUnpickler, pos: int) -> bool:
        index = index_reader(u)
        if 0 <= index < len(u.memo_list):
            value = u.memo_list[index]
        elif index in u.memo:
            value = u.memo[index]
        else:
            raise _bad(pos, f"memo GET of index {index} that was never PUT")
        if value is ELIDED:
            raise Redo
        u._push(value, pos)
        if u.track_spans:
            u.result.memo_gets.append((index, pos))
        return False

    return handler


def _op_memoize(u: SafeUnpickler, pos: int) -> bool:
    if not u.stack:
        raise _bad(pos, "MEMOIZE on an empty stack")
    index = len(u.memo_list) + len(u.memo)  # the number of distinct indices PUT so far
    _memo_store(u, index, u.stack[-1])
    if u.track_spans:
        u.result.memo_puts[index] = pos
    return False


def _op_empty(factory: Callable[[], Any]) -> Callable[[SafeUnpickler, int], bool]:
    def handler(u: SafeUnpickler, pos: int) -> bool:
        u._push(u._new(factory()), pos)
        return False

    return handler


def _op_list(u: SafeUnpickler, pos: int) -> bool:
    items, _, mark_pos = u._pop_mark()
    u._push(u._new(list(items)), mark_pos)
    return False


def _op_dict(u: SafeUnpickler, pos: int) -> bool:
    items, _, mark_pos = u._pop_mark()
    if len(items) % 2:
        raise _bad(pos, "DICT with an odd number of items")
    u._push(u._new(dict(zip(items[::2], items[1::2]))), mark_pos)
    return False


def _op_frozenset(u: SafeUnpickler, pos: int) -> bool:
    items, _, mark_pos = u._pop_mark()
    u._push(frozenset(items), mark_pos)
    return False


def _extend(u: SafeUnpickler, target: Any, items: list[Any], pos: int) -> None:
    if isinstance(target, list):
        target.extend(items)
    elif isinstance(target, OpaqueObject):
        target.listitems.extend(items)
    else:
        raise _bad(pos, f"APPEND to a {type(target).__name__}")


def _op_append(u: SafeUnpickler, pos: int) -> bool:
    value, _ = u._pop()
    _extend(u, u.stack[-1], [value], pos)
    return False


def _op_appends(u: SafeUnpickler, pos: int) -> bool:
    items, _, _ = u._pop_mark()
    _extend(u, u.stack[-1], items, pos)
    return False


def _set_items(u: SafeUnpickler, items: list[Any], starts: list[int], end: int, pos: int) -> None:
    if len(items) % 2:
        raise _bad(pos, "SETITEMS with an odd number of items")
    target = u.stack[-1]
    if isinstance(target, dict):
        for key, value in zip(items[::2], items[1::2]):
            target[key] = value
    elif isinstance(target, OpaqueObject):
        target.dictitems.update(zip(items[::2], items[1::2]))
    else:
        raise _bad(pos, f"SETITEMS on a {type(target).__name__}")
    if u.track_spans and len(u.stack) == 1 and not u.metastack:
        for i in range(0, len(items), 2):
            value_end = starts[i + 2] if i + 2 < len(starts) else end
            u.result.root_items.append(ItemSpan(items[i], starts[i], starts[i + 1], value_end))


def _op_setitem(u: SafeUnpickler, pos: int) -> bool:
    value, value_start = u._pop()
    key, key_start = u._pop()
    _set_items(u, [key, value], [key_start, value_start], pos, pos)
    return False


def _op_additems(u: SafeUnpickler, pos: int) -> bool:
    items, _, _ = u._pop_mark()
    target = u.stack[-1]
    if not isinstance(target, set):
        raise _bad(pos, "ADDITEMS on a non-set")
    target.update(items)
    return False


def _op_global(u: SafeUnpickler, pos: int) -> bool:
    module = u._line().decode("utf-8")
    name = u._line().decode("utf-8")
    u._push(u._global(module, name), pos)
    return False


def _op_stack_global(u: SafeUnpickler, pos: int) -> bool:
    name, _ = u._pop()
    module, start = u._pop()
    if not isinstance(module, str) or not isinstance(name, str):
        if u.refuse_dangerous:
            raise _bad(pos, "STACK_GLOBAL with non-string names")
        # names an earlier call computes (_codecs.encode, getattr...): torch.load imports them
        u._push(u.unresolved(f"STACK_GLOBAL at byte {pos} of names computed at load time"), start)
        return False
    u._push(u._global(module, name), start)
    return False


def _default_state(state: Any) -> bool:
    """A state pickle's default ``BUILD`` sets without a ``__setstate__``: a ``__dict__``, or
    ``(__dict__ or None, slots)``."""
    if isinstance(state, dict) or state is None:
        return True
    return (
        isinstance(state, tuple)
        and len(state) == 2
        and all(part is None or isinstance(part, dict) for part in state)
    )


def _op_newobj(u: SafeUnpickler, pos: int) -> bool:
    args, _ = u._pop()
    cls, start = u._pop()
    u._push(u.call(cls, args, new=True, effect=False), start)
    return False


def _op_newobj_ex(u: SafeUnpickler, pos: int) -> bool:
    kwargs, _ = u._pop()
    args, _ = u._pop()
    cls, start = u._pop()
    result = u.call(cls, args, new=True, effect=bool(kwargs))
    if isinstance(result, OpaqueObject) and kwargs:
        result.state = {"__kwargs__": kwargs}
    u._push(result, start)
    return False


def _op_inst(u: SafeUnpickler, pos: int) -> bool:
    module = u._line().decode("utf-8")
    name = u._line().decode("utf-8")
    cls = u._global(module, name)
    items, _, mark_pos = u._pop_mark()
    u._push(u.call(cls, tuple(items), effect=bool(items)), mark_pos)
    return False


def _op_obj(u: SafeUnpickler, pos: int) -> bool:
    items, _, mark_pos = u._pop_mark()
    if not items:
        raise _bad(pos, "OBJ without a class")
    u._push(u.call(items[0], tuple(items[1:]), effect=len(items) > 1), mark_pos)
    return False


def _op_build(u: SafeUnpickler, pos: int) -> bool:
    state, _ = u._pop()
    u._build(u.stack[-1], state)
    return False


def _op_persid_text(u: SafeUnpickler, pos: int) -> bool:
    pid = u._line().decode("ascii")
    if u.persistent_load is None:
        raise _no_persistent_load()
    u._push(u.persistent_load(pid), pos)
    return False


def _no_persistent_load() -> CorruptCheckpointError:
    return CorruptCheckpointError(
        "the pickle refers to external tensor data, but this file has none "
        "(a torch checkpoint's data.pkl taken out of its archive?)"
    )


def _op_unsupported(what: str) -> Callable[[SafeUnpickler, int], bool]:
    def handler(u: SafeUnpickler, pos: int) -> bool:
        raise CorruptCheckpointError(f"unsupported pickle at byte {pos}: {what}")

    return handler


def _op_ext(size: int) -> Callable[[SafeUnpickler, int], bool]:
    """EXT1/EXT2/EXT4: a global looked up in ``copyreg``'s extension registry, which the
    loading process (or the pickle itself, calling ``copyreg.add_extension``) fills: unknowable
    statically. Refused, or in scan mode a dangerous ``<unresolved>`` name."""
    what = f"EXT{size} (copyreg extension registry)"

    def handler(u: SafeUnpickler, pos: int) -> bool:
        if u.refuse_dangerous:
            raise CorruptCheckpointError(f"unsupported pickle at byte {pos}: {what}")
        code = int.from_bytes(u._take(size), "little")
        u._push(u.unresolved(f"EXT{size} code {code} (copyreg extension registry)"), pos)
        return False

    return handler


def _bytes_of(n_reader: Callable[[SafeUnpickler], int]) -> Callable[[SafeUnpickler], bytes]:
    return lambda u: bytes(u._take(n_reader(u)))


def _str_of(n_reader: Callable[[SafeUnpickler], int]) -> Callable[[SafeUnpickler], str]:
    return lambda u: str(u._take(n_reader(u)), "utf-8", "surrogatepass")


#: Python refuses to print integers of more than 4,300 digits (a guard against quadratic
#: conversion); a LONG4 holding one would make every renderer fail. No checkpoint has one.
MAX_LONG_BYTES = 1785  # 8 x 1785 bits < 10**4300


def _long4(u: SafeUnpickler) -> int:
    pos = u.pos - 1
    length = u._u("<i", 4)
    if length > MAX_LONG_BYTES:
        raise ResourceLimitError(
            f"the pickle holds an integer of {length:,} bytes at byte {pos} (over 4,300 "
            "decimal digits); no checkpoint needs one"
        )
    return int.from_bytes(u._take(length), "little", signed=True)


def _n(fmt: str, size: int) -> Callable[[SafeUnpickler], int]:
    """A reader of one fixed-size little-endian integer argument."""
    signed = fmt[-1].islower()

    def read(u: SafeUnpickler) -> int:
        pos = u.pos
        stop = pos + size
        if stop > len(u.data):
            raise TruncatedPickleError(f"pickle truncated at byte {pos}")
        u.pos = stop
        if size == 1 and not signed:
            return u.data[pos]
        return int.from_bytes(u.data[pos:stop], "little", signed=signed)

    return read


#: Opcodes interpreted inline by ``SafeUnpickler.load`` (what ``torch.save`` writes most).
INLINE_OPCODES = frozenset(b"rqhj\x94K(tMJX\x8c)\x85\x86\x87\x88\x89NRQ}]Gu")

#: Every other opcode: a handler taking (unpickler, offset of the opcode), True on STOP.
DISPATCH: dict[int, Callable[[SafeUnpickler, int], bool]] = {
    ord("."): _op_stop,
    0x80: _op_proto,
    0x95: _op_frame,
    ord("0"): _op_pop,
    ord("1"): _op_pop_mark,
    ord("2"): _op_dup,
    ord("I"): _push_read(_read_int_text),
    ord("L"): _push_read(_read_long_text),
    0x8A: _push_read(lambda u: int.from_bytes(u._take(u._u("<B", 1)), "little", signed=True)),
    0x8B: _push_read(lambda u: _long4(u)),
    ord("F"): _push_read(lambda u: float(u._line())),
    ord("S"): _push_read(_read_string_text),
    ord("T"): _push_read(lambda u: str(u._take(u._u("<i", 4)), "latin-1")),
    ord("U"): _push_read(lambda u: str(u._take(u._u("<B", 1)), "latin-1")),
    ord("B"): _push_read(_bytes_of(_n("<I", 4))),
    ord("C"): _push_read(_bytes_of(_n("<B", 1))),
    0x8E: _push_read(_bytes_of(_n("<Q", 8))),
    0x96: _push_read(lambda u: bytearray(u._take(u._u("<Q", 8)))),
    ord("V"): _push_read(lambda u: u._line().decode("raw-unicode-escape")),
    0x8D: _push_read(_str_of(_n("<Q", 8))),
    ord("a"): _op_append,
    ord("e"): _op_appends,
    ord("l"): _op_list,
    ord("d"): _op_dict,
    ord("s"): _op_setitem,
    0x8F: _op_empty(set),
    0x90: _op_additems,
    0x91: _op_frozenset,
    ord("g"): _memo_get(lambda u: int(u._line())),
    ord("p"): _memo_put(lambda u: int(u._line())),
    ord("P"): _op_persid_text,
    ord("c"): _op_global,
    0x93: _op_stack_global,
    ord("b"): _op_build,
    ord("i"): _op_inst,
    ord("o"): _op_obj,
    0x81: _op_newobj,
    0x92: _op_newobj_ex,
    0x82: _op_ext(1),
    0x83: _op_ext(2),
    0x84: _op_ext(4),
    0x97: _op_unsupported("NEXT_BUFFER (out-of-band buffers)"),
    0x98: _op_unsupported("READONLY_BUFFER (out-of-band buffers)"),
}


# ---------------------------------------------------------------------------------------
# Finalisation: replace internal placeholders, cut cycles, bound depth and expanded size.


#: Leaves that finalize returns as they are, weighing one node each.
_SCALARS = frozenset({int, float, bool, complex, type(None)})
#: Tuples of scalars and short strings up to this length are returned as they are (their weight
#: still counts in the expanded size, so the limits hold; only the reuse tally skips them, as it
#: skips scalars and short strings): a DCP .metadata has a (section, name) path per entry.
_SMALL = 16


def _weight(leaf: Any) -> int:
    return 1 + len(leaf) // 64 if isinstance(leaf, (str, bytes, bytearray)) else 1


def _holds_compact(value: Any, records: tuple[type, ...]) -> bool:
    """Whether a call's arguments hold a ``compact`` hook's record, at any depth."""
    if isinstance(value, records):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(_holds_compact(v, records) for v in value)
    if isinstance(value, dict):
        return any(
            _holds_compact(k, records) or _holds_compact(v, records) for k, v in value.items()
        )
    if isinstance(value, OpaqueObject):
        return any(
            _holds_compact(part, records)
            for part in (value.args, value.state, value.dictitems, value.listitems)
        )
    return False


def finalize(
    root: Any,
    max_nodes: int = MAX_NODES,
    max_reuse: int = MAX_NODES,
    compacts: int = 0,
    records: tuple[type, ...] = (),
) -> Any:
    """The tree with the walk's placeholders replaced, checked for depth and size, and each
    reference to a container that holds it (a cycle: a parent link) made a
    :class:`~ckpttool.model.records.BackReference` leaf of weight one.

    A ``compact`` hook's record (one of ``records``, only where ``compacts`` were made) counts as
    the objects it replaced: its ``nodes``, its ``depth``, and a visit of what it shares;
    reaching one twice raises :class:`~ckpttool.pickle.hooks.Redo` (the walk is then done
    without them).
    """
    return _finalize(root, max_nodes, max_reuse, compacts, records)[0]


def _finalize(
    root: Any,
    max_nodes: int,
    max_reuse: int,
    compacts: int,
    records: tuple[type, ...] = (),
    objects_out: list[int] | None = None,
) -> tuple[Any, int, int]:
    """``finalize``, and the tree's expanded size and its reused weight (for the tests); how
    many opaque objects the tree holds, each once, appended to ``objects_out`` if given
    (``PickleResult.objects``)."""
    done: dict[int, Any] = {}
    objects = 0  # OpaqueObjects copied into the tree (the only way one gets there)
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    leaves_seen: set[int] = set()  # ids of tensors and long strings met so far
    reused = 0  # weight of the nodes reached again through a shared reference

    def reuse(weight: int) -> None:
        nonlocal reused
        reused += weight
        if reused > max_reuse:
            raise ResourceLimitError(
                f"the pickle refers to the same objects over and over: expanded, its shared "
                f"references exceed {max_reuse:,} objects (a reference bomb)"
            )

    def visit(node: Any, depth: int) -> tuple[Any, int]:
        nonlocal objects
        cls = type(node)
        if depth > MAX_DEPTH:
            raise ResourceLimitError(f"the pickle nests containers more than {MAX_DEPTH} deep")
        if cls in _SCALARS or (cls is str and len(node) < 64):  # most nodes: nothing to do
            return node, 1
        if cls is tuple and len(node) <= _SMALL:
            # each a scalar or a string under 64 characters (the leaves returned as they are and
            # not tallied when reached again), tested inline: bench/object_table.py's tuples
            for item in node:
                kind = type(item)
                if kind not in _SCALARS and (kind is not str or len(item) >= 64):
                    break
            else:  # a shape, a key's path: immutable, nothing to replace
                return node, len(node) + 1
        if cls is TensorRecord:  # the other most common node: a leaf, counted when met again
            if id(node) in leaves_seen:
                reuse(1)
            leaves_seen.add(id(node))
            return node, 1
        if compacts and cls in records:
            return compact(node, depth)
        if isinstance(node, NdarrayBuilder):
            node = node.record
        elif isinstance(node, NumpyDtype):  # text a writer knows to be a dtype
            return NumpyDtypeText(f"numpy.dtype('{node.byteorder}{node.code}')"), 1
        elif isinstance(node, TorchDtype):
            return TorchDtypeText(node), 1
        elif isinstance(node, TorchLayout):
            return str(node), 1
        elif isinstance(node, StorageRecord):  # a storage saved on its own (torch.FloatStorage)
            node = TensorRecord("", node.dtype, (node.numel,), (1,), 0, node, kind="storage")
        if not isinstance(node, (dict, list, tuple, set, frozenset, OpaqueObject)):
            weight = _weight(node)
            if weight > 1 or isinstance(node, TensorRecord):
                if id(node) in leaves_seen:
                    reuse(weight)
                leaves_seen.add(id(node))
            return node, weight
        key = id(node)
        if key in done:
            reuse(sizes[key])
            return done[key], sizes[key]
        if key in on_path:  # an ancestor: omegaconf's ``_parent``, a list holding itself
            target = node.cls if isinstance(node, OpaqueObject) else type(node).__name__
            return BackReference(target), 1
        on_path.add(key)
        total = 1
        out: Any
        inner = depth + 1
        shallow = inner <= MAX_DEPTH  # a leaf one level down needs no visit (no depth error)
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if shallow and type(k) is str and len(k) < 64:
                    fk, ks = k, 1
                else:
                    fk, ks = visit(k, inner)
                kind = type(v)
                if shallow and (kind in _SCALARS or (kind is str and len(v) < 64)):
                    fv, vs = v, 1
                else:
                    fv, vs = visit(v, inner)
                out[fk] = fv
                total += ks + vs
        elif isinstance(node, (list, tuple, set, frozenset)):
            values = []
            for v in node:
                if shallow and type(v) in _SCALARS:
                    values.append(v)
                    total += 1
                else:
                    fv, vs = visit(v, inner)
                    values.append(fv)
                    total += vs
            out = values if isinstance(node, list) else type(node)(values)
        else:
            objects += 1
            out = node.empty_copy()
            # what most objects leave empty (no arguments, state or items) needs no visit: an
            # object's own dictitems and listitems are nobody else's, so fresh empty ones (as
            # OpaqueObject starts with) are what a visit would make, at the same weight
            args, state = node.args, node.state
            if shallow and type(args) is tuple and not args:
                out.args, s1 = args, 1
            else:
                out.args, s1 = visit(args, inner)
            if shallow and state is None:
                s2 = 1
            else:
                out.state, s2 = visit(state, inner)
            if shallow and not node.dictitems:
                s3 = 1
            else:
                out.dictitems, s3 = visit(node.dictitems, inner)
            if shallow and not node.listitems:
                s4 = 1
            else:
                out.listitems, s4 = visit(node.listitems, inner)
            total += s1 + s2 + s3 + s4
        if total > max_nodes:
            raise ResourceLimitError(
                f"the pickle expands to over {max_nodes:,} objects (a reference bomb)"
            )
        on_path.discard(key)
        done[key] = out
        sizes[key] = total
        return out, total

    def compact(node: Any, depth: int) -> tuple[Any, int]:
        nonlocal objects
        if isinstance(node, OpaqueObject):  # (a format's records are not, today)
            objects += 1
        if id(node) in leaves_seen:
            raise Redo  # shared: the general loop's objects would be counted as reused
        leaves_seen.add(id(node))
        inner = depth + node.depth
        if inner > MAX_DEPTH:
            raise ResourceLimitError(f"the pickle nests containers more than {MAX_DEPTH} deep")
        total = node.nodes + sum(visit(part, inner)[1] for part in node.shared)
        if total > max_nodes:
            raise ResourceLimitError(
                f"the pickle expands to over {max_nodes:,} objects (a reference bomb)"
            )
        return node, total

    tree, total = visit(root, 0)
    if objects_out is not None:
        objects_out.append(objects)
    return tree, total, reused


def load_pickle(
    data: bytes | memoryview,
    start: int = 0,
    *,
    persistent_load: PersistentLoad | None = None,
    refuse_dangerous: bool = True,
    track_spans: bool = False,
    fast_path: bool | None = None,
    compact: CompactCall | None = None,
) -> PickleResult:
    """Read one pickle safely; see :class:`SafeUnpickler`.

    Python's cyclic garbage collector is paused for the walk (and resumed, as it was, after).
    Everything the walk creates stays reachable from the memo, the stack or the tree until it
    ends, so a collection during it frees nothing but cycles a hostile pickle builds and drops
    (each costs it at least four bytes: EMPTY_LIST DUP APPEND POP, no more than the memo lets
    it keep anyway, and the walk is bounded in opcodes and time); yet every full collection
    traverses all of it: at 100,000 tensors the collector was a third of the walk's CPU time.
    """
    unpickler = SafeUnpickler(
        data,
        start,
        persistent_load=persistent_load,
        refuse_dangerous=refuse_dangerous,
        track_spans=track_spans,
        fast_path=fast_path,
        compact=compact,
    )
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return unpickler.load()
    finally:
        if paused:
            gc.enable()


__all__ = [
    "DISPATCH",
    "INLINE_OPCODES",
    "ItemSpan",
    "PersistentLoad",
    "PickleResult",
    "SafeUnpickler",
    "TruncatedPickleError",
    "finalize",
    "load_pickle",
]
