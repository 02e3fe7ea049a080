"""``verify`` for a zip archive: every record's local header against the directory, its CRC-32.

Opening the archive already read its central directory (``formats/zip_index``). This reads
what the directory points at: each record's local header, through the same reader, compared
field by field (name, compression, CRC), and every stored byte, streamed in bounded memory,
against the CRC-32 the directory gives. Problems are collected, not raised. Used for a torch
zip file and for each archive inside a DCP data file (``verify_dcp``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from ckpttool.formats.torch_zip import open_zip
from ckpttool.formats.zip_index import BadZipError, ZipIndex, ZipMember
from ckpttool.progress import ProgressCallback
from ckpttool.reader import Checkpoint, open_source
from ckpttool.records import stored_records
from ckpttool.source import RangeReader, read_range, source_of

CHUNK = 8 << 20


def check_zip_records(
    path: str | Path,
    progress: ProgressCallback | None = None,
    owners: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """Central directory vs local headers, and the CRC of every record, streamed.

    ``owners`` maps a record's name to the tensor keys whose bytes it holds, to name them in
    the problems found in it.
    """
    with open_source(str(path)) as handle:
        return check_archive(source_of(handle), open_zip(handle), 0, progress, owners)


def record_owners(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Zip record name -> the keys of the tensors stored in it (several when they share it)."""
    owners: dict[str, list[str]] = {}
    for record in ckpt.tensors():
        if record.storage is not None:
            owners.setdefault(record.storage.record, []).append(record.key)
    return owners


def _stored_in(keys: Sequence[str]) -> str:
    """``; it stores model.fc.weight, lm_head.weight``: which tensors a damaged record holds."""
    if not keys:
        return ""
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"; it stores {shown}"


def check_archive(
    fd: int | RangeReader,
    archive: ZipIndex,
    base: int,
    progress: ProgressCallback | None = None,
    owners: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """:func:`check_zip_records` for an archive that starts at byte ``base`` of ``fd``.

    ``archive`` reads its local headers itself (offsets relative to its start); the records'
    bytes are streamed from ``fd``.
    """
    problems = []
    for info in archive.infolist():
        stored_in = _stored_in((owners or {}).get(info.filename, ()))
        problems += [p + stored_in for p in _record_problems(fd, archive, info, base, progress)]
    return problems


def _record_problems(
    fd: int | RangeReader,
    archive: ZipIndex,
    info: ZipMember,
    base: int,
    progress: ProgressCallback | None,
) -> list[str]:
    """One record: its local header against the directory's entry, then its CRC-32."""
    try:
        header = archive.local_header(info)
    except BadZipError:  # before the file, cut off, or no signature there
        return [f"{info.filename}: no local header where the directory says"]
    problems = []
    if not header.names(info):
        problems.append(
            f"{info.filename}: the local header names it {header.raw_name!r} "
            "(central directory and local headers disagree)"
        )
    if header.method != info.compress_type:
        problems.append(f"{info.filename}: compression differs from the directory's")
    if not header.flags & 0x08 and header.crc != info.CRC:
        problems.append(f"{info.filename}: local header CRC differs from the directory's")
    if info.compress_type != 0:
        # Not inflated here (a zip bomb would cost minutes), so its CRC is not checked,
        # and no ckpttool command can read values from it: a problem, not a pass.
        problems.append(
            f"{info.filename}: compressed (torch never compresses records: a re-zipped "
            "file?); its bytes cannot be checked or read in place"
        )
        return problems
    actual = _crc_of(fd, base + header.data_start, info.file_size, progress)
    if actual is None:
        problems.append(f"{info.filename}: the file ends inside this record (truncated)")
    elif actual != info.CRC:
        problems.append(
            f"{info.filename}: CRC-32 is {actual:08x}, the archive says {info.CRC:08x} "
            "(the bytes were altered or damaged)"
        )
    return problems


def _crc_of(
    fd: int | RangeReader, start: int, size: int, progress: ProgressCallback | None
) -> int | None:
    crc = 0
    done = 0
    while done < size:
        chunk = read_range(fd, min(CHUNK, size - done), start + done)
        if not chunk:
            return None
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
        if progress is not None:
            progress(len(chunk))
    return crc


def unreferenced_records(ckpt: Checkpoint) -> list[str]:
    """Storage records in a torch zip that no tensor uses (not an error: reported as a note)."""
    if ckpt.format != "torch-zip":
        return []
    prefix = ckpt.details.get("prefix", "")
    used = {r.storage.record for r in stored_records(ckpt.tensors()) if r.storage is not None}
    with open_source(ckpt.name) as handle:
        names = open_zip(handle).namelist()
    data_prefix = f"{prefix}/data/" if prefix else "data/"
    return [n for n in names if n.startswith(data_prefix) and n not in used]


__all__ = ["check_archive", "check_zip_records", "record_owners", "unreferenced_records"]
