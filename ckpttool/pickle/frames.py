"""Pickle FRAMEs that torch.load and a linear reader would read differently: refused as ambiguous.

A ``FRAME`` (protocol 4+) announces that the next N bytes hold whole opcodes. Readers disagree
on what a frame that does not end on an opcode boundary means:

* ``pickle.loads`` (the C unpickler on bytes) ignores frames: it reads the opcodes linearly, as
  ckpttool's walker does;
* the C unpickler on a file without ``peek`` -- ``torch.load`` of a zip checkpoint hands it
  ``io.BytesIO(data.pkl)`` -- loads each frame as its buffer; an argument, or a text line, that
  runs past the frame's end makes it drop the frame's remaining bytes and read the argument
  from the bytes after the frame (``_Unpickler_ReadImpl`` in CPython's ``_pickle.c``), so the
  opcodes that follow are not the ones a linear reader sees;
* on a buffered file (a legacy checkpoint opened by path) it reads linearly or by frames
  depending on where the file's buffer happens to end;
* the pure-Python unpickler (``pickle._Unpickler``) refuses such a frame ("pickle exhausted
  before end of frame"), and a ``FRAME`` that begins inside another.

A file whose frames admit two readings can hide a payload from any linear checker (the
published scanner bypasses do exactly this), so ckpttool reads nothing from it: the walker
raises :class:`AmbiguousPickleError` when a frame does not hold whole opcodes that end exactly
at its end (it stops where the frame ends: :func:`ends_an_opcode` looks at the last step; a
walk that fails inside a frame checks it whole, :func:`check_frame`), when a ``FRAME`` begins
inside another, and when bytes follow the ``STOP`` inside its frame. Python's and torch's
picklers only ever write regular frames.
"""

from __future__ import annotations

import struct

from ckpttool.errors import AmbiguousPickleError

_LINE = -1  # one text line (up to and including "\n")
_TWO_LINES = -2  # GLOBAL and INST: module and name, each a line
_UNKNOWN = -3  # not an opcode: the walker fails there, linear or not

#: Argument of each opcode: a fixed byte count, or (width of its length prefix, signed).
_FIXED: dict[int, int] = {
    **{op: 0 for op in b"()./012NRQabdelostu}]\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94"},
    **{op: 0 for op in b"\x97\x98"},
    **{op: 1 for op in b"Khq\x80\x82"},
    **{op: 2 for op in b"M\x83"},
    **{op: 4 for op in b"Jjr\x84"},
    **{op: 8 for op in b"G\x95"},
    **{op: _LINE for op in b"ILFSVPgp"},
    **{op: _TWO_LINES for op in b"ci"},
}
_PREFIXED: dict[int, tuple[int, bool]] = {
    **{op: (1, False) for op in b"UC\x8c\x8a"},
    **{op: (4, True) for op in b"T\x8b"},
    **{op: (4, False) for op in b"BX"},
    **{op: (8, False) for op in b"\x8e\x8d\x96"},
}
FRAME = 0x95
STOP = 0x2E


_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from
# Per opcode byte: its fixed argument width (>= 0), or how to find its end (< 0). A table
# lookup per opcode: the check reads every framed byte once, so its cost shows on protocol-4
# pickles (DCP's .metadata; bench/README.md).
_STEP = [_UNKNOWN] * 256
for _op, _width in _FIXED.items():
    _STEP[_op] = _width
_SPECIAL_FRAME, _SPECIAL_STOP = -10, -11
_STEP[FRAME], _STEP[STOP] = _SPECIAL_FRAME, _SPECIAL_STOP
# length-prefixed arguments: -20 one byte, -22 four bytes, -23 eight bytes, -24 four signed
for _op, (_size, _signed) in _PREFIXED.items():
    _STEP[_op] = -24 if _signed else {1: -20, 4: -22, 8: -23}[_size]


def check_frame(data: bytes | bytearray, frame_pos: int, length: int) -> None:
    """Raise :class:`AmbiguousPickleError` unless the frame announced at ``frame_pos`` (``length``
    bytes, starting 9 bytes later) holds whole opcodes, no ``FRAME``, and, if it holds the
    ``STOP``, nothing after it. The caller has checked that the frame lies within ``data``."""
    end = frame_pos + 9 + length
    pos = frame_pos + 9
    step = _STEP
    while pos < end:
        op = data[pos]
        width = step[op]
        if width >= 0:
            pos += 1 + width
            continue
        if width == -20:  # a 1-byte length: SHORT_BINUNICODE, SHORT_BINBYTES...
            if pos + 2 > end:
                break
            pos += 2 + data[pos + 1]
        elif width == -22 or width == -24:  # a 4-byte length (BINUNICODE; signed: LONG4...)
            if pos + 5 > end:
                break
            count = (_U32 if width == -22 else _I32)(data, pos + 1)[0]
            if count < 0:
                return  # a negative length: every reader fails here
            pos += 5 + count
        elif width == -23:  # an 8-byte length: BINBYTES8...
            if pos + 9 > end:
                break
            pos += 9 + _U64(data, pos + 1)[0]
        elif width in (_LINE, _TWO_LINES):
            nxt = pos + 1
            for _ in range(-width):
                newline = data.find(b"\n", nxt, end)
                if newline < 0:
                    raise ambiguous(frame_pos, _crossing(pos, op, end))
                nxt = newline + 1
            pos = nxt
        elif width == _SPECIAL_FRAME:
            if pos + 9 <= end:
                raise ambiguous(frame_pos, f"a FRAME begins inside it, at byte {pos}")
            break
        elif width == _SPECIAL_STOP:
            if pos + 1 < end:
                raise ambiguous(frame_pos, f"{end - pos - 1} bytes follow the STOP at byte {pos}")
            return
        else:
            return  # not an opcode: every reader fails here (the walker says where)
    else:
        if pos == end:
            return
    last = _last_start(data, frame_pos + 9, end)
    raise ambiguous(frame_pos, _crossing(last, data[last], end))


def _last_start(data: bytes | bytearray, start: int, end: int) -> int:
    """Where the opcode that runs past ``end`` begins (for the message; a second, rare walk)."""
    pos = start
    while True:
        nxt = _next(data, pos)
        if nxt >= end or nxt < 0:
            return pos
        pos = nxt


def _next(data: bytes | bytearray, pos: int) -> int:
    """Where the opcode at ``pos`` ends (past the data when its argument does; -1: no opcode)."""
    width = _STEP[data[pos]]
    beyond = len(data) + 1
    if width >= 0:
        return pos + 1 + width
    if width == _SPECIAL_STOP:
        return pos + 1
    if width == _SPECIAL_FRAME:
        return pos + 9
    if width == -20:
        return pos + 2 + data[pos + 1] if pos + 2 <= len(data) else beyond
    if width in (-22, -24):
        if pos + 5 > len(data):
            return beyond
        return pos + 5 + max(0, (_U32 if width == -22 else _I32)(data, pos + 1)[0])
    if width == -23:
        return pos + 9 + _U64(data, pos + 1)[0] if pos + 9 <= len(data) else beyond
    if width in (_LINE, _TWO_LINES):
        nxt = pos + 1
        for _ in range(-width):
            newline = data.find(b"\n", nxt)
            if newline < 0:
                return beyond
            nxt = newline + 1
        return nxt
    return -1


def _crossing(pos: int, op: int, end: int) -> str:
    return f"the opcode at byte {pos} (0x{op:02x}) runs past its end (byte {end})"


def ends_an_opcode(data: bytes | bytearray, start: int, end: int) -> bool:
    """Whether, reading opcodes linearly from ``start`` (where one begins), one ends at ``end``."""
    pos = start
    while 0 <= pos < end:
        pos = _next(data, pos)
    return pos == end


def ambiguous(frame_pos: int, what: str) -> AmbiguousPickleError:
    return AmbiguousPickleError(
        f"refusing to read: the pickle's FRAME at byte {frame_pos} is irregular ({what}): "
        "torch.load and a linear reader such as pickle.loads would run different opcodes "
        "(a known way to hide a payload from scanners; nothing was run). Do not load this file "
        "with torch.load"
    )


__all__ = ["AmbiguousPickleError", "ambiguous", "check_frame", "ends_an_opcode"]
