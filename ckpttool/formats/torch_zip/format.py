"""torch.save's zip archive (torch >= 1.6) as a :class:`~ckpttool.formats.base.FileFormat`.

Recognised by a zip's first record or empty directory; opened by :mod:`.reader`; verified
record by record (:mod:`.verify`); recovered when damaged (:mod:`.recover`); scanned pickle by pickle (:mod:`.scan`); written by
:mod:`.writer` (``convert``'s ``.pth``). Each is imported only when used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.formats.base import Checkpoint, FileFormat, Findings, OutTensor, Parsed, Recovered

if TYPE_CHECKING:
    from ckpttool.io.blocks import FileRange
    from ckpttool.io.progress import ProgressCallback


class TorchZipFormat(FileFormat):
    id = "torch-zip"
    ids = ("torch-zip", "torch-export")  # a .pt2's weights are read here too (.pt2)

    def recognises(self, head: bytes, file_size: int, handle: BinaryIO) -> bool:
        return head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06")

    def open(
        self,
        handle: BinaryIO,
        file_size: int,
        *,
        strict: bool,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> Parsed:
        from ckpttool.formats.torch_zip.kinds import is_torch_export
        from ckpttool.formats.torch_zip.reader import open_zip, read_torch_zip

        directory = open_zip(handle)
        if is_torch_export(directory.namelist()):
            from ckpttool.formats.torch_zip.pt2 import read_pt2

            return read_pt2(handle, directory)
        return read_torch_zip(
            handle, refuse_dangerous=refuse_dangerous, track_spans=track_spans, directory=directory
        )

    def verify(
        self, ckpt: Checkpoint, progress: ProgressCallback | None
    ) -> tuple[list[str], list[str]]:
        from ckpttool.formats.torch_zip.verify import verify_torch_zip

        return verify_torch_zip(ckpt, progress)

    def scan(self, path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
        from ckpttool.formats.torch_zip.scan import scan_zip

        return scan_zip(path, opener)

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        if "models" not in details:  # a torch.save zip: no lines of its own
            return []
        from ckpttool.formats.torch_zip.pt2 import show_lines

        return show_lines(details)

    def recover(self, handle: BinaryIO, file_size: int) -> Recovered | None:
        from ckpttool.formats.torch_zip.recover import recover_torch_zip

        return recover_torch_zip(handle, file_size)

    def write(
        self,
        handle: BinaryIO,
        tensors: Sequence[OutTensor],
        data: Iterable[bytes | bytearray | memoryview | FileRange],
        names: Sequence[str],
        aliases: Mapping[str, str],
        metadata: Mapping[str, str],
    ) -> int:
        """A state dict of plain tensors, one storage each (an alias names its stored tensor's
        storage), entries in source order; ``metadata`` has no place in a .pth. Its bytes are
        never a range to copy (``copies_ranges`` is off: each record's CRC-32 is taken as its
        bytes pass)."""
        from ckpttool.formats.torch_zip.writer import PickledTensor, write_pth

        keys = {t.name: str(i) for i, t in enumerate(tensors)}
        by_name = {t.name: t for t in tensors}
        entries = []
        for name in names:
            stored = by_name[aliases.get(name, name)]
            entries.append(PickledTensor(name, keys[stored.name], replace(stored, name=name)))
        write_pth(handle, entries, zip(keys.values(), _bytes_only(data)))
        return handle.tell()


def _bytes_only(
    data: Iterable[bytes | bytearray | memoryview | FileRange],
) -> Iterator[bytes | bytearray | memoryview]:
    for chunk in data:
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise TypeError("a .pth is written from bytes, not ranges (copies_ranges is off)")
        yield chunk


FORMAT = TorchZipFormat()
