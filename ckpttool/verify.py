"""``verify``: a full integrity check of a checkpoint file, trusting nothing in it.

Opening a file through the reader already checks the pickle, every storage's size against the
bytes present and every tensor's extent. ``verify`` adds what costs a full read: the zip's
central directory against each local header, the CRC-32 of every record (streamed, bounded
memory), records nothing refers to; optionally NaN/Inf in every floating tensor. It also
reports temp files that interrupted saves left next to the file. Problems are collected, not
raised, so one run lists all of them; with several paths, one that cannot be checked at all
(missing, not a checkpoint) gets its own verdict and the others are still checked.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.atomic import temp_name_pattern
from ckpttool.errors import EXIT_ERROR, EXIT_FOUND, CkptError, InputError, NotACheckpointError
from ckpttool.formats.torch_zip import open_zip
from ckpttool.formats.zip_index import ZipIndex, ZipMember
from ckpttool.reader import Checkpoint, open_checkpoint
from ckpttool.values import tensor_stats

CHUNK = 8 << 20
_LOCAL = struct.Struct("<4s5H3I2H")


@dataclass
class VerifyResult:
    path: str
    format: str | None
    checked: list[str] = field(default_factory=list)  # what was checked, for the report
    problems: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # temp files of interrupted saves
    error: str | None = None  # why no check could run (missing, not a checkpoint)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems and not self.leftovers


def leftover_temp_files(path: Path) -> list[str]:
    """Temp files an interrupted save left beside ``path`` (ckpttool's and MiniMind's)."""
    directory = path.parent if str(path.parent) else Path(".")
    found = sorted(directory.glob(temp_name_pattern(path)))
    minimind_tmp = path.with_name(path.name + ".tmp")  # MiniMind: torch.save(tmp); os.replace
    if minimind_tmp.exists():
        found.append(minimind_tmp)
    return [str(p) for p in found]


def check_zip_records(
    path: Path,
    progress: Callable[[int], None] | None = None,
    owners: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """Central directory vs local headers, and the CRC of every record, streamed.

    ``owners`` maps a record's name to the tensor keys whose bytes it holds, to name them in
    the problems found in it.
    """
    with open(path, "rb") as handle:
        return check_archive(handle.fileno(), open_zip(handle), 0, progress, owners)


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
    fd: int,
    archive: ZipIndex,
    base: int,
    progress: Callable[[int], None] | None = None,
    owners: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """:func:`check_zip_records` for an archive that starts at byte ``base`` of ``fd``."""
    problems = []
    for info in archive.infolist():
        stored_in = _stored_in((owners or {}).get(info.filename, ()))
        problems += [p + stored_in for p in _record_problems(fd, info, base, progress)]
    return problems


def _record_problems(
    fd: int, info: ZipMember, base: int, progress: Callable[[int], None] | None
) -> list[str]:
    """One record: its local header against the directory's entry, then its CRC-32."""
    header = os.pread(fd, _LOCAL.size, base + info.header_offset)
    if len(header) != _LOCAL.size or header[:4] != b"PK\x03\x04":
        return [f"{info.filename}: no local header where the directory says"]
    problems = []
    fields = _LOCAL.unpack(header)
    flags, method, crc, name_len, extra_len = fields[2], fields[3], fields[6], *fields[9:]
    local_name = os.pread(fd, name_len, base + info.header_offset + _LOCAL.size)
    if local_name.decode("utf-8", "replace") != info.filename:
        problems.append(
            f"{info.filename}: the local header names it {local_name!r} "
            "(central directory and local headers disagree)"
        )
    if method != info.compress_type:
        problems.append(f"{info.filename}: compression differs from the directory's")
    if not flags & 0x08 and crc != info.CRC:
        problems.append(f"{info.filename}: local header CRC differs from the directory's")
    if info.compress_type != 0:
        # Not inflated here (a zip bomb would cost minutes), so its CRC is not checked,
        # and no ckpttool command can read values from it: a problem, not a pass.
        problems.append(
            f"{info.filename}: compressed (torch never compresses records: a re-zipped "
            "file?); its bytes cannot be checked or read in place"
        )
        return problems
    start = base + info.header_offset + _LOCAL.size + name_len + extra_len
    actual = _crc_of(fd, start, info.file_size, progress)
    if actual is None:
        problems.append(f"{info.filename}: the file ends inside this record (truncated)")
    elif actual != info.CRC:
        problems.append(
            f"{info.filename}: CRC-32 is {actual:08x}, the archive says {info.CRC:08x} "
            "(the bytes were altered or damaged)"
        )
    return problems


def _crc_of(fd: int, start: int, size: int, progress: Callable[[int], None] | None) -> int | None:
    crc = 0
    done = 0
    while done < size:
        chunk = os.pread(fd, min(CHUNK, size - done), start + done)
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
    used = {r.storage.record for r in ckpt.tensors() if r.storage is not None}
    with open(ckpt.path, "rb") as handle:
        names = open_zip(handle).namelist()
    data_prefix = f"{prefix}/data/" if prefix else "data/"
    return [n for n in names if n.startswith(data_prefix) and n not in used]


def verify_file(
    path: str | os.PathLike[str],
    *,
    values: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyResult:
    """Check one file. Raises InputError/NotACheckpointError only when no check can run."""
    path = Path(path)
    result = VerifyResult(str(path), None, leftovers=leftover_temp_files(path))
    try:
        ckpt = open_checkpoint(path, strict=False, refuse_dangerous=False)
    except (InputError, NotACheckpointError):
        raise
    except CkptError as error:  # corrupt, truncated, a resource bomb, BUILD on a global...
        result.problems.append(_without_path(error, path))
        return result
    with ckpt:
        result.format = ckpt.format
        result.checked.append(f"structure ({ckpt.format}), {len(ckpt.tensors())} tensor extents")
        result.problems.extend(ckpt.problems)
        dangerous = sorted({f"{m}.{n}" for m, n, v in _globals(ckpt) if v == "dangerous"})
        if dangerous:
            result.problems.append(
                f"the pickle calls {', '.join(dangerous)}: never load it with torch.load "
                "(see `ckpttool scan`)"
            )
        if ckpt.format == "torch-zip":
            result.problems.extend(check_zip_records(path, progress, record_owners(ckpt)))
            result.checked.append("zip directory vs local headers, CRC-32 of every record")
            spare = unreferenced_records(ckpt)
            if spare:
                result.checked.append(f"note: {len(spare)} storage records no tensor uses")
        if ckpt.format == "dcp":
            from ckpttool.verify_dcp import check_dcp

            dcp_problems, dcp_checked = check_dcp(ckpt, progress)
            result.problems.extend(dcp_problems)
            result.checked.extend(dcp_checked)
        if ckpt.format == "torch-legacy" and ckpt.details.get("trailing_bytes"):
            result.problems.append(
                f"{ckpt.details['trailing_bytes']:,} bytes after the last storage"
            )
        if values and not result.problems:
            result.problems.extend(_non_finite(ckpt))
            result.checked.append("values: NaN/Inf in floating tensors")
    return result


def _globals(ckpt: Checkpoint) -> list[tuple[str, str, str]]:
    return list(ckpt.pickle.globals_seen) if ckpt.pickle is not None else []


def _non_finite(ckpt: Checkpoint) -> list[str]:
    problems = []
    for record in ckpt.tensors():
        if not record.is_floating or record.dtype.startswith("float8") or record.storage is None:
            continue
        stats = tensor_stats(ckpt, record)
        if stats.nan or stats.inf:
            problems.append(f"{record.key}: {stats.nan} NaN and {stats.inf} Inf values")
    return problems


def _without_path(error: CkptError, path: Path) -> str:
    """The error's message without the path the reader put first (the report names it)."""
    return str(error).removeprefix(f"{path}: ")


def verify(
    paths: Iterable[str | os.PathLike[str]],
    *,
    values: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[VerifyResult]:
    """Check every path on its own: one that cannot be checked at all (missing, a directory,
    not a checkpoint) gets a result with ``error`` set, and the run goes on."""
    results = []
    for raw in paths:
        try:
            results.append(verify_file(raw, values=values, progress=progress))
        except (InputError, NotACheckpointError) as error:
            path = Path(raw)
            results.append(
                VerifyResult(str(path), None, leftovers=leftover_temp_files(path),
                             error=_without_path(error, path))
            )  # fmt: skip
    return results


def verify_exit_code(results: Sequence[VerifyResult]) -> int:
    """0 when every path was checked and is clean; 1 when a problem or a leftover temp file was
    found in any (this wins); 2 when some path could not be checked at all."""
    if any(r.problems or r.leftovers for r in results):
        return EXIT_FOUND
    if any(r.error is not None for r in results):
        return EXIT_ERROR
    return 0
