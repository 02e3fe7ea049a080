"""``scan``: every global a checkpoint's pickles name, classed safe / unknown / dangerous.

Like a malware scanner for checkpoints: the pickle is walked by the same safe reader, in a
mode that records dangerous names instead of refusing at the first one, and nothing it names
is imported or called. "safe" are the data constructs the reader emulates (tensor rebuilders,
``OrderedDict``, NumPy arrays, ``argparse.Namespace``...); "dangerous" are callables whose only use in a pickle is to
run code or touch the system; everything else is "unknown" (a config class, a model class):
harmless to ckpttool, but ``torch.load(weights_only=False)`` would import and call it.

Each format walks its own pickles (its scan hook, :meth:`ckpttool.formats.base.FileFormat.scan`:
a zip's every ``.pkl`` record, a tar's pickles, a torch.distributed.checkpoint directory's
``.metadata`` and every item's pickles, as one input); any other file is opened by the reader,
and one it gives up on is walked for the pickles ``torch.load`` would still run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import checkpoint_names, open_checkpoint
from ckpttool.errors import AmbiguousFileError, CkptError, NotACheckpointError, UnsafePickleError
from ckpttool.formats.base import PLACE_SEPARATOR, Findings
from ckpttool.formats.registry import directory_format_of, salvage, scan_findings
from ckpttool.io.source import is_url
from ckpttool.io.units import shared_map
from ckpttool.pickle.policy import Verdict
from ckpttool.pickle.scan import tally


@dataclass(frozen=True)
class GlobalUse:
    qualname: str  # "torch._utils._rebuild_tensor_v2"
    verdict: Verdict  # safe / unknown / dangerous / allowed
    count: int
    # how the pickle wrote the name, where Python 3 reads it as another ("__builtin__.long" for
    # builtins.int in protocol 2: pickle.policy.python3_name)
    written_as: str | None = None


@dataclass
class FileScan:
    path: str
    format: str | None  # None when the file could not be scanned
    globals: list[GlobalUse] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. "TorchScript archive: holds code"
    error: str | None = None  # why it could not be scanned
    not_a_checkpoint: bool = False
    # where inside an archive a global was named, by qualname, when not in a torch.save zip's
    # own data.pkl: {"posix.system": ["data/sample_inputs/model.pt › model/data.pkl"]}
    places: dict[str, list[str]] = field(default_factory=dict)

    @property
    def flagged(self) -> list[GlobalUse]:
        return [g for g in self.globals if g.verdict in (Verdict.UNKNOWN, Verdict.DANGEROUS)]

    @property
    def dangerous(self) -> bool:
        return any(g.verdict is Verdict.DANGEROUS for g in self.globals) or bool(self.notes)


@dataclass
class ScanReport:
    files: list[FileScan]
    skipped: list[str]  # files inside scanned directories that are not checkpoints
    # directories given that hold no checkpoint: scanning nothing is not a clean result
    empty: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Something was scanned, all of it fully, and only safe constructs were found."""
        return bool(self.files) and not self.found and not self.failed

    @property
    def failed(self) -> bool:
        """Some path could not be (fully) scanned, or held no checkpoint, and nothing
        dangerous was found to report (that wins)."""
        unscanned = any(f.error is not None for f in self.files) or bool(self.empty)
        return (unscanned or not self.files) and not self.found

    @property
    def found(self) -> bool:
        return any(f.flagged or f.notes for f in self.files)


def scan_file(path: Path | str, allow: Iterable[str] = (), depth: int = 0) -> FileScan:
    allowed = set(allow)
    try:
        found = scan_findings(path, _is_directory_checkpoint(path))
        if found is None:  # no format walks it itself: open it as usual
            found = _read(path)
    except UnsafePickleError as error:  # BUILD on a global: refused even in scan mode
        return FileScan(str(path), None, notes=[_without_path(error, path)])
    except AmbiguousFileError as error:  # a zip directory that reads two ways
        return FileScan(str(path), None, notes=[f"ambiguous: {error.reason}"])
    except NotACheckpointError as error:
        wrapped = _scan_wrapper(path, allow, depth)
        if wrapped is not None:
            return wrapped
        return FileScan(str(path), None, error=_without_path(error, path), not_a_checkpoint=True)
    except CkptError as error:
        return FileScan(str(path), None, error=_without_path(error, path))
    uses = []
    places = {f"{module}.{name}": where for (module, name), where in sorted(found.places.items())}
    for (module, name, verdict), count in sorted(found.counts.items()):
        qualname = f"{module}.{name}"
        verdict = Verdict.ALLOWED if qualname in allowed else verdict
        original = found.written.get((module, name))
        uses.append(GlobalUse(qualname, verdict, count, original and ".".join(original)))
    return FileScan(
        str(path),
        found.format,
        uses,
        found.notes,
        error="; ".join(found.problems) or None,
        places=places,
    )


#: Archives that may wrap a checkpoint (published scanner bypasses ship a checkpoint in a 7z
#: archive: nullifAI), by signature: those a standard-library module opens, and the rest.
_OPENED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}
_NOT_OPENED = {b"7z\xbc\xaf\x27\x1c": "7z", b"Rar!\x1a\x07": "RAR", b"\x28\xb5\x2f\xfd": "zstd"}
#: Bytes unpacked from one wrapper at most, and wrappers inside wrappers (a .tar.gz is two).
MAX_UNPACKED = 256 << 20
MAX_WRAPPERS = 3
ARCHIVE_NOT_SCANNED = "archive not scanned"


def _scan_wrapper(path: Path | str, allow: Iterable[str], depth: int) -> FileScan | None:
    """A local file that is an archive wrapping files (gzip, bzip2, xz, tar; 7z, RAR, zstd):
    each file it holds scanned as a file of its own, its findings named by their place, or,
    for a kind no standard-library module opens, one finding ``archive not scanned`` (exit 1:
    what it holds is unknown). None for anything else."""
    if isinstance(path, str) and is_url(path):
        return None
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError:
        return None
    kind = next((k for sig, k in _NOT_OPENED.items() if head.startswith(sig)), None)
    if kind is not None:
        note = f"{ARCHIVE_NOT_SCANNED}: a {kind} archive; unpack it and scan what it holds"
        return FileScan(str(path), "archive", notes=[note])
    opened = next((k for sig, k in _OPENED.items() if head.startswith(sig)), None)
    tar = head[257:262] == b"ustar"
    if opened is None and not tar:
        return None
    if depth >= MAX_WRAPPERS:
        return FileScan(str(path), "archive", error=f"archives nested over {MAX_WRAPPERS} deep")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckpttool-scan-") as folder:
        try:
            members = _unpack(Path(path), opened, Path(folder))
        except (OSError, EOFError, ValueError) as error:  # tarfile, gzip, lzma errors
            return FileScan(str(path), "archive", error=f"archive not readable: {error}")
        inner = [(name, scan_file(file, allow, depth + 1)) for name, file in members]
    scans = [(name, found) for name, found in inner if not found.not_a_checkpoint]
    if not scans:
        return None  # it holds no checkpoint: skipped as before
    return _merge(str(path), scans)


def _unpack(path: Path, compression: str | None, folder: Path) -> list[tuple[str, Path]]:
    """The files a wrapper holds, written under ``folder``: (name inside, file)."""
    import bz2
    import gzip
    import lzma
    import tarfile

    openers: dict[str, Callable[[Path], Any]] = {
        "gzip": gzip.GzipFile, "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile,
    }  # fmt: skip
    if compression is not None:  # one compressed stream: a tar inside, or one file
        with openers[compression](path) as stream:
            data = stream.read(MAX_UNPACKED + 1)
        if len(data) > MAX_UNPACKED:
            raise ValueError(f"unpacks to over {MAX_UNPACKED:,} bytes")
        unpacked = folder / "0"
        unpacked.write_bytes(data)
        name = path.name.rsplit(".", 1)[0] or "0"
        if data[257:262] != b"ustar":
            return [(name, unpacked)]
        path = unpacked
    out, total = [], 0
    with tarfile.open(path, "r:") as archive:
        for index, member in enumerate(archive):
            if not member.isfile():
                continue
            total += member.size
            if total > MAX_UNPACKED:
                raise ValueError(f"unpacks to over {MAX_UNPACKED:,} bytes")
            source = archive.extractfile(member)
            if source is None:
                continue
            target = folder / f"m{index}"
            target.write_bytes(source.read())
            out.append((member.name, target))
    return out


def _merge(path: str, scans: list[tuple[str, FileScan]]) -> FileScan:
    """One wrapper's report from those of the files it holds, each finding named by place."""
    counts: dict[tuple[str, Verdict, str | None], int] = {}
    places: dict[str, list[str]] = {}
    notes: list[str] = []
    errors: list[str] = []
    for name, found in scans:
        for use in found.globals:
            key = (use.qualname, use.verdict, use.written_as)
            counts[key] = counts.get(key, 0) + use.count
            inner = found.places.get(use.qualname) or [""]
            where = [f"{name}{PLACE_SEPARATOR}{p}" if p else name for p in inner]
            listed = places.setdefault(use.qualname, [])
            listed.extend(w for w in where if w not in listed)
        notes.extend(f"{name}: {note}" for note in found.notes)
        if found.error is not None:
            errors.append(f"{name}: {found.error}")
    uses = [GlobalUse(q, v, c, w) for (q, v, w), c in sorted(counts.items())]
    return FileScan(path, "archive", uses, notes, "; ".join(errors) or None, places=places)


def _read(path: Path | str) -> Findings:
    """The globals of a file opened by the reader; when it gives up, what the pickles named
    before that point still counts, and a file it does not recognise may still be a pickle
    torch.load would run (:func:`~ckpttool.formats.registry.salvage`)."""
    try:
        with open_checkpoint(path, refuse_dangerous=False, allow_ambiguous=True) as ckpt:
            found = Findings(ckpt.format)
            if ckpt.pickle is not None:
                tally(found.counts, found.written, ckpt.pickle)
            found.counts.update(ckpt.details.get("pickle_globals", ()))
            if ckpt.details.get("ambiguous"):
                found.notes.append(f"ambiguous: {ckpt.details['ambiguous']}")
            return found
    except CkptError as error:
        salvaged = salvage(path, error)
        if salvaged is None:
            raise
        fmt, counts, notes, problems = salvaged
        return Findings(fmt, counts, notes=notes, problems=problems)


def _is_directory_checkpoint(path: Path | str) -> bool:
    if isinstance(path, str) and is_url(path):
        from ckpttool.io.remote import is_directory

        return is_directory(path)
    return is_directory_checkpoint(path)


def _without_path(error: CkptError, path: Path | str) -> str:
    """The error's message without the path the reader put first (the report names it)."""
    return str(error).removeprefix(f"{path}: ")


def is_directory_checkpoint(path: Path | str) -> bool:
    """Whether a local directory is one checkpoint of a directory format (DCP)."""
    return directory_format_of(path) is not None


def loose_files(directory: Path) -> list[Path]:
    """Files named like checkpoints inside a directory checkpoint that its format does not
    read (a DCP directory's data files are ``.distcp``): Megatron's ``common.pt`` beside its
    DCP files. Each holds a pickle of its own, so each is scanned as a file."""
    return [directory / name for name in checkpoint_names(str(directory))]


def _files_under(directory: Path) -> list[Path]:
    """Files under ``directory``, recursively; a DCP directory is one input, not its files
    (but for the checkpoint files its format does not read: :func:`loose_files`)."""
    found = []
    for root, subdirectories, names in os.walk(directory):
        here = Path(root)
        if is_directory_checkpoint(here):
            found.append(here)
            found.extend(loose_files(here))
            subdirectories.clear()
            continue
        found.extend(
            here / name
            for name in names
            if not name.startswith(".") and os.path.getsize(here / name) > 0
        )
    return sorted(found)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0  # missing: its error line costs nothing
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def scan(paths: Iterable[str | os.PathLike[str]], allow: Iterable[str] = ()) -> ScanReport:
    """Scan files (and directories, recursively), each path on its own: a missing one is a
    file that could not be scanned, a directory without a checkpoint is listed in ``empty``.
    The files are scanned by :func:`~ckpttool.io.parallel.jobs` workers (``--jobs``: forked
    processes where that is safe, else threads), the report built as a loop would build it."""
    allow = list(allow)
    # what to scan, in report order: (the path, the directory it was found under, or None)
    units: list[tuple[str | Path, str | None]] = []
    listed: list[str] = []  # directories walked, in order: each may turn out empty
    for raw in paths:
        if is_url(raw):  # a file or a DCP directory read by ranges
            units.append((os.fspath(raw), None))
            continue
        path = Path(raw)
        if path.is_dir() and not is_directory_checkpoint(path):
            listed.append(str(path))
            units.extend((child, str(path)) for child in _files_under(path))
        else:  # a file, a DCP directory (and its loose files), or a missing path
            units.append((path, None))
            if path.is_dir():
                units.extend((loose, None) for loose in loose_files(path))

    def scan_unit(unit: tuple[str | Path, str | None]) -> FileScan:
        path = unit[0]
        if not isinstance(path, str) and not path.exists():
            return FileScan(str(path), None, error="no such file or directory")
        return scan_file(path, allow)

    files: list[FileScan] = []
    skipped: list[str] = []
    found: set[str] = set()
    # a walk is Python holding the GIL: forked workers, unless a URL's reader is involved
    # (its connections are not to be shared by forks)
    local = not any(isinstance(path, str) for path, _ in units)
    # under torchrun the ranks share the units by size
    sizes = [1 if isinstance(path, str) else _size(path) for path, _ in units]
    results = shared_map(scan_unit, units, sizes, processes=local)
    for (scanned, directory), result in zip(units, results):
        if directory is not None and result.not_a_checkpoint:
            skipped.append(str(scanned))
            continue
        files.append(result)
        if directory is not None:
            found.add(directory)
    empty = [directory for directory in listed if directory not in found]
    return ScanReport(files, skipped, empty)
