"""The legacy stream of pickles (and a bare pickle) as a :class:`~ckpttool.formats.base.FileFormat`.

Recognised by a first byte that can begin the pickles torch.save writes; opened by
:mod:`.reader`; verified for bytes after the last storage; recovered by :mod:`.recover`; probed by the registry when another
format's file may also be unpickled by ``torch.load`` (:meth:`LegacyFormat.also_reads_as`). The
walk of a file the reader gave up on, for ``scan``, is :mod:`.salvage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.errors import CkptError
from ckpttool.formats.base import Checkpoint, FileFormat, Parsed, Recovered

if TYPE_CHECKING:
    from ckpttool.io.progress import ProgressCallback

#: First bytes of the pickles torch.save writes (protocols 0 to 5: its magic number is a LONG,
#: a LONG1 or a PROTO) and of plain pickled dicts, lists and globals.
PICKLE_STARTS = (b"\x80", b"(", b"}", b"]", b"c", b"L", b"\x8a")
#: How far another format's reading of a file looks for a pickle reading too (a benign
#: safetensors file's first bytes may read as a pickle opcode claiming a long argument), and
#: what it reads first (the walk of a benign file's bytes fails within a few opcodes).
MAX_PICKLE_PROBE = 64 << 20
FIRST_PICKLE_PROBE = 64 << 10
#: Opcodes whose argument's length is the next 8 bytes (FRAME, BINUNICODE8, BINBYTES8,
#: BYTEARRAY8): as a safetensors file's first byte, their length is the header length's other
#: bytes and its "{", over 2**56: no file holds that, so no pickle reading is looked for.
_LONG8_OPCODES = (0x95, 0x8D, 0x8E, 0x96)


class LegacyFormat(FileFormat):
    id = "torch-legacy"
    ids = ("torch-legacy", "pickle")

    def recognises(self, head: bytes, file_size: int, handle: BinaryIO) -> bool:
        return head[:1] in PICKLE_STARTS

    def open(
        self,
        handle: BinaryIO,
        file_size: int,
        *,
        strict: bool,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> Parsed:
        from ckpttool.formats.torch_legacy.reader import read_pickle_stream

        return read_pickle_stream(
            handle, file_size, refuse_dangerous=refuse_dangerous, track_spans=track_spans
        )

    def also_reads_as(self, handle: BinaryIO, file_size: int) -> tuple[str, list[Any]] | None:
        """What the file is as a pickle stream, if ``torch.load`` would run or read anything
        of it (a legacy stream, or a pickle that names a global, even one that fails after),
        and the globals it names."""
        from ckpttool.formats.torch_legacy.reader import read_pickle_stream
        from ckpttool.model.records import StorageRecord
        from ckpttool.pickle.interpreter import SafeUnpickler

        handle.seek(0)
        head = handle.read(9)
        handle.seek(0)
        if head[0] in _LONG8_OPCODES and int.from_bytes(head[1:9], "little") > file_size:
            return None  # pickle.load fails on its first opcode too, having run nothing
        try:
            stream = read_pickle_stream(
                handle,
                file_size,
                refuse_dangerous=False,
                track_spans=False,
                limit=MAX_PICKLE_PROBE,
                first=FIRST_PICKLE_PROBE,
            )
        except CkptError:
            pass
        else:
            assert stream.pickle is not None
            if stream.format != "pickle":
                return "a pickle stream (torch's legacy format)", stream.pickle.globals_seen
            if stream.pickle.globals_seen:
                return "a pickle", stream.pickle.globals_seen
            return None
        handle.seek(0)
        data = handle.read(min(file_size, FIRST_PICKLE_PROBE))
        handle.seek(0)
        placeholder = StorageRecord("?", "uint8", 0, "cpu", "", 0)
        unpickler = SafeUnpickler(
            data, persistent_load=lambda pid: placeholder, refuse_dangerous=False
        )
        try:
            unpickler.load()
        except CkptError:
            pass  # what it named before it failed, torch.load calls before it fails
        found = unpickler.result.globals_seen
        return ("a pickle", found) if found else None

    def recover(self, handle: BinaryIO, file_size: int) -> Recovered | None:
        """A legacy file's storages that are whole (its pickles must be), written out again as
        a legacy file; a bare pickle up to its STOP opcode (:mod:`.recover`)."""
        from ckpttool.formats.torch_legacy.recover import recover_pickle_stream

        return recover_pickle_stream(handle, file_size)

    def verify(
        self, ckpt: Checkpoint, progress: ProgressCallback | None
    ) -> tuple[list[str], list[str]]:
        trailing = ckpt.details.get("trailing_bytes")
        if ckpt.format == "torch-legacy" and trailing:
            return [f"{trailing:,} bytes after the last storage"], []
        return [], []


FORMAT = LegacyFormat()
