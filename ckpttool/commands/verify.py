"""``verify``: a full integrity check of a checkpoint file, trusting nothing in it.

Opening a file through the reader already checks the pickle, every storage's size against the
bytes present and every tensor's extent. ``verify`` adds what costs a full read, per format,
through the format's own hook (:meth:`ckpttool.formats.base.FileFormat.verify`: a zip's central
directory against each local header and the CRC-32 of every record, every item of a DCP
directory, a legacy file's trailing bytes), and a framework directory's member files
(:mod:`.verify_directory`); optionally NaN/Inf in every floating tensor. It also reports temp files
that interrupted saves left next to the file. Problems are collected, not
raised, so one run lists all of them; with several paths, one that cannot be checked at all
(missing, unreadable) gets its own verdict and the others are still checked. A file that is
there but is no checkpoint of any format (empty, a few bytes, unrecognised) is a problem found:
an interrupted save leaves such files. A plain directory (no checkpoint layout), and a directory
of several checkpoints (a Trainer ``output_dir``), is walked as ``scan`` walks it: each
checkpoint file (and checkpoint directory) in it gets its own verdict.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.selection import find_part, in_folder, unknown_component
from ckpttool.errors import (
    EXIT_ERROR,
    EXIT_FOUND,
    CheckpointCollectionError,
    CkptError,
    EmptyFileError,
    InputError,
    NotACheckpointError,
    NotADirectoryCheckpointError,
)
from ckpttool.formats.registry import find_format
from ckpttool.frameworks.base import CHECKPOINT_SUFFIXES
from ckpttool.io.atomic import TMP_SUFFIX, temp_name_pattern
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.source import is_url
from ckpttool.io.values import tensor_stats
from ckpttool.model.records import TensorRecord
from ckpttool.pickle.policy import Verdict, never_load_problem


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


#: Temp files any write-then-rename leaves when interrupted, by name, and what left them; the
#: frameworks add their own (``Framework.temp_files``, matched against the path under the
#: directory walked).
TEMP_FILES = (
    (f".*{TMP_SUFFIX}", "an interrupted ckpttool write"),
    # torch DCP's FileSystemWriter (.metadata.tmp), MiniMind's torch.save(NAME.tmp) + replace
    ("*.tmp", "a save interrupted before it renamed its temp file"),
)
#: Temp directories: ckpttool's staged directories (io/atomic.py), named like its temp files.
TEMP_DIRECTORIES = ((f".*{TMP_SUFFIX}", "an interrupted ckpttool write"),)
#: The name ``edit`` and ``rescale-step --backup`` keep the original under: a hard link made
#: before the write, removed when the write fails (:func:`stray_backup`).
BACKUP_SUFFIX = ".bak"


def temp_files_under(directory: Path) -> list[tuple[Path, str]]:
    """Temp files of interrupted writes anywhere under ``directory``, with what left each, in
    walk order; a temp directory (ckpttool's staged directory) is one, not its files."""
    from ckpttool.frameworks.registry import frameworks

    by_path = [rule for framework in frameworks() for rule in framework.temp_files]
    found = []
    for root, subdirectories, names in os.walk(directory):
        here = Path(root)
        for name in sorted([*subdirectories, *names]):
            relative = (here / name).relative_to(directory).as_posix()
            if name in subdirectories:
                what = _matching(TEMP_DIRECTORIES, name)
                if what is not None:
                    subdirectories.remove(name)  # one leftover, not its files
            else:
                what = _matching(TEMP_FILES, name) or _matching(by_path, relative)
            if what is not None:
                found.append((here / name, what))
    return found


def _matching(rules: Sequence[tuple[str, str]], name: str) -> str | None:
    """What left the temp file ``name``, by the first rule whose glob it matches."""
    return next((what for pattern, what in rules if fnmatch.fnmatchcase(name, pattern)), None)


def stray_backup(path: Path) -> str | None:
    """Why ``NAME.bak`` is a stray backup, or None: a second name of ``NAME`` itself (the hard
    link ``--backup`` makes before writing, left by a write that was killed before it replaced
    ``NAME``). A backup the write completed is another file: the user's, not a problem."""
    if not path.name.endswith(BACKUP_SUFFIX):
        return None
    original = path.with_name(path.name.removesuffix(BACKUP_SUFFIX))
    try:
        same = original.is_file() and os.path.samefile(path, original)
    except OSError:
        return None
    if not same:
        return None
    return (
        f"stray backup: a second name of {original.name} (the same file), left by an edit or "
        f"rescale-step --backup killed before it replaced {original.name}, which is unchanged; "
        "delete it"
    )


def leftover_temp_files(path: Path) -> list[str]:
    """Temp files an interrupted save left beside ``path`` (ckpttool's and MiniMind's)."""
    if not path.name:  # ".", "./", "/": the directory's own name, if it has one
        path = path.resolve()
        if not path.name:
            return []
    directory = path.parent if str(path.parent) else Path(".")
    found = sorted(directory.glob(temp_name_pattern(path)))
    minimind_tmp = path.with_name(path.name + ".tmp")  # MiniMind: torch.save(tmp); os.replace
    if minimind_tmp.exists():
        found.append(minimind_tmp)
    return [str(p) for p in found]


def verify_file(
    path: str | os.PathLike[str],
    *,
    values: bool = False,
    progress: ProgressCallback | None = None,
    component: str | None = None,
) -> VerifyResult:
    """Check one file. Raises InputError/NotACheckpointError only when no check can run.
    ``component`` names one part of a multi-component folder: only its files are checked
    (:func:`component_folder`)."""
    path = os.fspath(path) if is_url(path) else Path(path)
    result = VerifyResult(str(path), None, leftovers=_leftovers(path))
    try:
        ckpt = open_checkpoint(path, strict=False, refuse_dangerous=False)
    except (InputError, NotACheckpointError):
        raise
    except CkptError as error:  # corrupt, truncated, a resource bomb, BUILD on a global...
        result.problems.append(_without_path(error, path))
        return result
    with ckpt:
        if component is None and ckpt.format == "directory" and _file_by_file(ckpt):
            raise NotADirectoryCheckpointError(
                f"{path}: a folder of checkpoint files: each verified on its own"
            )
        result.format = ckpt.format
        folder = None if component is None else component_folder(ckpt, component)
        records = _records(ckpt, folder)
        extents = len(records)
        result.checked.append(
            f"structure ({ckpt.format}), {extents} tensor extent{'s' * (extents != 1)}"
        )
        if folder is not None:
            result.checked.append(f"component {component} ({folder or '.'}/): its files only")
        result.problems.extend(p for p in ckpt.problems if in_folder(p.split(": ", 1)[0], folder))
        dangerous = {f"{m}.{n}" for m, n, v in _globals(ckpt) if v is Verdict.DANGEROUS}
        if dangerous:
            result.problems.append(never_load_problem("the pickle calls", dangerous))
        format_problems, format_checked = _format_checks(ckpt, progress, folder)
        result.problems.extend(format_problems)
        result.checked.extend(format_checked)
        if values and not result.problems:
            result.problems.extend(_non_finite(ckpt, records))
            result.checked.append("values: NaN/Inf in floating tensors")
        ckpt.check_unchanged()  # a remote file replaced while it was checked: no verdict
    if isinstance(path, Path) and path.is_dir():  # and those inside no member claimed
        said = " ".join(result.problems)
        result.leftovers += [str(p) for p, _ in temp_files_under(path) if str(p) not in said]
    return result


def _file_by_file(ckpt: Checkpoint) -> bool:
    """A directory whose framework has ``verify`` walk it file by file (a folder of parts)."""
    from ckpttool.frameworks.registry import verified_file_by_file

    return verified_file_by_file(ckpt.details)


def _format_checks(
    ckpt: Checkpoint, progress: ProgressCallback | None, folder: str | None = None
) -> tuple[list[str], list[str]]:
    """(problems, what was checked) by the checkpoint's format's own hook (a zip's records,
    DCP's items...), or, for a framework's directory, of its member files (those in ``folder``
    only, where a component is checked)."""
    fmt = find_format(ckpt.format)
    if fmt is not None:
        return fmt.verify(ckpt, progress)
    if ckpt.format == "directory":
        from ckpttool.commands.verify_directory import check_directory

        return check_directory(ckpt, progress, verify_file, folder)
    return [], []


def component_folder(ckpt: Checkpoint, name: str) -> str:
    """The folder ("" for the root) of the part ``name`` of a multi-component folder, whose
    files alone ``verify --component`` checks. A pipeline component whose folder or weights are
    gone is no part, but it is that component's problem to report, not an unknown name. Raises
    :class:`~ckpttool.errors.InputError` as ``--component`` does in the other commands."""
    part = find_part(ckpt, name)
    if part is not None:
        return str(part.get("folder") or "")
    if any(str(entry).startswith(f"{name}/") for entry in ckpt.details.get("missing", [])):
        return name
    raise InputError(unknown_component(ckpt, name))


def _records(ckpt: Checkpoint, folder: str | None) -> list[TensorRecord]:
    """The checkpoint's tensors; where a component is checked, those its folder's files hold."""
    records = ckpt.tensors()
    if folder is None:
        return records
    sections = tuple(
        f"{m['section']}." for m in ckpt.details.get("members", [])
        if m.get("section") and in_folder(m["name"], folder)
    )  # fmt: skip
    return [r for r in records if r.key.startswith(sections)]


def _leftovers(path: str | Path) -> list[str]:
    """Temp files beside a local file (a URL's neighbours are not listed)."""
    return [] if isinstance(path, str) else leftover_temp_files(path)


def _globals(ckpt: Checkpoint) -> list[tuple[str, str, Verdict]]:
    return list(ckpt.pickle.globals_seen) if ckpt.pickle is not None else []


def _non_finite(ckpt: Checkpoint, records: list[TensorRecord]) -> list[str]:
    """NaN/Inf in every floating tensor, and in the decoded values of a tensor quantized in its
    format's blocks (a GGUF block whose scale is NaN); the block types its format does not
    decode are left out."""
    problems = []
    ckpt.plan_reads(records)  # a URL: few large requests
    for record in records:
        in_blocks = record.quant is not None and record.quant.in_blocks
        if in_blocks:
            try:
                stats = tensor_stats(ckpt, record)
            except InputError:  # a type its format does not decode (GGUF's IQ types...)
                continue
        elif not record.is_floating or record.dtype.startswith("float8") or not record.storage:
            continue
        else:
            stats = tensor_stats(ckpt, record)
        if stats.nan or stats.inf:
            problems.append(f"{record.key}: {stats.nan} NaN and {stats.inf} Inf values")
    return problems


def _without_path(error: CkptError, path: str | Path) -> str:
    """The error's message without the path the reader put first (the report names it)."""
    return str(error).removeprefix(f"{path}: ")


def verify(
    paths: Iterable[str | os.PathLike[str]],
    *,
    values: bool = False,
    progress: ProgressCallback | None = None,
    component: str | None = None,
) -> list[VerifyResult]:
    """Check every path on its own: one that cannot be checked at all (missing, unreadable, a
    directory without checkpoints) gets a result with ``error`` set, and the run goes on. A
    file that is no checkpoint is a problem; a plain directory gives one result per checkpoint
    in it. ``component`` checks only that part of each path, a multi-component folder (a path
    without it cannot be checked)."""
    results = []
    for raw in paths:
        try:
            results.append(verify_file(raw, values=values, progress=progress, component=component))
        except (NotADirectoryCheckpointError, CheckpointCollectionError) as error:
            # a plain directory, or a Trainer output_dir: each checkpoint in it, as its parent's
            # walk finds them
            if component is not None:  # a plain directory has no parts
                results.append(_unchecked(raw, error))
                continue
            results.extend(_verify_directory_files(Path(raw), error, values, progress))
        except (EmptyFileError, NotACheckpointError) as error:  # there, but no checkpoint
            results.append(_unreadable(raw, error))
        except InputError as error:
            results.append(_unchecked(raw, error))
    return results


def _verify_directory_files(
    directory: Path,
    refusal: CkptError,
    values: bool,
    progress: ProgressCallback | None,
) -> list[VerifyResult]:
    """Every checkpoint under a plain ``directory``, each verified on its own. Files that are
    not checkpoints, such as a README, are passed over as ``scan`` passes them, unless named
    like one (``*.pth``...): an empty or torn file there is what an interrupted save leaves."""
    results = []
    for path in _checkpoints_under(directory):
        try:
            results.append(verify_file(path, values=values, progress=progress))
            stray = stray_backup(path)
            if stray is not None:
                results[-1].problems.append(stray)
        except (EmptyFileError, NotACheckpointError) as error:
            if path.name.endswith(CHECKPOINT_SUFFIXES):
                results.append(_unreadable(path, error))
        except InputError as error:
            results.append(_unchecked(path, error))
    if not results:
        message = f"{directory}: a directory holding no checkpoint file ckpttool reads"
        results.append(_unchecked(directory, type(refusal)(message)))
    named = {left for result in results for left in result.leftovers}
    said = " ".join(problem for result in results for problem in result.problems)
    orphans = [
        str(p) for p, _ in temp_files_under(directory) if str(p) not in named and str(p) not in said
    ]
    if orphans:  # temp files no checkpoint here claims (its target gone, a staged directory)
        results.append(VerifyResult(str(directory), "directory", leftovers=orphans))
        results[-1].checked.append("temp files of interrupted writes under it")
    return results


def _checkpoints_under(directory: Path) -> list[Path]:
    """Files under ``directory``, recursively, and the checkpoint directories in it (a DCP or
    framework directory is one input, not its files); hidden files are left out (an
    interrupted save's temp files are reported beside the checkpoint they were meant for)."""
    from ckpttool.formats.registry import directory_format_of
    from ckpttool.frameworks.registry import detect_directory, verified_file_by_file

    found = []
    for root, subdirectories, names in os.walk(directory):
        here = Path(root)
        # ckpttool's staged directories are leftovers (temp_files_under), not checkpoints
        subdirectories[:] = [s for s in subdirectories if not _matching(TEMP_DIRECTORIES, s)]
        if here != directory:
            try:
                layout = detect_directory(str(here))  # a Trainer output_dir: its checkpoints
                known = (
                    layout is not None
                    and not layout.collection
                    and not verified_file_by_file(layout)  # a folder of parts: its files
                )
            except CkptError:  # a framework's layout, damaged: verify says what is wrong
                known = True
            if known or directory_format_of(here) is not None:  # DCP
                found.append(here)
                subdirectories.clear()
                continue
        found.extend(here / name for name in names if not name.startswith("."))
    return sorted(found)


def _unreadable(raw: str | os.PathLike[str], error: CkptError) -> VerifyResult:
    """A file that is there but is no checkpoint: a problem found (``PROBLEMS (unreadable)``)."""
    path = os.fspath(raw) if is_url(raw) else Path(raw)
    return VerifyResult(str(path), None, problems=[_without_path(error, path)],
                        leftovers=_leftovers(path))  # fmt: skip


def _unchecked(raw: str | os.PathLike[str], error: CkptError) -> VerifyResult:
    path = os.fspath(raw) if is_url(raw) else Path(raw)
    return VerifyResult(str(path), None, leftovers=_leftovers(path),
                        error=_without_path(error, path))  # fmt: skip


def verify_exit_code(results: Sequence[VerifyResult]) -> int:
    """0 when every path was checked and is clean; 1 when a problem or a leftover temp file was
    found in any (this wins); 2 when some path could not be checked at all."""
    if any(r.problems or r.leftovers for r in results):
        return EXIT_FOUND
    if any(r.error is not None for r in results):
        return EXIT_ERROR
    return 0
