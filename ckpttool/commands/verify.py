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
an interrupted save leaves such files. A plain directory (no checkpoint layout) is walked as
``scan`` walks it: each checkpoint file (and checkpoint directory) in it gets its own verdict.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.selection import find_part, in_folder, unknown_component
from ckpttool.errors import (
    EXIT_ERROR,
    EXIT_FOUND,
    CkptError,
    EmptyFileError,
    InputError,
    NotACheckpointError,
    NotADirectoryCheckpointError,
)
from ckpttool.formats.registry import find_format
from ckpttool.frameworks.base import CHECKPOINT_SUFFIXES
from ckpttool.io.atomic import temp_name_pattern
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


def leftover_temp_files(path: Path) -> list[str]:
    """Temp files an interrupted save left beside ``path`` (ckpttool's and MiniMind's)."""
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
    return result


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
        except NotADirectoryCheckpointError as error:
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
        except (EmptyFileError, NotACheckpointError) as error:
            if path.name.endswith(CHECKPOINT_SUFFIXES):
                results.append(_unreadable(path, error))
        except InputError as error:
            results.append(_unchecked(path, error))
    if not results:
        message = f"{directory}: a directory holding no checkpoint file ckpttool reads"
        results.append(_unchecked(directory, type(refusal)(message)))
    return results


def _checkpoints_under(directory: Path) -> list[Path]:
    """Files under ``directory``, recursively, and the checkpoint directories in it (a DCP or
    framework directory is one input, not its files); hidden files are left out (an
    interrupted save's temp files are reported beside the checkpoint they were meant for)."""
    from ckpttool.formats.registry import directory_format_of
    from ckpttool.frameworks.registry import detect_directory

    found = []
    for root, subdirectories, names in os.walk(directory):
        here = Path(root)
        if here != directory:
            try:
                layout = detect_directory(str(here))  # a Trainer output_dir: its checkpoints
                known = layout is not None and not layout.collection
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
