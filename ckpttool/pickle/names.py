"""The globals a pickle names past the point where the walk stopped: a linear read, for ``scan``.

When the walker gives up on a pickle (a limit the C unpickler does not have, an opcode ckpttool
does not read), ``torch.load`` may go on and import what follows. ``scan`` then reads the rest
of the opcodes linearly, without interpreting them, and reports every name a ``GLOBAL`` or
``INST`` spells and every ``STACK_GLOBAL`` whose two names are strings pushed just before it
(directly or through the memo): a lower bound of what follows, next to "could not scan". A
``STACK_GLOBAL`` whose names it cannot see and an ``EXT1``/``EXT2``/``EXT4`` code are
reported as ``<unresolved>`` names (dangerous: what they import is decided at load time).
"""

from __future__ import annotations

from ckpttool.pickle.frames import _FIXED, _LINE, _PREFIXED, _TWO_LINES, _UNKNOWN, STOP
from ckpttool.pickle.policy import UNRESOLVED

_STRINGS_PREFIXED = frozenset(b"X\x8c\x8dTU")
_EXTS = frozenset(b"\x82\x83\x84")
_PUTS = {ord("q"): 1, ord("r"): 4}
_GETS = {ord("h"): 1, ord("j"): 4}
MAX_OPCODES = 10_000_000


def linear_globals(data: bytes | bytearray, start: int = 0) -> list[tuple[str, str]]:
    """(module, name) of each global the opcodes from ``start`` to the STOP name (see above)."""
    names: list[tuple[str, str]] = []
    pushed: list[str | None] = []  # what the last opcodes pushed, when it was a string
    memo: dict[int, str | None] = {}
    pos, end = start, len(data)
    for _ in range(MAX_OPCODES):
        if pos >= end:
            break
        op = data[pos]
        width = _FIXED.get(op, _UNKNOWN)
        nxt = pos + 1
        value: str | None = None
        if width == _UNKNOWN:
            prefixed = _PREFIXED.get(op)
            if prefixed is None:
                break
            size, signed = prefixed
            count = int.from_bytes(data[nxt : nxt + size], "little", signed=signed)
            if count < 0 or nxt + size + count > end:
                break
            if op in _STRINGS_PREFIXED:
                value = bytes(data[nxt + size : nxt + size + count]).decode("utf-8", "replace")
            nxt += size + count
        elif width in (_LINE, _TWO_LINES):
            lines = []
            for _ in range(-width):
                newline = data.find(b"\n", nxt)
                if newline < 0:
                    return names
                lines.append(bytes(data[nxt:newline]).decode("utf-8", "replace"))
                nxt = newline + 1
            if width == _TWO_LINES:
                names.append((lines[0], lines[1]))
            elif op == ord("V"):
                value = lines[0]
            elif op in b"pg":
                index = int(lines[0]) if lines[0].strip().isdigit() else -1
                if op == ord("p"):
                    memo[index] = pushed[-1] if pushed else None
                else:
                    value = memo.get(index)
        else:
            nxt += width
            if op in _PUTS or op == 0x94:
                index = len(memo) if op == 0x94 else int.from_bytes(data[pos + 1 : nxt], "little")
                memo[index] = pushed[-1] if pushed else None
            elif op in _GETS:
                value = memo.get(int.from_bytes(data[pos + 1 : nxt], "little"))
            elif op == 0x93:
                if len(pushed) >= 2 and pushed[-2] and pushed[-1]:
                    names.append((str(pushed[-2]), str(pushed[-1])))
                else:  # names computed at load time, or pushed where this read cannot see
                    names.append((UNRESOLVED, f"STACK_GLOBAL at byte {pos} of unresolved names"))
            elif op in _EXTS:
                code = int.from_bytes(data[pos + 1 : nxt], "little")
                names.append(
                    (UNRESOLVED, f"EXT{nxt - pos - 1} code {code} (copyreg extension registry)")
                )
        if op == ord("0") and pushed:
            pushed.pop()
        elif op not in _PUTS and op not in (0x94, ord("p")):
            pushed.append(value)
            del pushed[:-8]
        if op == STOP:
            break
        pos = nxt
    return names


__all__ = ["linear_globals"]
