"""``verify`` for a zip archive: every record's local header against the directory, its CRC-32.

Opening the archive already read its central directory (``formats/zip_index``). This reads
what the directory points at: each record's local header, through the same reader, compared
field by field (name, compression, CRC), and every stored byte, streamed in bounded memory,
against the CRC-32 the directory gives. Problems are collected, not raised. Used for a torch
zip file and for each archive inside a DCP data file (``verify_dcp``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext

from ckpttool.formats.base import Checkpoint
from ckpttool.formats.torch_zip.reader import open_zip
from ckpttool.formats.torch_zip.zip_index import BadZipError, ZipIndex, ZipMember, fold
from ckpttool.io.blocks import crc_range
from ckpttool.io.crc import crc32
from ckpttool.io.parallel import jobs, ordered_map, serialized
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.read_batch import BLOCK, GAP
from ckpttool.io.source import RangeReader, open_source, read_into, read_range, source_of
from ckpttool.model.records import stored_records, tensors

REMOTE_CHUNK = 8 << 20  # bytes per request when a large record of a remote file is checked

_Run = list[tuple[ZipMember, list[str], int]]  # records read together: (entry, problems, start)


def check_torch_zip(
    ckpt: Checkpoint, progress: ProgressCallback | None = None
) -> tuple[list[str], list[str]]:
    """A torch zip file's records: the problems found (central directory vs local headers, the
    CRC of every record, streamed; each names the tensors stored in the record), and the
    storage records no tensor uses (not an error: a note). The directory is read once."""
    # a remote file (its blocks: no refetch), or a window of another file (a zip's member): the
    # open handle, which its name cannot reopen
    remote = ckpt._handle if hasattr(ckpt._handle, "read_range") else None
    with open_source(ckpt.name) if remote is None else nullcontext(remote) as handle:
        archive = open_zip(handle)
        problems = check_archive(source_of(handle), archive, 0, progress, record_owners(ckpt))
        names = archive.namelist()
    if ckpt.format == "torch-export":  # its data/ holds configs and sample inputs too
        return problems, []
    # a pickled nn.Module's attributes that its state dict leaves out are stored too
    viewed = ckpt.tensors() if ckpt.objects is ckpt.root else tensors(ckpt.objects)
    used = {r.storage.record for r in stored_records(viewed) if r.storage is not None}
    prefix = ckpt.details.get("prefix", "")
    data_prefix = fold(f"{prefix}/data/" if prefix else "data/")  # torch's lookup ignores case
    return problems, [n for n in names if fold(n).startswith(data_prefix) and n not in used]


def verify_torch_zip(
    ckpt: Checkpoint, progress: ProgressCallback | None = None
) -> tuple[list[str], list[str]]:
    """(problems, what was checked): ``verify``'s checks of a torch zip file."""
    problems, spare = check_torch_zip(ckpt, progress)
    checked = []
    if ckpt.details.get("crc32") == "not computed":
        checked.append(
            "zip directory vs local headers; note: the CRC-32s were not computed (every "
            "CRC field is 0: torch.serialization.config.save.compute_crc32 = False), so "
            "the records' bytes cannot be checked"
        )
    else:
        checked.append("zip directory vs local headers, CRC-32 of every record")
    if spare:
        records = f"{len(spare)} storage record{'s' * (len(spare) != 1)}"
        checked.append(f"note: {records} no tensor uses")
    return problems, checked


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
    """The records of an archive that starts at byte ``base`` of ``fd``, in directory order.

    ``archive`` reads its local headers itself (offsets relative to its start); the records'
    bytes are streamed from ``fd``, runs of small adjacent records in one read of at most
    :data:`~ckpttool.io.read_batch.BLOCK` bytes (100,000 tensors: 100,000 reads saved). The
    headers are checked first (Python, in order); the runs' CRC-32s are then taken on
    :func:`~ckpttool.io.parallel.jobs` threads for a local file (``pread`` and ISA-L's CRC-32
    let go of the GIL), the problems reported in directory order as one loop would.
    """
    plan = getattr(fd, "plan", None)  # a remote file: every record in few large requests
    if plan is not None and archive.crc_computed:
        regions = archive.regions()
        plan([(base + regions[i.filename][0], regions[i.filename][1]) for i in archive.infolist()])

    def named(info: ZipMember, found: list[str]) -> list[str]:
        return [p + _stored_in((owners or {}).get(info.filename, ())) for p in found]

    # in directory order: a run of records whose CRCs are taken together (problems: []), or
    # the problems of a record whose bytes are not read (run: [])
    steps: list[tuple[_Run, list[str]]] = []
    run: _Run = []
    for info, found, data_start in _headers(archive):
        if not archive.crc_computed:  # no CRC to take: the directory and headers are checked
            problems = named(info, found)
            if data_start is not None and data_start + info.file_size > archive.size:
                problems.append(f"{info.filename}: the file ends inside this record (truncated)")
            steps.append(([], problems))
            continue
        if data_start is None:  # nothing to read: its problems go after the run's
            if run:
                steps.append((run, []))
            steps.append(([], named(info, found)))
            run = []
            continue
        start = base + data_start
        if run and not _joins(run, start, info.file_size):
            steps.append((run, []))
            run = []
        run.append((info, found, start))
    if run:
        steps.append((run, []))
    crcs = iter(_crcs_of_runs(fd, [run for run, _ in steps if run], progress))
    problems = []
    for run, found_alone in steps:
        problems += found_alone
        for (info, found, _), actual in zip(run, next(crcs) if run else [], strict=True):
            problems += named(info, found + _crc_problems(info, actual))
    return problems


def _headers(archive: ZipIndex) -> Iterator[tuple[ZipMember, list[str], int | None]]:
    """Each record's (entry, header problems, where its bytes start), in directory order."""
    for info in archive.infolist():
        found, data_start = _header_problems(archive, info)
        yield info, found, data_start


def _crcs_of_runs(
    fd: int | RangeReader,
    runs: list[_Run],
    progress: ProgressCallback | None,
) -> list[list[int | None]]:
    """:func:`_crcs_of` each run, on :func:`~ckpttool.io.parallel.jobs` threads for a local
    file (a remote one reads its planned windows in order, on this thread)."""
    if not isinstance(fd, int) or len(runs) < 2 or jobs() < 2:
        return [_crcs_of(fd, run, progress) for run in runs]
    advance = serialized(progress)
    return ordered_map(lambda run: _crcs_of(fd, run, advance), runs)


def _joins(run: list[tuple[ZipMember, list[str], int]], start: int, size: int) -> bool:
    """Whether a record at ``start`` can be read in one block with ``run``."""
    first_info, _, first = run[0]
    last_info, _, last = run[-1]
    end = last + last_info.file_size
    return (
        first_info.file_size <= BLOCK
        and end <= start <= end + GAP
        and start + size - first <= BLOCK
    )


def _header_problems(archive: ZipIndex, info: ZipMember) -> tuple[list[str], int | None]:
    """One record's local header against the directory's entry, and where its bytes start
    (None: they are not read, the header is missing or the record compressed)."""
    try:
        header = archive.local_header(info)
    except BadZipError:  # before the file, cut off, or no signature there
        return [f"{info.filename}: no local header where the directory says"], None
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
        return problems, None
    return problems, header.data_start


def _crc_problems(info: ZipMember, actual: int | None) -> list[str]:
    if actual is None:
        return [f"{info.filename}: the file ends inside this record (truncated)"]
    if actual != info.CRC:
        return [
            f"{info.filename}: CRC-32 is {actual:08x}, the archive says {info.CRC:08x} "
            "(the bytes were altered or damaged)"
        ]
    return []


def _crcs_of(
    fd: int | RangeReader,
    run: list[tuple[ZipMember, list[str], int]],
    progress: ProgressCallback | None,
) -> list[int | None]:
    """The CRC-32 of each record of ``run`` (None: the file ends inside it): one read for
    the run, or, for one record or a run the file ends inside, :func:`_crc_of` each."""
    if len(run) > 1:
        first = run[0][2]
        last_info, _, last = run[-1]
        block = read_range(fd, last + last_info.file_size - first, first)
        if len(block) == last + last_info.file_size - first:
            crcs: list[int | None] = []
            view = memoryview(block)  # slices of a view: no copy of each record
            for info, _, start in run:
                at = start - first
                crcs.append(crc32(view[at : at + info.file_size]))
                if progress is not None and info.file_size:
                    progress(info.file_size)
            return crcs
    return [_crc_of(fd, start, info.file_size, progress) for info, _, start in run]


def _crc_of(
    fd: int | RangeReader, start: int, size: int, progress: ProgressCallback | None
) -> int | None:
    if isinstance(fd, int):  # into reused buffers (ckpttool.io.blocks): no new one per read
        return crc_range(lambda offset, into: read_into(fd, offset, into), start, size, progress)
    crc = done = 0  # a remote file: fewer, larger requests
    while done < size:
        chunk = read_range(fd, min(REMOTE_CHUNK, size - done), start + done)
        if not chunk:
            return None
        crc = crc32(chunk, crc)
        done += len(chunk)
        if progress is not None:
            progress(len(chunk))
    return crc


__all__ = ["check_archive", "check_torch_zip", "record_owners"]
