"""The walker's fast path for the one call ``torch.save`` writes per tensor.

Every tensor of a ``torch.save`` file is the same 26 opcodes (protocol 2)::

    BINGET <_rebuild_tensor_v2> MARK MARK BINGET <'storage'> BINGET <FloatStorage>
    BINUNICODE <key> BINPUT BINGET <'cpu'> BININT1 <numel> TUPLE BINPUT BINPERSID
    BININT1 <offset> BININT1 BININT1 TUPLE2 BINPUT BININT1 BININT1 TUPLE2 BINPUT NEWFALSE
    BINGET <OrderedDict> EMPTY_TUPLE REDUCE BINPUT TUPLE BINPUT REDUCE BINPUT

and only the arguments change from one tensor to the next (memo indices, the storage key, the
numbers). Interpreting them one by one (a stack push, a MARK frame, a dispatch each) was half
the time of listing a checkpoint of many small tensors. So the first time a sequence is met,
:func:`compile_layout` parses it opcode by opcode into a :class:`Layout`: a ``struct`` format
that reads the whole sequence in one call, the opcodes it must find there, and where each
argument sits. :func:`tensor_call` then reads each later tensor with the layout that fits (a
file has a handful: one per storage-key length, shape rank, int width...), compares its opcodes
in one tuple comparison, and makes what the general loop would make: the same calls
(``persistent_load``, the ``OrderedDict``, the tensor rebuild: the emulation
:meth:`SafeUnpickler.call <ckpttool.pickle.interpreter.SafeUnpickler.call>` would run), the
same memo entries holding the same objects, the same one item pushed.

It changes nothing until the whole sequence has been read and every call has returned. Any
byte that departs from the pattern (another opcode, a memo index this sequence itself put, the
end of the data), and any error a call raises, makes it answer ``None``; the general loop then
reads the same bytes itself, raises what it raises, at the offset it names. So a file reads the
same, error for error, with or without it; ``tests/test_tensor_call.py`` checks that over the
fixtures, the hostile corpus and mutated pickles. Nothing here runs code named by the pickle:
the layout is data (a format string and index tuples), built from a fixed set of opcodes.
"""

from __future__ import annotations

import struct
from operator import itemgetter
from typing import Any

from ckpttool.pickle.emulation import storage_tensor

OPCODES = 26  # what one call counts towards the walker's periodic checks
MAX_LAYOUTS = 16  # layouts kept per pickle (most recently used first)
MAX_KEY = 64  # bytes of a storage key a layout holds (torch's are decimal numbers)

_GET = {0x68: "B", 0x6A: "I"}  # BINGET, LONG_BINGET: the memo index
_PUT = {0x71: "B", 0x72: "I"}  # BINPUT, LONG_BINPUT
_INT = {0x4B: "B", 0x4D: "H", 0x4A: "i"}  # BININT1, BININT2, BININT
_TUPLE_N = {0x85: 1, 0x86: 2, 0x87: 3}  # TUPLE1..3
_PUT_ROLES = ("key", "pid", "size", "stride", "hooks", "args", "tensor")


class Layout:
    """How one tensor's call sequence sits in the bytes, for one set of opcode widths."""

    __slots__ = (
        "early_puts",
        "expected",
        "flag",
        "gets",
        "key_at",
        "key_put",
        "length",
        "numel_at",
        "offset_at",
        "opcodes",
        "put_roles",
        "puts",
        "read",
        "size",
        "stride",
    )

    def __init__(self, fmt: str, codes: list[tuple[int, int]], roles: dict[str, Any]) -> None:
        compiled = struct.Struct("<" + fmt)
        self.read = compiled.unpack_from
        self.length = compiled.size
        # the items that hold opcodes (and the key's length), and the values they must have
        self.opcodes = itemgetter(*[at for at, _ in codes])
        self.expected = tuple(code for _, code in codes)
        self.gets = itemgetter(*roles["gets"])  # memo indices: tag, storage class, location, hooks
        self.key_at = roles["key"]
        self.numel_at = roles["numel"]
        self.offset_at = roles["offset"]
        self.size = _tuple_getter(roles["size"])
        self.stride = _tuple_getter(roles["stride"])
        self.flag = roles["flag"]
        # the PUTs present: their items, and which value each stores (index in _PUT_ROLES)
        present = [
            (roles[f"{name}_put"], n) for n, name in enumerate(_PUT_ROLES) if f"{name}_put" in roles
        ]
        self.puts = _tuple_getter([at for at, _ in present])
        self.put_roles = tuple(n for _, n in present)
        self.key_put = "key_put" in roles  # the first PUT is the key's
        # PUTs before the GET of OrderedDict (of the key, the storage id, the size, the stride)
        self.early_puts = sum(1 for _, n in present if n < 4)


def _tuple_getter(at: list[int]) -> Any:
    if not at:
        return lambda values: ()
    if len(at) == 1:
        only = at[0]
        return lambda values: (values[only],)
    return itemgetter(*at)


class _Miss(Exception):
    """The bytes depart from the pattern: the general loop reads them instead."""


def compile_layout(raw: bytes, pos: int) -> Layout | None:
    """Parse the call sequence at ``pos`` (just past the rebuild's GET) into a layout, or None
    where it is not the pattern (the general loop reads it)."""
    fmt: list[str] = []
    codes: list[tuple[int, int]] = []  # (item index, the value it must have)
    roles: dict[str, Any] = {}
    gets: list[int] = []
    items = 0
    p = pos

    def op(allowed: dict[int, str] | None = None, code_only: int = -1) -> int:
        """The opcode at p, recorded with its argument's format; returns the argument's item."""
        nonlocal p, items
        code = raw[p]
        if allowed is None:
            if code != code_only:
                raise _Miss
            width = ""
        elif code in allowed:
            width = allowed[code]
        else:
            raise _Miss
        fmt.append("B" + width)
        codes.append((items, code))
        items += 2 if width else 1
        p += 1 + (struct.calcsize("<" + width) if width else 0)
        if p > len(raw):
            raise _Miss
        return items - 1

    def put(role: str) -> None:
        if raw[p] in _PUT:
            roles[f"{role}_put"] = op(_PUT)

    def ints() -> list[int]:
        at: list[int] = []
        if raw[p] == 0x29:  # EMPTY_TUPLE
            op(None, 0x29)
            return at
        while raw[p] in _INT:
            at.append(op(_INT))
            if len(at) > 3:
                raise _Miss
        if _TUPLE_N.get(raw[p]) != len(at):
            raise _Miss
        op(None, raw[p])
        return at

    try:
        op(None, 0x28)  # MARK
        op(None, 0x28)  # MARK
        gets.append(op(_GET))  # 'storage'
        gets.append(op(_GET))  # the storage class
        op(None, 0x58)  # BINUNICODE: the storage key
        length = int.from_bytes(raw[p : p + 4], "little")
        if length > MAX_KEY or p + 4 + length > len(raw):
            raise _Miss
        fmt.append(f"I{length}s")
        codes.append((items, length))
        roles["key"] = items + 1
        items += 2
        p += 4 + length
        put("key")
        gets.append(op(_GET))  # the location
        roles["numel"] = op(_INT)
        op(None, 0x74)  # TUPLE
        put("pid")
        op(None, 0x51)  # BINPERSID
        roles["offset"] = op(_INT)
        roles["size"] = ints()
        put("size")
        roles["stride"] = ints()
        put("stride")
        flag = raw[p]
        if flag != 0x88 and flag != 0x89:  # NEWTRUE, NEWFALSE
            raise _Miss
        roles["flag"] = flag == 0x88
        op(None, flag)
        gets.append(op(_GET))  # OrderedDict
        op(None, 0x29)  # EMPTY_TUPLE
        op(None, 0x52)  # REDUCE
        put("hooks")
        op(None, 0x74)  # TUPLE
        put("args")
        op(None, 0x52)  # REDUCE
        put("tensor")
    except (_Miss, IndexError):
        return None
    roles["gets"] = gets
    return Layout("".join(fmt), codes, roles)


def _find_layout(
    layouts: list[Layout], raw: bytes, pos: int
) -> tuple[Layout, tuple[Any, ...]] | None:
    """The layout that reads the bytes at ``pos`` (most recently used first, after the first,
    which ``tensor_call`` tried; a new one parsed when none does) and the values it read."""
    for number, layout in enumerate(layouts[1:], 1):
        try:
            values = layout.read(raw, pos)
        except struct.error:  # the bytes end first
            continue
        if layout.opcodes(values) == layout.expected:
            layouts.insert(0, layouts.pop(number))
            return layout, values
    found = compile_layout(raw, pos)
    if found is None:
        return None
    if len(layouts) >= MAX_LAYOUTS:
        layouts.pop()
    layouts.insert(0, found)
    return found, found.read(raw, pos)


def tensor_call(u: Any, raw: bytes, pos: int, func: Any) -> tuple[int, Any] | None:
    """Read one tensor rebuild call whose function ``func`` was just fetched from the memo.

    ``pos`` is the offset just past that ``BINGET``. Returns (offset past the sequence, the
    tensor), with the memo updated as the opcodes would have; or ``None`` with nothing changed.
    """
    layouts: list[Layout] = u.layouts
    values: tuple[Any, ...] = ()
    if layouts:  # the last layout that fit: in a run of tensors alike, it does
        layout = layouts[0]
        try:
            values = layout.read(raw, pos)
        except struct.error:  # the bytes end first
            pass
    if not values or layout.opcodes(values) != layout.expected:
        found = _find_layout(layouts, raw, pos)
        if found is None:
            return None
        layout, values = found
    memo_list, memo = u.memo_list, u.memo
    put_indices = layout.puts(values)
    tag_at, type_at, location_at, hooks_at = layout.gets(values)
    if (layout.key_put and location_at == put_indices[0]) or hooks_at in put_indices[
        : layout.early_puts
    ]:
        return None  # a GET of what this very sequence PUT
    known = len(memo_list)
    try:
        tag, storage_type, location, hooks_func = [
            memo_list[at] if at < known else memo[at]
            for at in (tag_at, type_at, location_at, hooks_at)
        ]
    except KeyError:
        return None
    made: Any = None
    hooks: Any
    try:
        key = str(values[layout.key_at], "utf-8", "surrogatepass")
        # one tuple per distinct shape and stride: a file of 100,000 (4, 4) tensors held
        # 200,000 equal tuples (11 MB); they are immutable, so sharing them changes nothing
        shapes = u.shapes
        size = layout.size(values)
        size = shapes.setdefault(size, size)
        stride = layout.stride(values)
        stride = shapes.setdefault(stride, stride)
        pid = (tag, storage_type, key, location, values[layout.numel_at])
        storage = u.persistent_load(pid)
        made = hooks = u.call(hooks_func, ())  # OrderedDict(): the emulation's, marked made
        offset = values[layout.offset_at]
        args = (storage, offset, size, stride, layout.flag, hooks)
        # what ``call`` runs for _rebuild_tensor_v2 (the walker checked that ``func`` is it)
        tensor = storage_tensor(storage, offset, size, stride, layout.flag)
    except Exception:  # any error: the general loop reads the bytes and decides
        if made is not None:
            u.created.discard(id(made))
        return None
    made_values = (key, pid, size, stride, hooks, args, tensor)
    for index, role in zip(put_indices, layout.put_roles):
        value = made_values[role]
        if index == known:
            memo_list.append(value)
            known += 1
            if memo:
                memo.pop(index, None)
        elif index < known:
            memo_list[index] = value
            u.overwrites += 1
        else:
            memo[index] = value
    return pos + layout.length, tensor


__all__ = ["MAX_LAYOUTS", "OPCODES", "Layout", "compile_layout", "tensor_call"]
