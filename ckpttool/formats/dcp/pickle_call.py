"""The walker's fast path for the entries of a DCP ``.metadata`` pickle, read into compact records.

A ``torch.distributed.checkpoint`` ``.metadata`` file lists every chunk of every rank: at
100,000 entries the general loop spent 9 s and 700 MB on it, 70 opcodes and a dozen objects per
entry (a ``TensorStorageMetadata`` with its ``TensorProperties``, a ``torch.Size``, a list of
``ChunkStorageMetadata``; a ``MetadataIndex`` and a ``_StorageInfo`` for each chunk), all rebuilt
as :class:`~ckpttool.model.records.OpaqueObject` trees with their state dicts, then copied once more by
``finalize``. Only a few numbers and strings of each are ever used.

So when the walker fetches one of those three classes from the memo (the first entry names it
with ``STACK_GLOBAL``; every later one fetches it), :func:`dcp_call` reads the whole object, the
exact opcodes ``pickle`` writes for it, and pushes one slotted record holding what
:mod:`ckpttool.formats.dcp.metadata` reads (:mod:`ckpttool.formats.dcp.pickle_records`). Each also
carries what ``finalize`` would have counted for the objects it replaces (``nodes``, ``depth``,
and ``shared``: objects it refers to that ``finalize`` must still visit), so every limit sees
the tree the general loop would have built. Records of one kind are read with a layout made
from the first (:mod:`ckpttool.formats.dcp.pickle_layout`).

The memo entries such a sequence puts hold what the general loop would put for strings and
shapes; the objects the record replaces get ``ELIDED``. Anything that departs from the
pattern (another opcode, a ``FRAME``, a field it does not know, a value of another kind, sparse
memo indices) makes it answer ``None`` with nothing changed, and the general loop reads the
bytes. The records are only equivalent where the general loop's objects would have been left
alone: a later memo GET of an elided object, a call given a record, a record reached twice by
``finalize``, or any error in a walk that made records makes the walker throw the result away and
walk the pickle again without this path (``Redo``), so a file reads the same, error for
error, with or without it: ``tests/test_dcp_call.py`` checks that over the fixtures, DCP
directories of several layouts, the hostile corpus and mutated pickles.
"""

from __future__ import annotations

import struct
from typing import Any

from ckpttool.formats.dcp.pickle_layout import (
    CONSTANT,
    SHAPE,
    VARIABLE,
    Layouts,
    fields_layout,
    replay,
    tensor_layout,
)
from ckpttool.formats.dcp.pickle_records import COMPACT, ELIDED, IndexMeta, InfoMeta, TensorMeta
from ckpttool.model.records import GlobalRef
from ckpttool.pickle.emulation import TorchDtype, TorchLayout
from ckpttool.pickle.hooks import CompactCall

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
OPCODES = 40  # what one record counts towards the walker's periodic checks (a rough mean)
MAX_MARKS = 3  # MARKs a record's opcodes open at once


_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_INTS = frozenset(b"KMJ\x8a")  # BININT1, BININT2, BININT, LONG1
_INT_WIDTHS = {0x4B: "B", 0x4D: "H", 0x4A: "i"}  # what a layout reads (not LONG1)
_DTYPE_NAMES: dict[str, str] = {}  # "float32" -> "torch.float32"


class _Miss(Exception):
    """The bytes depart from the pattern: the general loop reads them."""


class _Reader:
    """One sequence's opcodes: reads, checks, and collects its memo entries until committed."""

    __slots__ = (
        "known", "memo_list", "pending", "plan", "pos", "raw", "shape_puts", "shapes", "shared",
        "string_puts", "vars",
    )  # fmt: skip

    def __init__(self, u: Any, raw: bytes, pos: int, *, trace: bool = False) -> None:
        # (the walker's sparse memo is empty: ``dcp_call`` reads nothing otherwise)
        self.raw, self.pos = raw, pos
        self.memo_list, self.shapes = u.memo_list, u.shapes
        self.known = len(self.memo_list)
        self.pending: list[Any] = []  # memo entries this sequence puts, in order
        self.shared: list[Any] = []  # what finalize must still visit (long strings, memfmt)
        # with ``trace``, what a layout is made of: where each integer's and each new string's
        # bytes are (offset, length, struct code: "s" for a string), in order (None: the read
        # can make no layout); where each shape and string went in ``pending``; and each field
        # of the state dict read, with where its value came from (a ``dcp_layout`` plan)
        self.vars: list[tuple[int, int, str]] | None = [] if trace else None
        self.shape_puts: list[tuple[int, ...]] = []
        self.string_puts: list[tuple[int, int]] = []  # (pending index, var index)
        self.plan: list[tuple[str, int, Any, tuple[int, ...]]] | None = [] if trace else None

    def op(self, code: int) -> None:
        if self.raw[self.pos] != code:
            raise _Miss
        self.pos += 1

    def peek(self) -> int:
        return self.raw[self.pos]

    def memoize(self, value: Any) -> None:
        if self.raw[self.pos] != 0x94:  # MEMOIZE (protocol 4, what DCP writes)
            raise _Miss
        self.pos += 1
        self.pending.append(value)

    def get(self) -> Any:
        """A memo GET of something put before this sequence (else a miss)."""
        raw, pos = self.raw, self.pos
        code = raw[pos]
        if code == 0x68:  # BINGET
            index = raw[pos + 1]
            self.pos = pos + 2
        elif code == 0x6A:  # LONG_BINGET
            index = _U32(raw, pos + 1)[0]
            self.pos = pos + 5
        else:
            raise _Miss
        if index >= self.known:  # not put before this sequence
            raise _Miss
        value = self.memo_list[index]
        if value is ELIDED:
            raise _Miss
        return value

    def string(self) -> str:
        """A string: fetched, or new (SHORT_BINUNICODE / BINUNICODE, then memoized)."""
        raw, pos = self.raw, self.pos
        code = raw[pos]
        if code == 0x8C:
            length = raw[pos + 1]
            start = pos + 2
        elif code == 0x58:
            length = _U32(raw, pos + 1)[0]
            start = pos + 5
        else:
            value = self.get()
            if value.__class__ is not str:
                raise _Miss
            return value
        if start + length > len(raw):
            raise _Miss
        self.pos = start + length
        value = str(raw[start : start + length], "utf-8", "surrogatepass")
        if self.vars is not None:
            if length < 64:  # (fewer bytes: fewer characters; finalize tracks longer ones)
                self.string_puts.append((len(self.pending), len(self.vars)))
                self.vars.append((start, length, "s"))
            else:
                self.vars = None
        self.memoize(value)
        return value

    def string_weight(self, value: str) -> int:
        """A string's nodes (long ones are visited by finalize: it tracks them)."""
        if len(value) < 64:
            return 1
        self.shared.append(value)
        return 0

    def integer(self) -> Any:
        """BININT1, BININT2, BININT, LONG1 (up to 8 bytes), NONE."""
        raw, pos = self.raw, self.pos
        code = raw[pos]
        if self.vars is not None and code != 0x4E:  # NONE is an opcode, not a variable
            width = _INT_WIDTHS.get(code)
            if width is None:  # LONG1: no layout
                self.vars = None
            else:
                self.vars.append((pos + 1, struct.calcsize(width), width))
        if code == 0x4B:
            self.pos = pos + 2
            return raw[pos + 1]
        if code == 0x4D:
            self.pos = pos + 3
            return _U16(raw, pos + 1)[0]
        if code == 0x4A:
            self.pos = pos + 5
            return _I32(raw, pos + 1)[0]
        if code == 0x8A:
            length = raw[pos + 1]
            if length > 8 or pos + 2 + length > len(raw):
                raise _Miss
            self.pos = pos + 2 + length
            return int.from_bytes(raw[pos + 2 : pos + 2 + length], "little", signed=True)
        if code == 0x4E:
            self.pos = pos + 1
            return None
        raise _Miss

    def size(self) -> tuple[int, ...]:
        """A ``torch.Size``: GET torch.Size, the ints' tuple, TUPLE1, REDUCE (or a GET of one)."""
        func = self.get()
        if func.__class__ is tuple:  # the same Size object again: what the memo holds for it
            if not all(v.__class__ is int for v in func):
                raise _Miss
            return func
        if func.__class__ is not GlobalRef or func.module != "torch" or func.name != "Size":
            raise _Miss
        raw = self.raw
        code = raw[self.pos]
        if code == 0x29:  # EMPTY_TUPLE (never memoized), TUPLE1 MEMOIZE REDUCE MEMOIZE
            if raw[self.pos + 1 : self.pos + 5] != b"\x85\x94R\x94":
                raise _Miss
            self.pos += 5
            self.shape_puts.append((len(self.pending) + 1,))
            self.pending += (ELIDED, ())
            return ()
        marked = code == 0x28
        if marked:
            self.pos += 1
        values: list[int] = []
        while raw[self.pos] in _INTS:
            values.append(self.integer())
        pos = self.pos
        code = raw[pos]
        if marked:
            if code != 0x74:  # TUPLE
                raise _Miss
        elif code - 0x84 != len(values) or not 1 <= len(values) <= 3:  # TUPLE1..3
            raise _Miss
        # MEMOIZE the ints, TUPLE1 (the call's arguments) MEMOIZE, REDUCE MEMOIZE: the Size is
        # the tuple itself in the emulation
        if raw[pos + 1 : pos + 6] != b"\x94\x85\x94R\x94":
            raise _Miss
        self.pos = pos + 6
        shape = tuple(values)
        shape = self.shapes.setdefault(shape, shape)
        at = len(self.pending)
        self.shape_puts.append((at, at + 2))
        self.pending += (shape, ELIDED, shape)
        return shape

    def new_object(self, module: str, name: str) -> None:
        """GET <class> EMPTY_TUPLE NEWOBJ MEMOIZE: a dataclass instance made empty."""
        cls = self.get()
        if cls.__class__ is not GlobalRef or cls.module != module or cls.name != name:
            raise _Miss
        self.object_body()

    def object_body(self) -> None:
        """EMPTY_TUPLE NEWOBJ MEMOIZE."""
        pos = self.pos
        if self.raw[pos : pos + 3] != b")\x81\x94":
            raise _Miss
        self.pos = pos + 3
        self.pending.append(ELIDED)

    def fields(self, read: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """EMPTY_DICT MEMOIZE, its items (SETITEM, or MARK ... SETITEMS), BUILD: the state dict
        as {name: value} and its nodes. ``read`` reads each known name's value and weight."""
        pos = self.pos
        if self.raw[pos : pos + 2] != b"}\x94":  # EMPTY_DICT MEMOIZE
            raise _Miss
        self.pos = pos + 2
        self.pending.append(ELIDED)
        values: dict[str, Any] = {}
        nodes = 1
        marked = self.peek() == 0x28
        if marked:
            self.pos += 1
        while True:
            code = self.peek()
            if code == 0x75 and marked:  # SETITEMS
                self.pos += 1
                break
            if code in (0x62, 0x73, 0x75):  # BUILD, SETITEM
                raise _Miss
            before = len(self.vars) if self.vars is not None else -1
            key = self.string()
            reader = read.get(key)
            if reader is None or key in values:
                raise _Miss
            first, shapes = len(self.vars) if self.vars is not None else -1, len(self.shape_puts)
            values[key], weight = reader(self)
            nodes += self.string_weight(key) + weight
            if self.plan is not None:
                self._trace_field(key, values[key], before, first, shapes)
            if not marked:
                self.op(0x73)  # SETITEM: one item
                break
        self.op(0x62)  # BUILD
        return values, nodes

    def _trace_field(self, key: str, value: Any, before: int, first: int, shapes: int) -> None:
        """Where field ``key``'s ``value`` came from, for a layout: a constant, a variable, or
        a shape of variables (``before``, ``first``: variables before its key and its value)."""
        if self.vars is None or self.plan is None or before != first:  # a new key: no layout
            self.plan = None
            return
        count = len(self.vars) - first
        puts = tuple(p for put in self.shape_puts[shapes:] for p in put)
        if count == 0:  # (a shape of no dimensions: the template holds its () where it went)
            self.plan.append((key, CONSTANT, value, ()))
        elif count == 1 and not puts and value.__class__ in (int, str):
            self.plan.append((key, VARIABLE, first, ()))
        elif value.__class__ is tuple and count == len(value) and len(puts) == 2:
            self.plan.append((key, SHAPE, tuple(range(first, first + count)), puts))
        else:
            self.plan = None


def _size(r: _Reader) -> tuple[tuple[int, ...], int]:
    shape = r.size()
    return shape, len(shape) + 1


def _size_or_none(r: _Reader) -> tuple[Any, int]:
    if r.peek() == 0x4E:
        r.pos += 1
        return None, 1
    return _size(r)


def _integer(r: _Reader) -> tuple[Any, int]:
    return r.integer(), 1


def _string(r: _Reader) -> tuple[str, int]:
    value = r.string()
    return value, r.string_weight(value)


def _none(r: _Reader) -> tuple[None, int]:
    r.op(0x4E)
    return None, 1


def _flag(r: _Reader) -> bool:
    code = r.peek()
    if code != 0x88 and code != 0x89:  # NEWTRUE, NEWFALSE
        raise _Miss
    r.pos += 1
    return code == 0x88


def _properties(r: _Reader) -> tuple[tuple[str, bool], int]:
    """A ``TensorProperties``: its state is the tuple its ``__getstate__`` gives."""
    r.new_object(METADATA_MODULE, "TensorProperties")
    r.op(0x28)  # MARK
    dtype = r.get()
    layout = r.get()
    if dtype.__class__ is not TorchDtype or layout.__class__ is not TorchLayout:
        raise _Miss
    requires_grad = _flag(r)
    memory_format = r.get()
    _flag(r)  # pin_memory
    r.op(0x74)  # TUPLE
    r.memoize(ELIDED)
    r.op(0x62)  # BUILD
    r.shared.append(memory_format)
    # the object (4: itself, args, dictitems, listitems) and its state tuple of five; the
    # dtype as finalize writes it, one string per dtype (not one per tensor)
    name = _DTYPE_NAMES.get(dtype.name)
    if name is None:
        name = _DTYPE_NAMES.setdefault(dtype.name, str(dtype))
    return (name, requires_grad), 4 + 5


_CHUNK_FIELDS = {"offsets": _size, "sizes": _size}
_CHUNK_ORDER = list(_CHUNK_FIELDS)  # the order torch writes them in


def _chunk(r: _Reader) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], int]:
    r.new_object(METADATA_MODULE, "ChunkStorageMetadata")
    values, nodes = r.fields(_CHUNK_FIELDS)
    if len(values) != 2:
        raise _Miss
    if list(values) != _CHUNK_ORDER:
        r.vars = None  # read, but no layout
    return (values["offsets"], values["sizes"]), 4 + nodes


def _chunks(r: _Reader) -> tuple[tuple[Any, ...], int]:
    """EMPTY_LIST MEMOIZE, then each chunk with APPEND, or MARK chunks APPENDS (per 1,000)."""
    r.op(0x5D)  # EMPTY_LIST
    r.memoize(ELIDED)
    chunks = []
    nodes = 1
    while True:
        code = r.peek()
        if code == 0x28:  # MARK
            r.pos += 1
            while r.peek() != 0x65:  # APPENDS
                chunk, weight = _chunk(r)
                chunks.append(chunk)
                nodes += weight
            r.pos += 1
        elif code == 0x68 or code == 0x6A:  # a chunk, then APPEND
            chunk, weight = _chunk(r)
            r.op(0x61)
            chunks.append(chunk)
            nodes += weight
        else:
            return tuple(chunks), nodes


_TENSOR_FIELDS = {"properties": _properties, "size": _size, "chunks": _chunks}
_TENSOR_ORDER = list(_TENSOR_FIELDS)
_INDEX_FIELDS = {"fqn": _string, "offset": _size_or_none, "index": _integer}
_INFO_FIELDS = {
    "relative_path": _string, "offset": _integer, "length": _integer,
    "transform_descriptors": _none,
}  # fmt: skip


def _tensor(r: _Reader) -> TensorMeta:
    values, nodes = r.fields(_TENSOR_FIELDS)
    if len(values) != 3:
        raise _Miss
    if list(values) != _TENSOR_ORDER:
        r.vars = None  # read, but no layout: ``TensorLayout`` reads shapes in this order
    (dtype, requires_grad), size, chunks = values["properties"], values["size"], values["chunks"]
    return TensorMeta(dtype, requires_grad, size, chunks, 4 + nodes, tuple(r.shared))


def _index(r: _Reader) -> IndexMeta:
    values, nodes = r.fields(_INDEX_FIELDS)
    return IndexMeta(values, 4 + nodes, tuple(r.shared))


def _info(r: _Reader) -> InfoMeta:
    values, nodes = r.fields(_INFO_FIELDS)
    return InfoMeta(values, 4 + nodes, tuple(r.shared))


_RECORDS = {
    (METADATA_MODULE, "TensorStorageMetadata"): _tensor,
    (METADATA_MODULE, "MetadataIndex"): _index,
    (FILESYSTEM_MODULE, "_StorageInfo"): _info,
}
#: The modules of the classes this path reads (the walker's first, cheap test).
MODULES = frozenset(module for module, _ in _RECORDS)


def dcp_call(u: Any, raw: bytes, pos: int, cls: GlobalRef) -> tuple[int, Any] | None:
    """Read the object of class ``cls`` (just fetched from the memo; ``pos`` is past the GET).

    Returns (offset past its BUILD, its compact record) with the memo updated as the opcodes
    would have, or ``None`` with nothing changed. A record is read with a layout made from an
    earlier one of its class where one fits (a file has a few: one per dims, chunk count,
    integer widths, name length), else read and made one of.
    """
    read: Any = _RECORDS.get((cls.module, cls.name))
    if read is None or u.memo:  # sparse memo indices: MEMOIZE numbering is the general loop's
        return None
    kind = u.call_state.get(cls.name)
    if kind is None:
        kind = u.call_state[cls.name] = Layouts()
    trace = kind.worth_it
    if trace and kind.layouts:
        made = replay(kind, u, raw, pos)
        if made is not None:
            u.compacts += 1
            return made
    r = _Reader(u, raw, pos, trace=trace)
    try:
        r.object_body()
        record = read(r)
    except (_Miss, IndexError, struct.error, UnicodeDecodeError):
        return None
    if trace:
        layout = (tensor_layout if read is _tensor else fields_layout)(r, pos, record, u.overwrites)
        if layout is not None:
            kind.add(layout)
    u.memo_list.extend(r.pending)
    u.compacts += 1
    return r.pos, record


#: What the DCP reader hands the walker for a ``.metadata`` (:mod:`ckpttool.pickle.hooks`).
DCP_CALL = CompactCall(MODULES, OPCODES, COMPACT, dcp_call)


__all__ = ["DCP_CALL", "MODULES", "OPCODES", "dcp_call"]
