"""``scan``'s own walk of a file the reader gave up on: every pickle torch.load would run.

``torch.load`` reads any file that is not a zip as a legacy stream of pickles, and the first one
runs whatever it names before torch looks at the magic number it should hold. So when
the reader (:func:`ckpttool.formats.registry.open_file`) refuses a file -- a first opcode it does not expect
(protocol 0's ``V``, ``S``, ``N``, ``I``..., a ``FRAME``), a pickle it cannot finish, a legacy
stream broken after its object -- ``scan`` walks the pickles itself, in scan mode, and reports
every global they named up to where the walk stopped; a walk error is then "could not scan"
beside them, and "dangerous" wins. A file is left to the reader's verdict (a file a directory
scan skips) only when it positively is something else: its first byte cannot begin a pickle
(every unpickler fails on it before running anything), it starts with the signature of a known
non-pickle format, or it is text whose walk fails where the C unpickler fails too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.errors import (
    CkptError,
    NotACheckpointError,
    ResourceLimitError,
    UnsafePickleError,
)
from ckpttool.formats.torch_legacy.reader import MAGIC_NUMBER
from ckpttool.io.source import is_url
from ckpttool.pickle.interpreter import SafeUnpickler, TruncatedPickleError
from ckpttool.pickle.policy import Verdict
from ckpttool.pickle.scan import add_linear_globals, persistent_placeholder

#: A legacy stream's pickles: magic number, protocol, system info, the object, storage keys.
LEGACY_PICKLES = 5
FIRST_WINDOW = 1 << 24
#: Bytes read at most: a pickle that needs more is reported as not fully scanned.
MAX_WINDOW = 1 << 28

#: Opcodes a pickle can begin with without failing at once in the C unpickler: pushes, MARK,
#: PROTO, FRAME, GLOBAL (which imports), PERSID, and the extension-registry lookups.
PICKLE_START = frozenset(
    b"\x80\x95(ILFSVNKJMGTUBCX\x8c\x8d\x8e\x96\x8a\x8b)]}\x8f\x88\x89cP\x82\x83\x84"
)
#: Signatures of formats that are not pickles (images, archives, other model formats).
KNOWN_SIGNATURES = (
    b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*", b"%PDF", b"\x1f\x8b",
    b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd", b"7z\xbc\xaf\x27\x1c", b"\x7fELF", b"GGUF",
    b"\x89HDF\r\n\x1a\n", b"\x93NUMPY",
)  # fmt: skip
_TEXT_CONTROLS = frozenset(range(32)) - {9, 10, 12, 13}

_Counts = Counter[tuple[str, str, Verdict]]


@dataclass
class StreamWalk:
    """What a walk of a file's pickles found."""

    counts: _Counts = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)  # attacks (BUILD on a global, ambiguity)
    problem: str | None = None  # why the walk stopped early
    error: CkptError | None = None  # the walk's own error, if any
    pickles: int = 0  # pickles read to their STOP


class _NeedMore(Exception):
    """The walk ran past the bytes read so far: read more and walk again."""


def walk_stream(data: bytes, whole: bool) -> StreamWalk:
    """Globals of the file's first pickle, and of the next four when it holds the legacy magic
    number (``whole``: ``data`` is all there is to read)."""
    walk = StreamWalk()
    start = 0
    for index in range(LEGACY_PICKLES):
        unpickler = SafeUnpickler(
            data, start, persistent_load=persistent_placeholder, refuse_dangerous=False
        )
        try:
            result = unpickler.load()
        except CkptError as error:
            if isinstance(error, TruncatedPickleError) and not whole:
                raise _NeedMore from None
            walk.counts.update(unpickler.result.globals_seen)
            add_linear_globals(walk.counts, data, start)
            walk.error = error
            if isinstance(error, UnsafePickleError):
                walk.notes.append(str(error))
            else:
                walk.problem = f"pickle not fully readable: {error}"
            return walk
        walk.counts.update(result.globals_seen)
        walk.pickles += 1
        if index == 0 and result.root != MAGIC_NUMBER:
            break  # a bare pickle: torch.load stops after it (wrong magic number)
        start = result.end
        if start >= len(data):
            break
    return walk


def salvage_pickles(
    path: Path | str, reader_error: CkptError, other_format: Callable[[bytes, int], bool]
) -> tuple[str, _Counts, list[str], list[str]] | None:
    """(format, globals, notes, problems) of the file's pickles after the reader refused it with
    ``reader_error``; None when the file is positively not a pickle (or remote, or another
    format by ``other_format(first 64 bytes, size)``: the reader's verdict stands)."""
    if isinstance(path, str) and is_url(path):
        return None
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(0)
        head = handle.read(64)
        if not head or other_format(head, size):
            return None
        window = min(FIRST_WINDOW, size)
        while True:
            handle.seek(0)
            data = handle.read(window)
            try:
                walk = walk_stream(data, whole=window >= min(size, MAX_WINDOW))
                break
            except _NeedMore:
                window = min(window * 4, size, MAX_WINDOW)
    if not walk.counts and not walk.pickles and not walk.notes and _something_else(data, walk):
        return None
    problems = []
    if walk.problem is not None:
        if len(data) < size and isinstance(walk.error, TruncatedPickleError):
            walk.problem += f" (not scanned past the first {MAX_WINDOW:,} bytes)"
        problems.append(walk.problem)
    elif not isinstance(reader_error, NotACheckpointError) and not walk.notes:
        problems.append(str(reader_error))  # the pickles are whole; the reader's reason stands
    fmt = "torch-legacy" if walk.pickles > 1 else "pickle"
    return fmt, walk.counts, walk.notes, problems


def _something_else(data: bytes, walk: StreamWalk) -> bool:
    """Whether a file whose first pickle failed before naming anything is positively not a
    pickle (see the module docstring)."""
    if data[0] not in PICKLE_START or data.startswith(KNOWN_SIGNATURES):
        return True
    definite = not isinstance(walk.error, ResourceLimitError) and "unsupported pickle" not in str(
        walk.error
    )
    return definite and _is_text(data[:4096])


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 3:  # not just a character cut at the window's end
            return False
    return not _TEXT_CONTROLS.intersection(head)


__all__ = ["salvage_pickles", "walk_stream"]
