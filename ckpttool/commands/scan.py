"""``scan``: every global a checkpoint's pickles name, classed safe / unknown / dangerous.

Like a malware scanner for checkpoints: the pickle is walked by the same safe reader, in a
mode that records dangerous names instead of refusing at the first one, and nothing it names
is imported or called. "safe" are the data constructs the reader emulates (tensor rebuilders,
``OrderedDict``, NumPy arrays, ``argparse.Namespace``...); "dangerous" are callables whose only use in a pickle is to
run code or touch the system; everything else is "unknown" (a config class, a model class):
harmless to ckpttool, but ``torch.load(weights_only=False)`` would import and call it.

A torch.distributed.checkpoint directory is one input: its ``.metadata``, its values' and every
tensor chunk's pickles (torch reads the first with ``pickle.load`` and the values with
``torch.load(weights_only=False)``, so they matter as much as any checkpoint's).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import open_checkpoint, open_source
from ckpttool.errors import AmbiguousFileError, CkptError, NotACheckpointError, UnsafePickleError
from ckpttool.formats.dcp.directory import (
    METADATA,
    DcpFiles,
    is_dcp_directory,
    load_metadata,
    present,
)
from ckpttool.formats.safetensors_file import looks_like_safetensors
from ckpttool.formats.salvage import add_linear_globals, persistent_placeholder, salvage_pickles
from ckpttool.formats.torch_legacy import read_pickle_stream
from ckpttool.formats.torch_tar import is_torch_tar, scan_tar
from ckpttool.formats.torch_zip.reader import ambiguous_names, is_torchscript, open_zip, read_record
from ckpttool.formats.torch_zip.zip_index import case_collision, fold
from ckpttool.io.source import is_url, join, member_sizes, source_size
from ckpttool.pickle.interpreter import PickleResult, SafeUnpickler
from ckpttool.pickle.policy import Verdict


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


def _open(path: Path | str) -> Any:
    """A local file, or a URL's remote file (read by ranges)."""
    return open_source(path) if isinstance(path, str) and is_url(path) else open(path, "rb")


def _pickles_of_zip(path: Path | str) -> tuple[str, list[tuple[str, bytes]], list[str], list[str]]:
    """(format, [(record name, pickle bytes)], notes, unreadable) for a zip's .pkl records."""
    with _open(path) as handle:
        archive = open_zip(handle)
        names = archive.namelist()
        notes = []
        fmt = "torch-zip"
        if is_torchscript(names):
            fmt = "torchscript"
            notes.append("a TorchScript archive: it carries code that torch.jit.load would run")
        collision = case_collision(names)
        if collision is not None:
            notes.append(f"ambiguous: {ambiguous_names(*collision)}")
        pickles = []
        unreadable = []  # not scanned: the file could not be (fully) checked
        file_size = source_size(handle)
        for info in archive.infolist():
            if fold(info.filename).endswith(".pkl"):  # torch's reader ignores case
                try:  # bounded: a deflated record could inflate to gigabytes
                    pickles.append((info.filename, read_record(handle, info, archive, file_size)))
                except CkptError as error:
                    unreadable.append(f"{info.filename}: unreadable ({error})")
        return fmt, pickles, notes, unreadable


#: The globals a file's pickles name, counted, and how the pickles wrote the renamed ones.
Counts = Counter[tuple[str, str, Verdict]]
Written = dict[tuple[str, str], tuple[str, str]]


def _tally(counts: Counts, written: Written, result: PickleResult) -> None:
    counts.update(result.globals_seen)
    written.update(result.renamed)


def _walk_globals(data: bytes, written: Written) -> tuple[Counts, str | None, str | None]:
    """Globals named by one pickle (their Python 2 spellings into ``written``); an attack found
    in it; why it stopped early."""
    unpickler = SafeUnpickler(data, persistent_load=persistent_placeholder, refuse_dangerous=False)
    attack = problem = None
    try:
        unpickler.load()
    except UnsafePickleError as error:  # BUILD on a global: an attack even in scan mode
        attack = str(error)
    except CkptError as error:
        problem = f"pickle not fully readable: {error}"
    counts: Counts = Counter()
    _tally(counts, written, unpickler.result)
    if attack or problem:  # what torch.load may still import past the point the walk stopped
        add_linear_globals(counts, data, 0)
    return counts, attack, problem


def _is_zip(path: Path | str) -> bool:
    with _open(path) as handle:
        return handle.read(4) == b"PK\x03\x04"


def _scan_dcp(path: Path | str, written: Written) -> tuple[Counts, list[str], list[str]]:
    """Globals of a DCP directory's every pickle: ``.metadata``, then each stored item's."""
    metadata = join(str(path), METADATA)
    with _open(metadata) as handle:
        counts, attack, problem = _walk_globals(handle.read(), written)
    if attack or problem:  # the metadata cannot be trusted to say where the items are
        return counts, [f"{METADATA}: {attack}"] if attack else [], [f"{METADATA}: {problem}"]
    try:
        with _open(metadata) as handle:
            _, meta = load_metadata(handle, refuse_dangerous=False)
    except CkptError as error:  # not DCP metadata (an attack's pickle?): report its globals
        return counts, [], [f"{METADATA}: {error}"]
    sizes = member_sizes(str(path), list(meta.files))
    files = DcpFiles(path, sizes)
    notes: list[str] = []
    problems: list[str] = []
    try:
        for what, span in meta.items():
            if not present(span, sizes):
                problems.append(f"{what}: {span} is not in the directory")
            elif files.pread(span.file, span.offset, min(4, span.length)) == b"PK\x03\x04":
                try:
                    archive = files.archive(span, refuse_dangerous=False)
                except UnsafePickleError as error:  # BUILD on a global
                    notes.append(f"{what}: {error}")
                    continue
                except CkptError as error:
                    problems.append(f"{what}: {error}")
                    continue
                if archive.pickle is not None:
                    _tally(counts, written, archive.pickle)
    finally:
        files.close()
    return counts, notes, problems


def scan_file(path: Path | str, allow: Iterable[str] = ()) -> FileScan:
    allowed = set(allow)
    counts: Counts = Counter()
    written: Written = {}
    notes: list[str] = []
    problems: list[str] = []
    try:
        if _is_dcp(path):
            fmt = "dcp"
            counts, notes, problems = _scan_dcp(path, written)
        elif _is_zip(path):
            fmt, pickles, notes, problems = _pickles_of_zip(path)
            for name, data in pickles:
                found, attack, problem = _walk_globals(data, written)
                counts.update(found)
                if attack:
                    notes.append(f"{name}: {attack}")
                if problem:
                    problems.append(f"{name}: {problem}")
        elif _is_tar(path):
            fmt = "torch-tar"
            counts, notes, problems = _scan_tar(path)
        else:
            try:
                with open_checkpoint(path, refuse_dangerous=False, allow_ambiguous=True) as ckpt:
                    fmt = ckpt.format
                    if ckpt.pickle is not None:
                        _tally(counts, written, ckpt.pickle)
                    counts.update(ckpt.details.get("pickle_globals", ()))
                    if ckpt.details.get("ambiguous"):
                        notes.append(f"ambiguous: {ckpt.details['ambiguous']}")
            except CkptError as error:
                # the reader gave up: what the pickles named before that point still counts,
                # and a file it does not recognise may still be a pickle torch.load would run
                salvaged = salvage_pickles(path, error)
                if salvaged is None:
                    raise
                fmt, counts, notes, problems = salvaged
    except UnsafePickleError as error:  # BUILD on a global: refused even in scan mode
        return FileScan(str(path), None, notes=[_without_path(error, path)])
    except AmbiguousFileError as error:  # a zip directory that reads two ways
        return FileScan(str(path), None, notes=[f"ambiguous: {error.reason}"])
    except NotACheckpointError as error:
        return FileScan(str(path), None, error=_without_path(error, path), not_a_checkpoint=True)
    except CkptError as error:
        return FileScan(str(path), None, error=_without_path(error, path))
    uses = []
    for (module, name, verdict), count in sorted(counts.items()):
        qualname = f"{module}.{name}"
        verdict = Verdict.ALLOWED if qualname in allowed else verdict
        original = written.get((module, name))
        uses.append(GlobalUse(qualname, verdict, count, original and ".".join(original)))
    return FileScan(str(path), fmt, uses, notes, error="; ".join(problems) or None)


def _is_tar(path: Path | str) -> bool:
    with _open(path) as handle:
        return is_torch_tar(handle)


def _scan_tar(path: Path | str) -> tuple[Counts, list[str], list[str]]:
    """torch's tar format: every pickle torch.load unpickles from it; and, if the file reads
    as a pickle stream or as safetensors too, that reading's globals and a note saying so."""
    with _open(path) as handle:
        found, notes, problems = scan_tar(handle)
        counts = Counter(found)
        handle.seek(0)
        head = handle.read(64)
    other = "safetensors" if looks_like_safetensors(head, len(head)) else None
    with _open(path) as handle:
        size = source_size(handle)
        try:
            stream = read_pickle_stream(handle, size, refuse_dangerous=False, track_spans=False)
        except CkptError:
            stream = None
    if stream is not None and stream.pickle is not None:
        counts.update(stream.pickle.globals_seen)
        other = "a pickle stream"
    if other is not None:
        notes.append(
            f"ambiguous: a tar archive (torch.load reads it as torch's pre-0.4 tar format) "
            f"that is also {other}"
        )
    return counts, notes, problems


def _is_dcp(path: Path | str) -> bool:
    if isinstance(path, str) and is_url(path):
        from ckpttool.io.remote import is_directory

        return is_directory(path)
    return is_dcp_directory(path)


def _without_path(error: CkptError, path: Path | str) -> str:
    """The error's message without the path the reader put first (the report names it)."""
    return str(error).removeprefix(f"{path}: ")


def _files_under(directory: Path) -> list[Path]:
    """Files under ``directory``, recursively; a DCP directory is one input, not its files."""
    found = []
    for root, subdirectories, names in os.walk(directory):
        here = Path(root)
        if is_dcp_directory(here):
            found.append(here)
            subdirectories.clear()
            continue
        found.extend(
            here / name
            for name in names
            if not name.startswith(".") and os.path.getsize(here / name) > 0
        )
    return sorted(found)


def scan(paths: Iterable[str | os.PathLike[str]], allow: Iterable[str] = ()) -> ScanReport:
    """Scan files (and directories, recursively), each path on its own: a missing one is a
    file that could not be scanned, a directory without a checkpoint is listed in ``empty``."""
    allow = list(allow)
    files: list[FileScan] = []
    skipped: list[str] = []
    empty: list[str] = []
    for raw in paths:
        if is_url(raw):  # a file or a DCP directory read by ranges
            files.append(scan_file(os.fspath(raw), allow))
            continue
        path = Path(raw)
        if not path.exists():
            files.append(FileScan(str(path), None, error="no such file or directory"))
        elif path.is_dir() and not is_dcp_directory(path):
            found = 0
            for child in _files_under(path):
                result = scan_file(child, allow)
                if result.not_a_checkpoint:
                    skipped.append(str(child))
                else:
                    files.append(result)
                    found += 1
            if not found:
                empty.append(str(path))
        else:
            files.append(scan_file(path, allow))
    return ScanReport(files, skipped, empty)
