"""GGUF as a format plug-in: recognised by its magic, read by :mod:`.reader` (lazily: the
header, never a tensor's bytes), verified by opening (alignment, extents, overlaps, trailing
bytes: the reader's problems), scanned without opening (a GGUF holds no pickle). ckpttool
does not write GGUF: that stays with llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO

from ckpttool.formats.base import FileFormat, Findings, Parsed

MAGIC = b"GGUF"


class GgufFormat(FileFormat):
    id = "gguf"
    ids = ("gguf",)
    weights_only = True

    def recognises(self, head: bytes, file_size: int, handle: BinaryIO) -> bool:
        return head[:4] == MAGIC

    def open(
        self,
        handle: BinaryIO,
        file_size: int,
        *,
        strict: bool,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> Parsed:
        from ckpttool.formats.gguf.reader import read_gguf

        return read_gguf(handle, file_size, strict=strict)

    def scan(self, path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
        """A GGUF file holds no pickle: nothing ``torch.load`` would run (``torch.load`` does not
        read GGUF at all). A file that does not start with the magic is left to the others."""
        with opener(path) as handle:
            head = handle.read(4)
        if head != MAGIC:
            return None
        return Findings("gguf")

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        from ckpttool.formats.gguf.show import show_lines

        return show_lines(details)


FORMAT = GgufFormat()
