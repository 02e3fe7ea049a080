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
calls :func:`check_frame` at each ``FRAME`` and raises :class:`AmbiguousPickleError` when the
frame does not hold whole opcodes that end exactly at its end (and, when it holds the
``STOP``, end with it). Python's and torch's picklers only ever write such frames.
"""

from __future__ import annotations

from ckpttool.errors import UnsafePickleError


class AmbiguousPickleError(UnsafePickleError):
    """The pickle reads differently in torch.load than in a linear reader (see the module)."""


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


def check_frame(data: bytes | bytearray, frame_pos: int, length: int) -> None:
    """Raise :class:`AmbiguousPickleError` unless the frame announced at ``frame_pos`` (``length``
    bytes, starting 9 bytes later) holds whole opcodes, no ``FRAME``, and, if it holds the
    ``STOP``, nothing after it. The caller has checked that the frame lies within ``data``."""
    start = frame_pos + 9
    end = start + length
    pos = start
    while pos < end:
        op = data[pos]
        width = _FIXED.get(op, _UNKNOWN)
        nxt = pos + 1
        if width >= 0:
            nxt += width
        elif width == _UNKNOWN:
            prefixed = _PREFIXED.get(op)
            if prefixed is None:
                return  # not an opcode: every reader fails here (the walker says where)
            size, signed = prefixed
            if nxt + size > end:
                nxt += size  # the length itself crosses the end
            else:
                count = int.from_bytes(data[nxt : nxt + size], "little", signed=signed)
                if count < 0:
                    return  # a negative length: every reader fails here
                nxt += size + count
        else:
            for _ in range(-width):
                newline = data.find(b"\n", nxt, end)
                if newline < 0:
                    nxt = end + 1  # the line runs past the frame's end
                    break
                nxt = newline + 1
        if op == FRAME and nxt <= end:
            raise _ambiguous(frame_pos, f"a FRAME begins inside it, at byte {pos}")
        if nxt > end:
            raise _ambiguous(
                frame_pos,
                f"the opcode at byte {pos} (0x{op:02x}) runs past its end (byte {end})",
            )
        if op == STOP and nxt < end:
            raise _ambiguous(frame_pos, f"{end - nxt} bytes follow the STOP at byte {pos}")
        pos = nxt


def _ambiguous(frame_pos: int, what: str) -> AmbiguousPickleError:
    return AmbiguousPickleError(
        f"refusing to read: the pickle's FRAME at byte {frame_pos} is irregular ({what}): "
        "torch.load and a linear reader such as pickle.loads would run different opcodes "
        "(a known way to hide a payload from scanners; nothing was run). Do not load this file "
        "with torch.load"
    )


__all__ = ["AmbiguousPickleError", "check_frame"]
