"""``edit``'s computed storages (casts) made once each, alone or by ``--jobs`` or torchrun.

A derived storage is one whose bytes ``edit`` computes from the source's (a ``--dtype`` cast, a
``--map`` operation, an FP8 dequantization), not copies (issue 43).

Every way the format's writer is given the same bytes in the same order, so the file is byte
for byte the same with any N, and the read-back checks each derived storage by the CRC-32 of
the bytes the writer was given instead of computing it a second time.

* One process (``--jobs 1``): each storage is computed when the writer asks for it, its CRC-32
  taken on the way (:func:`recorded`).
* ``--jobs N`` (:func:`computed_ahead`): the same, on N threads, up to N storages ahead of the
  writer, in its order (threads, not processes: bench/README.md, issue 43).
* torchrun's ranks (:func:`compute_shared`): the storages, in the order the tree holds them,
  cut into runs of about equal bytes (a few per rank: the byte-balanced assignment evens them
  out). A rank computes a run into a part file beside the output, named as the output's temp
  files (``.<output name>.<token>-<run>.ckpttool-tmp``: a rerun's sweep and ``verify`` know
  it), one storage in memory at a time, and returns where each storage lies in it with its
  CRC-32. Rank 0 then writes the file from the parts. Before the parts are made, rank 0 sweeps
  what a killed earlier write to the same output left; the parts are removed once the output
  is written, or on any failure.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.commands.convert.spread import sweep
from ckpttool.io import units
from ckpttool.io.atomic import TMP_SUFFIX
from ckpttool.io.crc import crc32
from ckpttool.io.parallel import chosen, using
from ckpttool.model.records import TensorRecord, walk

Producer = Callable[[], bytes]
#: A run's results: its part file, and (storage key, offset, length, CRC-32) of each storage.
RunResult = tuple[str, list[tuple[str, int, int, int]]]
#: Runs per worker: more evens out the load (each is one part file, and a worker's start).
RUNS_PER_WORKER = 4


def derived_in_order(root: Any, derived: dict[str, Producer]) -> dict[str, int]:
    """The derived storages the tensors of ``root`` view, in the order the tree holds them
    (the order a writer asks for them), with their sizes in bytes."""
    found: dict[str, int] = {}
    for _, record in walk(root):
        storage = record.storage if isinstance(record, TensorRecord) else None
        if storage is not None and storage.key in derived:
            found.setdefault(storage.key, storage.nbytes)
    return found


def workers() -> int:
    """How many workers share the storages here: torchrun's ranks, or ``--jobs`` (default 1:
    each worker holds one storage's computation)."""
    ranks = units.sharing()
    if ranks is not None:
        return ranks.world
    return chosen() or 1


def recorded(derived: dict[str, Producer], keys: Sequence[str], crcs: dict[str, int]) -> None:
    """Each of ``keys``'s producers made to put the CRC-32 of what it returns in ``crcs``."""

    def with_crc(key: str, producer: Producer) -> Producer:
        def produce() -> bytes:
            data = producer()
            crcs[key] = crc32(data)
            return data

        return produce

    for key in keys:
        derived[key] = with_crc(key, derived[key])


@contextlib.contextmanager
def computed_ahead(derived: dict[str, Producer], keys: list[str]) -> Iterator[None]:
    """``derived``'s producers of ``keys`` made to take what :func:`workers` threads compute
    ahead of the writer, in ``keys``'s order (NumPy's casts and the CRC let go of the GIL:
    bench/README.md, issue 43), at most that many storages ahead: memory stays bounded. An
    error is raised when the writer asks for its storage, as one process raises it."""
    from ckpttool.io.parallel import AheadMap

    count = workers()
    producers = {key: derived[key] for key in keys}
    ahead = AheadMap(lambda key: producers[key](), keys, count, count)
    for key in keys:
        derived[key] = functools.partial(ahead.take, key)
    try:
        yield
    finally:
        ahead.close()


def part_name(output: Path, token: str, run: int) -> Path:
    return output.parent / f".{output.name}.{token}-{run}{TMP_SUFFIX}"


def sweep_leftovers(output: Path) -> None:
    """Remove what killed earlier writes to ``output`` left beside it (temp files, parts)."""
    sweep(output.parent, [output.name])


@dataclass
class SharedParts:
    """Derived storages computed into part files: a producer for each that reads it back."""

    crcs: dict[str, int]  # storage key -> CRC-32 of its bytes
    producers: dict[str, Producer]
    paths: list[Path]
    _fds: list[int]

    def close(self) -> None:
        """Close and remove the part files."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@contextlib.contextmanager
def compute_shared(
    derived: dict[str, Producer], order: dict[str, int], output: Path
) -> Iterator[SharedParts | None]:
    """The storages ``order`` names computed by the workers into part files beside ``output``
    (see the module doc). On the lead (every process off torchrun) yields the parts, removed
    when the block ends; off it raises :class:`~ckpttool.io.units.Delegated` once every rank's
    share is done. The first error in the storages' order is raised on every rank, and the
    parts are removed."""
    ranks = units.sharing()
    leads = ranks is None or ranks.leads
    count = workers()
    keys = list(order)
    bounds = units.runs([order[key] for key in keys], count * RUNS_PER_WORKER)
    weights = [max(1, sum(order[key] for key in keys[a:b])) for a, b in bounds]

    def prepare() -> str:
        sweep_leftovers(output)
        return secrets.token_hex(4)

    token = units.from_lead(prepare() if leads else None)
    compute = _RunComputer(derived, keys, bounds, output, token)
    try:
        with using(count):
            results = units.shared_map(compute, range(len(bounds)), weights)
        units.lead_only()
    except BaseException:
        if leads:
            _sweep_parts(output, token)
        raise
    parts = SharedParts({}, {}, [Path(path) for path, _ in results], [])
    try:
        for path, placed in results:
            fd = os.open(path, os.O_RDONLY)
            parts._fds.append(fd)
            for key, offset, length, crc in placed:
                parts.crcs[key] = crc
                parts.producers[key] = _reader(fd, offset, length)
        yield parts
    finally:
        parts.close()
        _sweep_parts(output, token)


class _RunComputer:
    """One run of storages computed into its part file (a callable for the shared map: on a
    forked worker it is inherited, not pickled)."""

    def __init__(
        self,
        derived: dict[str, Producer],
        keys: list[str],
        bounds: list[tuple[int, int]],
        output: Path,
        token: str,
    ) -> None:
        self.derived = derived
        self.keys = keys
        self.bounds = bounds
        self.output = output
        self.token = token

    def __call__(self, run: int) -> RunResult:
        first, stop = self.bounds[run]
        path = part_name(self.output, self.token, run)
        placed: list[tuple[str, int, int, int]] = []
        try:
            with open(path, "wb") as out:
                offset = 0
                for key in self.keys[first:stop]:
                    data = self.derived[key]()
                    out.write(data)
                    placed.append((key, offset, len(data), crc32(data)))
                    offset += len(data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        return str(path), placed


def _sweep_parts(output: Path, token: str) -> None:
    for path in output.parent.glob(f".{output.name}.{token}-*{TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


#: Bytes asked of one pread (Linux reads at most about 2 GiB at once).
_READ_STEP = 1 << 30


def _reader(fd: int, offset: int, length: int) -> Producer:
    """A part's storage as ``bytes`` (what a producer returns), read by ``pread`` itself: no
    buffer copied again, as :func:`~ckpttool.io.source.read_at`'s ``bytearray`` would be."""

    def read() -> bytes:
        if length <= _READ_STEP:
            data = os.pread(fd, length, offset)
        else:
            data = b"".join(
                os.pread(fd, min(_READ_STEP, length - at), offset + at)
                for at in range(0, length, _READ_STEP)
            )
        if len(data) != length:
            raise OSError(f"a part file beside the output ends early ({len(data)} of {length})")
        return data

    return read
