"""Writes torch-compatible zip checkpoints one record at a time (streaming, bounded memory).

Records are stored uncompressed with their data aligned to 64 bytes (torch pads the local
header's extra field the same way, which is what lets ``torch.load(mmap=True)`` map storages).
Each record's CRC is computed while its bytes stream through, then patched into the local
header, so no record is ever held in memory whole. Zip64 structures are written when sizes or
offsets need them. The handle must be seekable (ckpttool always writes to a temp file).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from ckpttool.io.blocks import copy_range, write_data
from ckpttool.io.crc import crc32
from ckpttool.io.progress import ProgressCallback

ALIGNMENT = 64
_LOCAL = struct.Struct("<4s5H3I2H")
_CENTRAL = struct.Struct("<4s6H3I5H2I")
_EOCD = struct.Struct("<4s4H2IH")
_ZIP64_EOCD = struct.Struct("<4sQ2H2I4Q")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_PAD_ID = 0x4246  # "FB", the extra-field id torch uses for its alignment padding
_ZIP64_ID = 0x0001
_MAX32 = 0xFFFFFFFF
_FLAGS = 0x800  # names are UTF-8
_VERSION = 45  # zip64-capable


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int


class TorchZipWriter:
    """``with TorchZipWriter(handle) as zw: zw.write("archive/data.pkl", pickle_bytes)``."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.entries: list[_Entry] = []
        self.names: set[str] = set()

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        self.write_stream(name, [data])

    def write_stream(self, name: str, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        """Write a record whose bytes arrive in chunks (e.g. a storage copied from a file)."""
        encoded, offset = self._begin(name)
        crc, size = 0, 0
        for chunk in chunks:
            crc = crc32(chunk, crc)
            size += len(chunk)
            write_data(self.handle, chunk)  # a large chunk: its writeback starts at once
        self._finish(encoded, offset, crc, size)

    def write_copy(
        self,
        name: str,
        source_fd: int,
        source_offset: int,
        size: int,
        crc: int,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Write a record whose bytes are ``size`` bytes of another file, copied in the kernel.

        For rewriting a zip with most records unchanged: the bytes never pass through Python
        (``os.copy_file_range``, a plain read/write loop where that is unavailable) and ``crc``
        is the record's known CRC-32 (from the source archive), not recomputed.
        """
        encoded, offset = self._begin(name)
        self.handle.flush()
        start = self.handle.tell()
        copy_range(source_fd, source_offset, self.handle.fileno(), start, size, progress)
        self.handle.seek(start + size)
        self._finish(encoded, offset, crc, size)

    def _begin(self, name: str) -> tuple[bytes, int]:
        """Write the local header (sizes and CRC patched by _finish); return (name, offset)."""
        if name in self.names:
            raise ValueError(f"duplicate zip record {name!r}")
        self.names.add(name)
        encoded = name.encode("utf-8")
        offset = self.handle.tell()
        # local header, name, zip64 field (4 + 16 bytes), padding field header (4 bytes)
        header_end = offset + _LOCAL.size + len(encoded) + 20 + 4
        padding = (-header_end) % ALIGNMENT
        extra = _zip64_local_placeholder() + struct.pack("<HH", _PAD_ID, padding) + bytes(padding)
        self.handle.write(_LOCAL.pack(b"PK\x03\x04", _VERSION, _FLAGS, 0, 0, 0, 0, 0, 0,
                                      len(encoded), len(extra)))  # fmt: skip
        self.handle.write(encoded)
        self.handle.write(extra)
        return encoded, offset

    def _finish(self, encoded: bytes, offset: int, crc: int, size: int) -> None:
        end = self.handle.tell()
        # patch CRC and sizes (32-bit fields say 0xFFFFFFFF when the zip64 field holds them)
        self.handle.seek(offset + 14)
        small = min(size, _MAX32)
        self.handle.write(struct.pack("<3I", crc, small, small))
        self.handle.seek(offset + _LOCAL.size + len(encoded) + 4)
        self.handle.write(struct.pack("<2Q", size, size))
        self.handle.seek(end)
        self.entries.append(_Entry(encoded, offset, size, crc))

    def close(self) -> None:
        start = self.handle.tell()
        for entry in self.entries:
            zip64 = struct.pack("<2Q", entry.size, entry.size) + struct.pack("<Q", entry.offset)
            extra = struct.pack("<HH", _ZIP64_ID, len(zip64)) + zip64
            self.handle.write(_CENTRAL.pack(
                b"PK\x01\x02", _VERSION, _VERSION, _FLAGS, 0, 0, 0, entry.crc, _MAX32, _MAX32,
                len(entry.name), len(extra), 0, 0, 0, 0, _MAX32,
            ))  # fmt: skip
            self.handle.write(entry.name)
            self.handle.write(extra)
        end = self.handle.tell()
        count = len(self.entries)
        self.handle.write(_ZIP64_EOCD.pack(
            b"PK\x06\x06", _ZIP64_EOCD.size - 12, _VERSION, _VERSION, 0, 0, count, count,
            end - start, start,
        ))  # fmt: skip
        self.handle.write(_ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, end, 1))
        self.handle.write(_EOCD.pack(b"PK\x05\x06", 0, 0, min(count, 0xFFFF),
                                     min(count, 0xFFFF), _MAX32, _MAX32, 0))  # fmt: skip

    def __enter__(self) -> TorchZipWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()


def _zip64_local_placeholder() -> bytes:
    return struct.pack("<HH", _ZIP64_ID, 16) + bytes(16)
