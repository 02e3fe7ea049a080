"""A byte range of a local file read as a file of its own: a member stored inside a zip archive.

A zip of checkpoint files (stable-baselines3's ``model.zip``) stores each member's bytes
uncompressed in one range of the archive; :class:`FileWindow` reads that range as the reader
reads any file (``seek``/``read`` for headers, ``read_range`` for tensor bytes), so each member
is opened by its own format without a byte being copied. Each window owns its own descriptor
(closing it closes nothing else's).
"""

from __future__ import annotations

import io
import os
from typing import Any

from ckpttool.io.source import read_at


class FileWindow(io.RawIOBase):
    """``size`` bytes of the local file ``path`` from ``offset``, as a file of that size."""

    def __init__(self, path: str, offset: int, size: int, name: str) -> None:
        super().__init__()
        self.name = name  # what errors call it ("model.zip/policy.pth")
        self.size = size
        self._offset = offset
        self._fd = os.open(path, os.O_RDONLY)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def read_range(self, offset: int, length: int) -> bytearray:
        """``length`` bytes at ``offset`` of the window, fewer only at its end."""
        length = max(0, min(length, self.size - offset))
        return read_at(self._fd, length, self._offset + offset) if length else bytearray()

    def readinto(self, buffer: Any) -> int:
        data = self.read_range(self._pos, len(buffer))
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        data = self.read_range(self._pos, max(0, self.size - self._pos))
        self._pos += len(data)
        return bytes(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class MemoryWindow(io.BytesIO):
    """Bytes in memory (a small compressed member, inflated) read as a file of their own."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.name = name
        self.size = len(data)
        self._data = data

    def read_range(self, offset: int, length: int) -> bytearray:
        return bytearray(self._data[offset : offset + max(0, length)])
