"""Change a few top-level fields of a pickled dict without unpickling or re-pickling the rest.

Re-pickling a checkpoint means building every object it holds (torch, every tensor in memory)
and trusting a second pickler to reproduce the first one's bytes. Splicing does neither: the
reader (``track_spans=True``) reports where each top-level item's value sits in the pickle; a
changed value's bytes are replaced by freshly emitted opcodes for the new value, and new keys
are added by ``MARK key value ... SETITEMS`` right before the final ``STOP``, where the root
dict is the only thing on the stack. Every other byte stays as it was.

Two things could make such an edit change the meaning of bytes it does not touch, and both are
refused rather than guessed around:

* a memo ``PUT`` inside a replaced span whose index a ``GET`` elsewhere reads (the value is
  shared); and an implicit ``MEMOIZE`` (protocol 4+) there, whose removal would renumber every
  later memo entry;
* ``FRAME`` opcodes (protocol 4+), whose byte lengths a splice would break. torch writes
  protocol 2, which has neither.
"""

from __future__ import annotations

import itertools
import pickletools
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import LayoutError
from ckpttool.model.records import NumpyDtypeText, TorchDtypeText
from ckpttool.pickle.interpreter import ItemSpan, PickleResult

__all__ = [
    "Edit",
    "dtype_opcodes",
    "emit",
    "emit_global",
    "emit_numpy_dtype",
    "root_edits",
    "splice",
]

_MARK, _STOP, _SETITEMS, _APPENDS = b"(", b".", b"u", b"e"
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})


@dataclass(frozen=True)
class Edit:
    """Replace the bytes ``[start, end)`` with ``data`` (``start == end``: an insertion)."""

    start: int
    end: int
    data: bytes


def emit(value: Any) -> bytes:
    """Protocol-2 opcodes that push ``value`` (plain int/float/str/bool/None/list/dict).

    No memo PUTs are emitted, so the memo indices of the surrounding pickle are never disturbed.
    Raises ``TypeError`` for anything else (tensors and objects are never re-emitted).
    """
    out = bytearray()
    _emit(value, out, depth=0)
    return bytes(out)


def memo_put(index: int) -> bytes:
    """BINPUT (LONG_BINPUT past 255): store the value just written at memo ``index``."""
    return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def emit_global(module: str, name: str) -> bytes | None:
    """Protocol-2 opcodes that push the global ``module.name`` (a class, a function), as
    protocol 2 writes it: ``GLOBAL``, and for a nested name (``HistoryBuffer.min``, a class's
    staticmethod or nested class) the ``getattr`` chain pickle writes below protocol 4, which
    is the only form a protocol-2 ``find_class`` follows (and the reader reads back as the same
    name: :func:`ckpttool.pickle.callables.lookup_name`). None for a name no ``GLOBAL`` line
    can hold (not ASCII, a newline, an empty part)."""
    first, *attributes = name.split(".")
    text = f"{module}{name}"
    if not module or not all((first, *attributes)) or "\n" in text or not text.isascii():
        return None
    out = bytearray(b"cbuiltins\ngetattr\n" * len(attributes))
    out += f"c{module}\n{first}\n".encode("ascii")
    for attribute in attributes:
        out += emit(attribute) + b"\x86R"  # TUPLE2 REDUCE: getattr(outer, attribute)
    return bytes(out)


def memo_get(index: int) -> bytes:
    """BINGET (LONG_BINGET past 255): the value stored at memo ``index`` again (an object met
    twice, written once)."""
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def emit_ndarray(
    code: str, order: str, shape: tuple[int, ...], fortran: bool, data: bytes
) -> bytes:
    """Protocol-2 opcodes that push a NumPy array as NumPy's ``__reduce__`` gives it:
    ``numpy.core.multiarray._reconstruct(numpy.ndarray, (0,), b"b")``, then BUILD with
    ``(1, shape, numpy.dtype(code, False, True), fortran, data)``, the dtype BUILT with its
    byte ``order`` ("<", ">" or "|"). Bytes as protocol 2 writes them (``_codecs.encode``)."""
    out = bytearray(b"cnumpy.core.multiarray\n_reconstruct\n")
    out += b"cnumpy\nndarray\n" + emit(0) + b"\x85" + _emit_bytes(b"b") + b"\x87R"
    out += _MARK + emit(1) + _MARK + b"".join(emit(n) for n in shape) + b"t"
    out += emit_numpy_dtype(code, order)
    out += emit(fortran) + _emit_bytes(data) + b"tb"
    return bytes(out)


def dtype_opcodes(text: TorchDtypeText | NumpyDtypeText) -> bytes:
    """Protocol-2 opcodes that push the dtype the reader held as ``text`` (``torch.float16``:
    the global; ``numpy.dtype('<f4')``: the dtype NumPy pickles)."""
    if isinstance(text, NumpyDtypeText):
        order, code = text.order_and_code
        return emit_numpy_dtype(code, order)
    opcodes = emit_global("torch", text.removeprefix("torch."))
    assert opcodes is not None  # a dtype's name
    return opcodes


def emit_numpy_dtype(code: str, order: str) -> bytes:
    """Protocol-2 opcodes that push ``numpy.dtype(code)`` with the byte ``order`` ("<", ">",
    "|"), as NumPy's ``__reduce__`` gives it: ``numpy.dtype(code, False, True)``, then BUILD."""
    out = b"cnumpy\ndtype\n" + emit(code) + emit(False) + emit(True) + b"\x87R"
    return out + _MARK + emit(3) + emit(order) + b"NNN" + emit(-1) + emit(-1) + emit(0) + b"tb"


def _emit_bytes(data: bytes) -> bytes:
    return b"c_codecs\nencode\n" + emit(data.decode("latin1")) + emit("latin1") + b"\x86R"


def _emit(value: Any, out: bytearray, depth: int) -> None:
    if depth > 32:
        raise TypeError("value nests too deeply to re-emit")
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        out += _emit_int(value)
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)
    elif isinstance(value, str):
        encoded = value.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(encoded)) + encoded
    elif isinstance(value, list):
        out += b"]"
        if value:
            out += _MARK
            for item in value:
                _emit(item, out, depth + 1)
            out += _APPENDS
    elif isinstance(value, dict):
        out += b"}"
        if value:
            out += _MARK
            for key, item in value.items():
                _emit(key, out, depth + 1)
                _emit(item, out, depth + 1)
            out += _SETITEMS
    else:
        raise TypeError(f"cannot re-emit a {type(value).__name__} as a plain pickle value")


def _emit_int(value: int) -> bytes:
    # The smallest encoding, as pickle's own protocol-2 writer picks it.
    if 0 <= value < 0x100:
        return b"K" + bytes([value])
    if 0 <= value < 0x10000:
        return b"M" + struct.pack("<H", value)
    if -(1 << 31) <= value < (1 << 31):
        return b"J" + struct.pack("<i", value)
    encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    if len(encoded) > 255:
        raise TypeError("integer too large to re-emit")
    return b"\x8a" + bytes([len(encoded)]) + encoded


def root_edits(
    result: PickleResult,
    read: Callable[[int, int], bytes],
    changes: Mapping[str, Any],
    *,
    where: str = "the pickle",
) -> list[Edit]:
    """The edits that set ``changes`` on the pickle's top-level dict, in offset order.

    ``result`` comes from a ``track_spans=True`` read; ``read(start, end)`` returns the pickle's
    bytes between two of its offsets (the same coordinates as ``result``'s spans). Keys already
    in the dict keep their place (the last occurrence, the one a loader keeps, is replaced); new
    keys go at the end in ``changes``' order. Raises :class:`LayoutError` when the pickle cannot
    be edited safely (see the module docstring).
    """
    if result.frames:
        raise LayoutError(
            f"{where} uses pickle FRAMEs (protocol 4 or later); ckpttool splices only the "
            "protocol-2 pickles torch.save writes"
        )
    if result.stop_at < 0:
        raise LayoutError(f"{where}: the reader did not track item spans")
    spans: dict[Any, ItemSpan] = {}
    for item in result.root_items:
        spans[item.key] = item  # a later SETITEM of the same key wins, as in a real load
    edits: list[Edit] = []
    appended = bytearray()
    for key, value in changes.items():
        try:
            encoded = emit(value)
        except TypeError as error:
            raise LayoutError(f"{where}: cannot write field {key!r}: {error}") from None
        span = spans.get(key)
        if span is None:
            appended += emit(key) + encoded
            continue
        _check_removable(result, read(span.value_start, span.value_end), span, where)
        edits.append(Edit(span.value_start, span.value_end, encoded))
    if appended:
        edits.append(Edit(result.stop_at, result.stop_at, _MARK + bytes(appended) + _SETITEMS))
    edits.sort(key=lambda edit: (edit.start, edit.end))
    for before, after in itertools.pairwise(edits):
        if after.start < before.end:
            raise LayoutError(f"{where}: the fields to change overlap in the pickle")
    return edits


def _check_removable(result: PickleResult, span_bytes: bytes, span: ItemSpan, where: str) -> None:
    """Refuse to drop a span whose memo entries are read elsewhere (or renumber later ones)."""
    removed: set[int] = set()
    try:
        # genops walks opcodes up to a STOP; a value span has none of its own.
        for opcode, arg, _ in pickletools.genops(span_bytes + _STOP):
            if opcode.name == "MEMOIZE":
                raise LayoutError(
                    f"{where}: the value of {span.key!r} is memoized implicitly (protocol 4+); "
                    "replacing it would renumber the memo"
                )
            if opcode.name in _MEMO_PUTS:
                removed.add(int(arg))  # type: ignore[arg-type]  # a PUT's arg is its index
    except ValueError as error:
        raise LayoutError(f"{where}: cannot walk the value of {span.key!r} ({error})") from None
    shared = [
        index
        for index, offset in result.memo_gets
        if index in removed and not span.value_start <= offset < span.value_end
    ]
    if shared:
        raise LayoutError(
            f"{where}: the value of {span.key!r} is shared with another part of the file "
            f"(pickle memo entry {shared[0]}); ckpttool will not change it in place"
        )


def splice(size: int, edits: list[Edit]) -> Iterator[tuple[int, int] | bytes]:
    """The new content as pieces: ``(start, end)`` ranges of the old bytes, or new bytes.

    ``size`` is the length of the old content; ``edits`` come from :func:`root_edits`.
    """
    position = 0
    for edit in edits:
        if edit.start > position:
            yield (position, edit.start)
        if edit.data:
            yield edit.data
        position = edit.end
    if position < size:
        yield (position, size)
