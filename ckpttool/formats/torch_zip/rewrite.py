"""Rewrite a checkpoint with a few top-level fields changed and every other byte copied.

This is the IO half of an in-place repair such as ``rescale-step``: the object pickle is
spliced (:mod:`ckpttool.pickle.edit`), and the rest of the file is copied from the original by
the kernel (``copy_file_range``; a bounded read/write loop where it is unavailable), so memory
stays flat however large the file is, the bytes never pass through Python, and torch is never
imported. torch zip files are rebuilt record by record under the same names, in the same order
and with the same CRCs, by :class:`~ckpttool.formats.torch_zip.zip_writer.TorchZipWriter`; legacy files
and bare pickles keep the bytes before and after the object pickle verbatim.

:func:`verify_rewrite` reopens the result with the reader and checks that exactly the intended
fields changed; callers run it on the temp file before it replaces anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from ckpttool.errors import (
    CorruptCheckpointError,
    LayoutError,
    RewriteCheckError,
)
from ckpttool.formats.base import Checkpoint
from ckpttool.formats.registry import open_path
from ckpttool.formats.torch_zip.reader import find_data_pkl, member_span, open_zip
from ckpttool.formats.torch_zip.zip_writer import TorchZipWriter, copy_range
from ckpttool.io.progress import ProgressCallback
from ckpttool.model.records import walk
from ckpttool.pickle.edit import Edit, root_edits, splice

__all__ = ["FieldRewrite", "RewriteCheckError", "verify_rewrite"]


class FieldRewrite:
    """The planned rewrite of ``ckpt`` with ``changes`` set on its top-level dict.

    Creating it validates the edit (raises :class:`LayoutError` when the pickle cannot be
    spliced safely) without writing anything, so a dry run sees the same refusals as a real one.
    """

    def __init__(self, ckpt: Checkpoint, changes: Mapping[str, Any]) -> None:
        if ckpt.format not in ("torch-zip", "torch-legacy", "pickle") or ckpt.pickle is None:
            raise LayoutError(f"{ckpt.path}: a {ckpt.format} file has no pickle to edit")
        if not isinstance(ckpt.root, dict):
            raise LayoutError(f"{ckpt.path}: the file's object is not a dict")
        self.ckpt = ckpt
        self.changes = dict(changes)
        self.source = open(ckpt.path, "rb")  # noqa: SIM115 - closed by close()
        try:
            if os.fstat(self.source.fileno()).st_size != ckpt.file_size:
                raise CorruptCheckpointError(f"{ckpt.path} changed while it was being read")
            self.pkl_name: str | None = None
            self.pkl: bytes = b""
            if ckpt.format == "torch-zip":
                self._read_data_pkl()
                where = f"{ckpt.path}: {self.pkl_name}"
                read: Callable[[int, int], bytes] = self._pkl_slice
            else:
                where = str(ckpt.path)
                read = self._pread
            self.edits: list[Edit] = root_edits(ckpt.pickle, read, self.changes, where=where)
        except BaseException:
            self.source.close()
            raise

    def _read_data_pkl(self) -> None:
        self.archive = open_zip(self.source)
        self.pkl_name = find_data_pkl(self.archive.namelist())
        offset, length = member_span(self.source, self.archive.getinfo(self.pkl_name))
        self.pkl = self._pread(offset, offset + length)

    def _pkl_slice(self, start: int, end: int) -> bytes:
        return self.pkl[start:end]

    def _pread(self, start: int, end: int) -> bytes:
        data = os.pread(self.source.fileno(), end - start, start)
        if len(data) != end - start:
            raise CorruptCheckpointError(f"{self.ckpt.path} ends early (truncated?)")
        return data

    def write(self, out: BinaryIO, progress: ProgressCallback | None = None) -> None:
        """Write the new file to ``out`` (seekable, positioned at 0)."""
        try:
            if self.ckpt.format == "torch-zip":
                self._write_zip(out, progress)
                return
            for piece in splice(self.ckpt.file_size, self.edits):
                if isinstance(piece, bytes):
                    out.write(piece)
                    continue
                out.flush()
                at = out.tell()
                start, end = piece
                copy_range(self.source.fileno(), start, out.fileno(), at, end - start, progress)
                out.seek(at + end - start)
        except EOFError:
            raise CorruptCheckpointError(f"{self.ckpt.path} ends early (truncated?)") from None

    def _write_zip(self, out: BinaryIO, progress: ProgressCallback | None) -> None:
        new_pkl = b"".join(
            piece if isinstance(piece, bytes) else self.pkl[piece[0] : piece[1]]
            for piece in splice(len(self.pkl), self.edits)
        )
        writer = TorchZipWriter(out)
        for info in self.archive.infolist():
            if info.filename == self.pkl_name:
                writer.write(info.filename, new_pkl)
                continue
            # Byte for byte, so the record's CRC stays valid (and still detects damage that
            # was already in the source).
            offset, length = member_span(self.source, info)
            writer.write_copy(
                info.filename, self.source.fileno(), offset, length, info.CRC, progress
            )
        writer.close()

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> FieldRewrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_rewrite(
    old: Checkpoint, new_path: str | os.PathLike[str], changes: Mapping[str, Any]
) -> None:
    """Reopen ``new_path`` and check it is ``old`` with exactly ``changes`` applied.

    Same format; top-level keys in the old order with new keys appended; the changed fields
    equal to ``changes``; every other value (tensor records included: dtype, shape, stride,
    offset, storage name and size) equal to the old one. Raises :class:`RewriteCheckError`.
    """
    with open_path(new_path) as new:
        problem = _first_difference(old, new, changes)
    if problem:
        raise RewriteCheckError(
            f"the rewritten file does not read back as intended ({problem}); it was removed "
            "and the original is untouched. Please report this as a ckpttool bug"
        )


def _first_difference(old: Checkpoint, new: Checkpoint, changes: Mapping[str, Any]) -> str:
    if new.format != old.format:
        return f"format {new.format} instead of {old.format}"
    expected_keys = list(old.root) + [key for key in changes if key not in old.root]
    if list(new.root) != expected_keys:
        return f"top-level keys {list(new.root)} instead of {expected_keys}"
    for key, value in changes.items():
        if not _same(new.root[key], value):
            return f"{key!r} is {new.root[key]!r} instead of {value!r}"
    for key in old.root:
        if key in changes:
            continue
        old_leaves = list(walk(old.root[key], str(key)))
        new_leaves = list(walk(new.root[key], str(key)))
        if len(old_leaves) != len(new_leaves):
            return f"{key!r} has {len(new_leaves)} values instead of {len(old_leaves)}"
        for (old_name, old_leaf), (new_name, new_leaf) in zip(old_leaves, new_leaves):
            if old_name != new_name or not _same(old_leaf, new_leaf):
                return f"{old_name!r} changed"
    return ""


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)
