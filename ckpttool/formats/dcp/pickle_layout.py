"""Layouts: how the bytes of one kind of DCP ``.metadata`` record lie, made from the first
record of the kind that :mod:`ckpttool.formats.dcp.pickle_call` reads, and reading later ones in one
``struct`` call.

A layout is made from a *traced* read (``dcp_call``'s reader, which notes where each variable
sits: an integer, a new string's bytes). Only those variables may differ between records of
one layout; every byte between them (opcodes, the memo indices of the names and classes a record
fetches) must be the same, and what those memo indices hold is what they held when the layout
was made as long as no memo entry has been overwritten since (``SafeUnpickler.overwrites``).
"""

from __future__ import annotations

import struct
from operator import itemgetter
from typing import Any

from ckpttool.formats.dcp.pickle_records import ELIDED, TensorMeta

MAX_LAYOUTS = 16  # layouts kept per record class and pickle (most recently used first)
CONSTANT, VARIABLE, SHAPE = 0, 1, 2  # where a traced field's value comes from (``plan``)


def _format(r: Any, start: int) -> tuple[Any, int, Any, tuple[bytes, ...], Any]:
    """The struct that reads the sequence ``r`` just read from ``start`` again: (its
    ``unpack_from``, its length, the getter of the items between the variables, what they must
    be, the getter of the variables)."""
    assert r.vars is not None  # a traced read
    fmt: list[str] = []
    fixed: list[int] = []  # items of the unpacked tuple: the bytes between the variables
    variables: list[int] = []  # and the variables (integers, strings' bytes)
    expected: list[bytes] = []
    at = start
    for value_at, length, code in r.vars:
        fmt.append(f"{value_at - at}s")
        fixed.append(len(fixed) + len(variables))
        expected.append(r.raw[at:value_at])
        fmt.append(f"{length}s" if code == "s" else code)
        variables.append(len(fixed) + len(variables))
        at = value_at + length
    fmt.append(f"{r.pos - at}s")
    fixed.append(len(fixed) + len(variables))
    expected.append(r.raw[at : r.pos])
    compiled = struct.Struct("<" + "".join(fmt))
    return compiled.unpack_from, compiled.size, _getter(fixed), tuple(expected), _getter(variables)


class _Layout:
    """How the bytes of one kind of record lie (its memo indices, opcodes, integer widths,
    string lengths): made from the first of the kind, reads later ones in one step.

    Only the variables (integers, new strings' bytes) differ between records of one layout.
    ``read`` unpacks the whole record: the bytes between the variables must equal
    ``expected``. What the record's memo GETs fetch is what they fetched when the layout was
    made as long as no memo entry was overwritten since (``SafeUnpickler.overwrites``).
    """

    __slots__ = ("expected", "fixed", "length", "nodes", "overwrites", "read", "variables")

    def __init__(self, r: Any, start: int, nodes: int, overwrites: int) -> None:
        self.read, self.length, self.fixed, self.expected, self.variables = _format(r, start)
        self.nodes, self.overwrites = nodes, overwrites

    def values(self, u: Any, raw: bytes, pos: int) -> tuple[Any, ...] | None:
        """The variables of the record at ``pos``, or None if it is not of this layout."""
        try:
            values = self.read(raw, pos)
        except struct.error:  # the bytes end first
            return None
        if self.fixed(values) != self.expected or self.overwrites != u.overwrites:
            return None
        return self.variables(values)


class TensorLayout(_Layout):
    """A ``TensorStorageMetadata``'s layout (dims, chunk count, integer widths, flags): its
    variables are its shapes' integers, in order (``dims``)."""

    __slots__ = ("dims", "dtype", "puts", "requires_grad", "shared", "template")

    def __init__(self, r: Any, start: int, record: TensorMeta, overwrites: int) -> None:
        super().__init__(r, start, record.nodes, overwrites)
        self.dims = (len(record.size), *(len(part) for chunk in record.chunks for part in chunk))
        self.puts = tuple(r.shape_puts)  # where each shape goes among the memo entries
        self.template = tuple(r.pending)
        self.dtype, self.requires_grad, self.shared = (
            record.dtype,
            record.requires_grad,
            record.shared,
        )

    def replay(self, u: Any, integers: tuple[int, ...]) -> TensorMeta:
        interned = u.shapes.setdefault
        shapes = []
        at = 0
        for dims in self.dims:
            shape = integers[at : at + dims]
            shapes.append(interned(shape, shape))
            at += dims
        pending = list(self.template)
        for shape, puts in zip(shapes, self.puts):
            for put in puts:
                pending[put] = shape
        u.memo_list.extend(pending)
        chunks = tuple(zip(shapes[1::2], shapes[2::2]))
        return TensorMeta(
            self.dtype, self.requires_grad, shapes[0], chunks, self.nodes, self.shared
        )


def tensor_layout(r: Any, start: int, record: Any, overwrites: int) -> TensorLayout | None:
    """A layout of the tensor entry just read, if it can have one: fields in torch's order,
    its variables all its shapes' integers (no LONG1, no string, no shape fetched from the
    memo), no new string among its memo entries (a layout would share it between entries)."""
    if r.vars is None or any(code == "s" for _, _, code in r.vars):
        return None
    if not all(v is ELIDED or v.__class__ is tuple for v in r.pending):
        return None
    shapes = [record.size, *(part for chunk in record.chunks for part in chunk)]
    if len(r.shape_puts) != len(shapes) or sum(map(len, shapes)) != len(r.vars):
        return None
    return TensorLayout(r, start, record, overwrites)


class FieldsLayout(_Layout):
    """A ``MetadataIndex``'s or a ``_StorageInfo``'s layout: each field a constant, a
    variable (an integer, a new string) or a shape of variables (``plan``)."""

    __slots__ = ("make", "plan", "string_puts", "strings", "template")

    def __init__(self, r: Any, start: int, record: Any, overwrites: int) -> None:
        super().__init__(r, start, record.nodes, overwrites)
        assert r.vars is not None and r.plan is not None
        self.make = type(record)
        self.plan = tuple(r.plan)
        self.strings = tuple(n for n, (_, _, code) in enumerate(r.vars) if code == "s")
        self.string_puts = tuple(r.string_puts)
        self.template = tuple(r.pending)

    def replay(self, u: Any, values: tuple[Any, ...]) -> Any:
        variables = list(values)
        for n in self.strings:
            variables[n] = str(variables[n], "utf-8", "surrogatepass")
        pending = list(self.template)
        fields = {}
        for key, kind, data, puts in self.plan:
            if kind == CONSTANT:
                value = data
            elif kind == VARIABLE:
                value = variables[data]
            else:
                value = tuple([variables[n] for n in data])
                value = u.shapes.setdefault(value, value)
                for put in puts:
                    pending[put] = value
            fields[key] = value
        for put, n in self.string_puts:
            pending[put] = variables[n]
        u.memo_list.extend(pending)
        return self.make(fields, self.nodes, ())


def fields_layout(r: Any, start: int, record: Any, overwrites: int) -> FieldsLayout | None:
    """A layout of the index or storage record just read, if it can have one: every field
    traced, nothing shared for finalize to visit (no string of 64 bytes or more)."""
    if r.vars is None or r.plan is None or record.shared:
        return None
    return FieldsLayout(r, start, record, overwrites)


def _getter(at: list[int]) -> Any:
    """Items ``at`` of a tuple, as a tuple (itemgetter gives a bare item for one index)."""
    if len(at) == 1:
        only = at[0]
        return lambda values: (values[only],)
    return itemgetter(*at) if at else (lambda values: ())


class Layouts:
    """The layouts of one record class in one pickle (most recently used first), and how many
    were made and used: where records of the class seldom repeat a layout (each fetches its
    own memo entries), making and trying layouts would cost more than it saves, so it stops."""

    __slots__ = ("hits", "layouts", "made")

    def __init__(self) -> None:
        self.layouts: list[Any] = []
        self.made = self.hits = 0

    @property
    def worth_it(self) -> bool:
        return self.made < 2 * MAX_LAYOUTS or self.hits >= self.made

    def add(self, layout: Any) -> None:
        if len(self.layouts) >= MAX_LAYOUTS:
            self.layouts.pop()
        self.layouts.insert(0, layout)
        self.made += 1


def replay(kind: Layouts, u: Any, raw: bytes, pos: int) -> tuple[int, Any] | None:
    """The record at ``pos`` read with a layout of its ``kind`` that fits, or None."""
    layouts = kind.layouts
    for number, layout in enumerate(layouts):
        values = layout.values(u, raw, pos)
        if values is None:
            continue
        try:
            record = layout.replay(u, values)
        except UnicodeDecodeError:  # the general loop raises its error
            return None
        if number:
            layouts.insert(0, layouts.pop(number))
        kind.hits += 1
        return pos + layout.length, record
    return None


__all__ = [
    "CONSTANT", "MAX_LAYOUTS", "SHAPE", "VARIABLE", "FieldsLayout", "Layouts", "TensorLayout",
    "fields_layout", "replay", "tensor_layout",
]  # fmt: skip
