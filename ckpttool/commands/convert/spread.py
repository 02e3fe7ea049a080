"""``convert``'s output files written by several processes (``--jobs N``) or torchrun's ranks.

Every process plans the same conversion from the same metadata (:mod:`.plan`, :mod:`.output`):
the same files, names, tensors, headers. Each output file (a shard) is one unit, weighed by its
tensor bytes and assigned by :func:`ckpttool.io.units.assign`. A unit is written by the one
writer ``convert`` always uses, to a part file ``.<shard name>.<token>.ckpttool-tmp`` in the
directory the output goes to, fsynced and read back tensor by tensor before it counts as done.
The lead (the parent process; rank 0) then renames the parts to their names, writes the index
last and fsyncs the directory: the files are byte for byte those one process writes.

Before writing, the lead removes what a killed earlier run to the same output left (its part
files and temp files, recognised by name); after a failure every process removes its own parts
and the lead sweeps again, so nothing is left under the output's names.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.convert.output import OutFile
from ckpttool.commands.selection import Selection
from ckpttool.errors import CkptError
from ckpttool.io import units
from ckpttool.io.atomic import TMP_SUFFIX, atomic_write, fsync_dir
from ckpttool.io.parallel import chosen as jobs_asked
from ckpttool.io.progress import ProgressCallback

if TYPE_CHECKING:  # NumPy (its import) only when a tensor is cast: bench/README.md, item 3
    from ckpttool.model.cast import CastCounts

WriteFiles = Callable[[list[OutFile]], "dict[str, CastCounts]"]
#: (the output file, (first, stop) of its tensors, the file to write them in) -> casts' losses
WriteRange = Callable[[OutFile, tuple[int, int], Path], "dict[str, CastCounts]"]
#: One output file of at least this many bytes is split by byte range over ``--jobs`` processes
#: (under it, a worker's start-up costs more than it saves).
RANGE_MIN_BYTES = 32 << 20


@dataclass(frozen=True)
class Job:
    """What a worker process needs to plan the same conversion again and write its share:
    ``write_share`` is a module-level function (pickled by name), called as
    ``write_share(job, share, parts_dir, token)`` and returning :class:`Part`\\ s."""

    write_share: Callable[..., list[Part]]
    src: str
    dst: str | None
    choice: Selection
    options: ConversionOptions
    # (job, [(first, stop)...], path) -> casts' losses per range: one file's tensor ranges
    write_range_share: Callable[..., list[dict[str, CastCounts]]] | None = None


@dataclass(frozen=True)
class Part:
    """One output file written under a part name, read back, ready to be renamed."""

    index: int  # among the output's data files (the index file excluded)
    path: Path
    counts: dict[str, CastCounts]


def part_path(directory: Path, name: str, token: str) -> Path:
    return directory / f".{name}.{token}{TMP_SUFFIX}"


def leftovers(directory: Path, names: Sequence[str]) -> list[Path]:
    """What interrupted writes of ``names`` in ``directory`` may have left: part files, the
    temp files of their writes, temp files and staging directories of the outputs."""
    if not directory.is_dir():
        return []
    patterns = [p for name in names for p in (f".{name}.*{TMP_SUFFIX}", f"..{name}.*{TMP_SUFFIX}")]
    return [
        directory / entry
        for entry in sorted(os.listdir(directory))
        if any(fnmatch.fnmatchcase(entry, pattern) for pattern in patterns)
    ]


def sweep(directory: Path, names: Sequence[str], keep: Path | None = None) -> None:
    for path in leftovers(directory, names):
        if keep is not None and path == keep:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def write_share(
    share: Sequence[int], data: list[OutFile], parts_dir: Path, token: str, write: WriteFiles
) -> list[Part]:
    """Write the data files ``share`` names as parts (each verified by ``write``); on an error
    the parts already written are removed."""
    parts: list[Part] = []
    try:
        for index in share:
            out = data[index]
            path = part_path(parts_dir, out.target.name, token)
            counts = write([replace(out, target=path)])
            parts.append(Part(index, path, counts))
    except BaseException:
        remove(parts)
        raise
    return parts


def remove(parts: Sequence[Part]) -> None:
    for part in parts:
        with contextlib.suppress(FileNotFoundError):
            part.path.unlink()


class Spreader:
    """Writes a conversion's files over processes or ranks (see the module doc)."""

    def __init__(self, ranks: units.Ranks | None, workers: int, job: Job) -> None:
        self.ranks = ranks
        self.workers = workers
        self.job = job

    @property
    def leads(self) -> bool:
        return self.ranks is None or self.ranks.leads

    def write(
        self,
        files: list[OutFile],
        write: WriteFiles,
        progress: ProgressCallback,
        *,
        sweep_in: Path | None = None,
        write_range: WriteRange | None = None,
    ) -> dict[str, CastCounts]:
        """Write ``files`` (data files, then an index) to their targets; returns the casts'
        losses by tensor, as one process's write would. Off the lead, raises
        :class:`~ckpttool.io.units.Delegated` once this rank's share is written and every
        rank's is done. ``sweep_in``: also remove leftovers of that directory's name there
        (a model directory's staging directories)."""
        data = [f for f in files if f.kind != "index"]
        if write_range is not None and len(data) == 1 and _splits(data[0], self.workers):
            return self._write_ranges(files, data[0], write_range, progress, sweep_in)
        weights = [max(1, sum(p.nbytes for p in f.tensors)) for f in data]
        parts_dir = files[0].target.parent
        names = [f.target.name for f in files]

        def prepare() -> Path:
            if sweep_in is not None:
                sweep(sweep_in.parent, [sweep_in.name], keep=parts_dir)
            sweep(parts_dir, names)
            return parts_dir

        if self.ranks is not None:
            ranks = self.ranks
            parts_dir = ranks.agree(lambda: prepare() if ranks.leads else None)[0]
            share = units.assign(weights, ranks.world)[ranks.rank]
            mine: list[Part] = []

            token = secrets.token_hex(4)

            def work() -> list[Part]:
                for index in share:  # an error names the file this rank was writing
                    try:
                        mine.extend(write_share([index], data, parts_dir, token, write))
                    except CkptError as error:
                        where = f"writing {data[index].target.name}: {error}"
                        raise units.UnitError(where, error.exit_code) from error
                return mine

            try:
                gathered = ranks.agree(work)
            except BaseException:
                remove(mine)
                if ranks.leads:
                    sweep(parts_dir, names)
                raise
            parts = [part for found in gathered for part in found]
            if not ranks.leads:
                raise units.Delegated
        else:
            prepare()
            shares = [s for s in units.assign(weights, self.workers) if s]
            job = self.job
            token = secrets.token_hex(4)
            arguments = [(job, share, parts_dir, f"{token}{n}") for n, share in enumerate(shares)]
            try:
                results = units.process_map(job.write_share, arguments, self.workers)
                units.raise_first(results)
            except BaseException:
                sweep(parts_dir, names)
                raise
            parts = [part for found in results for part in found]
        progress(sum(weights))
        try:
            return commit(files, sorted(parts, key=lambda p: p.index))
        except BaseException:
            sweep(parts_dir, names)
            raise

    def _write_ranges(
        self,
        files: list[OutFile],
        out: OutFile,
        write_range: WriteRange,
        progress: ProgressCallback,
        sweep_in: Path | None,
    ) -> dict[str, CastCounts]:
        """One output file written by byte range: the lead makes it (header, full size) under
        a part name; each worker writes, fsyncs and reads back its tensor ranges in place."""
        head = header(out)
        out.expected_size = len(head) + sum(p.nbytes for p in out.tensors)
        groups = ranges(out, self.workers)
        weights = [max(1, sum(p.nbytes for p in out.tensors[a:b])) for a, b in groups]
        parts_dir = out.target.parent
        names = [f.target.name for f in files]

        def prepare() -> Path:
            if sweep_in is not None:
                sweep(sweep_in.parent, [sweep_in.name], keep=parts_dir)
            sweep(parts_dir, names)
            path = part_path(parts_dir, out.target.name, secrets.token_hex(4))
            with open(path, "wb") as handle:
                handle.write(head)
                handle.truncate(out.expected_size)
            return path

        try:
            if self.ranks is not None:
                ranks = self.ranks
                path = ranks.agree(lambda: prepare() if ranks.leads else None)[0]
                share = units.assign(weights, ranks.world)[ranks.rank]

                def work() -> list[tuple[int, dict[str, CastCounts]]]:
                    return [(i, write_range(out, groups[i], path)) for i in share]

                done = [item for found in ranks.agree(work) for item in found]
                if not ranks.leads:
                    raise units.Delegated
            else:
                job = self.job
                assert job.write_range_share is not None
                path = prepare()
                shares = [s for s in units.assign(weights, self.workers) if s]
                arguments = [(job, [groups[i] for i in share], path) for share in shares]
                results = units.process_map(job.write_range_share, arguments, self.workers)
                units.raise_first(results)
                done = [item for share, found in zip(shares, results) for item in zip(share, found)]
            if path.stat().st_size != out.expected_size:
                raise OSError(f"{out.target.name}: the file written is not its planned size")
            counts: dict[str, CastCounts] = {}
            for _, found in sorted(done, key=lambda item: item[0]):
                counts.update(found)
            progress(sum(weights))
            return commit(files, [Part(0, path, counts)])
        except units.Delegated:
            raise
        except BaseException:
            if self.leads:
                sweep(parts_dir, names)
            raise


def header(out: OutFile) -> bytes:
    """The bytes before ``out``'s tensors: its format's writer, given no tensor data."""
    from io import BytesIO

    from ckpttool.formats.registry import format_by_id

    buffer = BytesIO()
    names = [p.name for p in out.tensors]
    format_by_id(out.kind).write(buffer, [p.out for p in out.tensors], iter(()), names,
                                 out.aliases, out.metadata)  # fmt: skip
    return buffer.getvalue()


def planned_size(out: OutFile) -> int:
    return len(header(out)) + sum(p.nbytes for p in out.tensors)


def _splits(out: OutFile, workers: int) -> bool:
    """Whether one output file is split by byte range: a safetensors file (its tensors lie
    one after another after the header), of plain tensors, more than one."""
    return (
        workers > 1
        and out.kind == "safetensors"
        and len(out.tensors) > 1
        and not any(p.kept for p in out.tensors)
    )


def ranges(out: OutFile, workers: int) -> list[tuple[int, int]]:
    """``out``'s tensors cut into runs of about equal bytes, a few per worker (so that the
    byte-balanced assignment can even them out): (first, stop) index pairs."""
    return units.runs([p.nbytes for p in out.tensors], workers * 4)


def commit(files: list[OutFile], parts: list[Part]) -> dict[str, CastCounts]:
    """Rename every part to its file's name, then write the index (last: readers start from
    it), fsync the directory; the casts' losses in the files' order."""
    data = [f for f in files if f.kind != "index"]
    counts: dict[str, CastCounts] = {}
    for part in parts:
        target = data[part.index].target
        data[part.index].expected_size = part.path.stat().st_size
        os.replace(part.path, target)
        counts.update(part.counts)
    for out in files:
        if out.kind == "index":
            with atomic_write(out.target) as handle:
                handle.write(out.content)
            if out.target.read_bytes() != out.content:
                raise OSError(f"{out.target} does not hold the index written")
            out.expected_size = len(out.content)
    fsync_dir(files[0].target.parent)
    return counts


def chosen(job: Job, files: list[OutFile]) -> Spreader | None:
    """How ``files`` are written: over torchrun's ranks, over ``--jobs N`` processes (asked for
    explicitly, and at least two data files), or None: by this process, as always."""
    ranks = units.current()
    if ranks is not None:
        return Spreader(ranks, ranks.world, job)
    count = jobs_asked()
    data = [f for f in files if f.kind != "index"]
    if count is None or count < 2:
        return None
    if len(data) == 1:  # one file: by byte range, when it is large enough to be worth it
        big = sum(p.nbytes for p in data[0].tensors) >= RANGE_MIN_BYTES
        return Spreader(None, count, job) if big and _splits(data[0], count) else None
    return Spreader(None, min(count, len(data)), job)
