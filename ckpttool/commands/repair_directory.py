"""``repair`` for directories: a Hugging Face model directory's index, a run directory's
pointer and incomplete checkpoints, leftover temp files (issue 27).

Everything is found first and nothing is written until all of it is known (a tensor stored
twice with different bytes refuses the whole repair). What a directory is comes from the
framework plug-ins (:meth:`~ckpttool.frameworks.base.Framework.rebuild_index`,
:meth:`~ckpttool.frameworks.base.Framework.run_layout`,
:attr:`~ckpttool.frameworks.base.Framework.temp_files`); a plain directory of checkpoint files
(MiniMind's ``*_resume.pth``, a loop's ``step_1000.pt``...) is a run directory of its own kind.
Each checkpoint of a run is judged by ``verify``'s rules (:func:`ckpttool.commands.verify.verify_file`:
its member files' records and CRCs, the framework's completeness rules).

What is changed, all in place: the index (derived data: rewritten atomically), the run's
pointer (DeepSpeed's ``latest``, rewritten atomically to name the newest complete checkpoint
when it names a missing or incomplete one), incomplete checkpoints moved aside to a name resume
never picks (``quarantine``, a rename), leftover temp files removed (``clean``). No checkpoint
file is written or removed: a damaged file is repaired on its own (``repair FILE``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.checkpoint import checkpoint_names
from ckpttool.commands.repair_report import CheckpointState, RepairAction, RepairReport
from ckpttool.commands.verify import temp_files_under, verify_file
from ckpttool.errors import CkptError, InputError, NotADirectoryCheckpointError, name_file
from ckpttool.formats.registry import directory_format_of
from ckpttool.frameworks.base import STEP as STEP  # trend orders its points by it too
from ckpttool.frameworks.base import IndexRepair, RunLayout, files_run
from ckpttool.frameworks.registry import (
    detect_directory,
    frameworks,
    verified_file_by_file,
)
from ckpttool.io.atomic import atomic_write, fsync_dir


@dataclass
class _Found:
    """What the directory holds and what is wrong with it; nothing written yet."""

    title: str
    damage: list[str] = field(default_factory=list)
    stays: list[str] = field(default_factory=list)  # the damage no action mends
    checkpoints: list[CheckpointState] = field(default_factory=list)
    newest_complete: str | None = None
    actions: list[RepairAction] = field(default_factory=list)
    index_content: bytes | None = None
    pointer_content: bytes | None = None
    moves: list[tuple[Path, Path]] = field(default_factory=list)
    removals: list[Path] = field(default_factory=list)


def repair_directory(
    src: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    quarantine: bool = False,
    clean: bool = False,
) -> RepairReport:
    """Repair the model or run directory ``src`` in place (module docstring); ``dry_run``:
    report what would change, change nothing. Raises a :class:`~ckpttool.errors.CkptError`
    naming ``src`` when it is no directory ckpttool knows, or cannot be repaired."""
    directory = Path(src)
    try:
        if not directory.is_dir():
            raise InputError("no such directory" if not directory.exists() else "not a directory")
        found = _examine(directory, quarantine=quarantine, clean=clean)
        if not dry_run:
            _apply(found)
    except CkptError as error:
        raise name_file(error, str(directory)) from None
    written = bool(found.actions) and not dry_run
    return RepairReport(
        source=str(directory),
        kind="directory",
        format=found.title,
        damage=tuple(found.damage),
        recovered=0,
        lost=(),
        dropped=(),
        output=str(directory) if written else None,
        written=written,
        checkpoints=tuple(found.checkpoints),
        newest_complete=found.newest_complete,
        actions=tuple(found.actions),
        dry_run=dry_run,
        unrepaired=tuple(found.stays),
    )


def _examine(directory: Path, *, quarantine: bool, clean: bool) -> _Found:
    path = str(directory)
    index = next((i for f in frameworks() if (i := f.rebuild_index(path)) is not None), None)
    run = next((r for f in frameworks() if (r := f.run_layout(path)) is not None), None)
    titles = []
    found = _Found(title="")
    if index is not None:
        titles.append(f"sharded model directory ({index.index})")
        _index(found, directory, index)
    if run is None and (index is None or not index.damage):
        single = _single_title(path) if index is None else titles[0]
        if single is not None:
            titles[:1] = [single]
            problems = _verify(path)
            found.damage += problems
            found.stays += problems
        else:
            run = checkpoint_files(directory)
            if run is None:
                raise NotADirectoryCheckpointError(
                    "not a directory ckpttool repairs: no Hugging Face model directory, Trainer "
                    "output_dir, DeepSpeed save directory or checkpoint file in it"
                )
    if run is not None:
        titles.append(run.title)
        _run(found, directory, run, quarantine=quarantine)
    _leftovers(found, directory, clean=clean)
    found.title = "; ".join(titles)
    return found


def _index(found: _Found, directory: Path, index: IndexRepair) -> None:
    found.damage += index.damage
    found.stays += index.damage if index.content is None else index.stays
    if index.content is not None:
        found.index_content = index.content
        found.actions.append(
            RepairAction("rewrite index", str(directory / index.index), index.changes)
        )


def _single_title(path: str) -> str | None:
    """The title of one checkpoint directory ckpttool knows (not a run of several), or None
    (a folder of parts, each file a checkpoint of its own, is a run of files too)."""
    try:
        layout = detect_directory(path)
    except CkptError:  # a framework's layout, damaged: verify says what is wrong
        return "checkpoint directory"
    if layout is not None:
        return None if verified_file_by_file(layout) else layout.title
    fmt = directory_format_of(path)
    return f"{fmt.id} directory" if fmt is not None else None


def _verify(path: str) -> list[str]:
    """verify's problems with the checkpoint at ``path`` (file or directory), one line each."""
    try:
        return list(verify_file(path).problems)
    except CkptError as error:
        return [str(error).removeprefix(f"{path}: ")]


def checkpoint_files(directory: Path) -> RunLayout | None:
    """A plain directory's checkpoint files, oldest first: by the step in their names when each
    has a different one, else by modification time."""
    names = checkpoint_names(str(directory))
    return files_run(str(directory), names) if names else None


def _run(found: _Found, directory: Path, run: RunLayout, *, quarantine: bool) -> None:
    """Each checkpoint judged by verify's rules; the pointer; incomplete ones moved aside."""
    complete: dict[str, bool] = {}
    for name in run.checkpoints:
        problems = _verify(str(directory / name))
        complete[name] = not problems
        found.checkpoints.append(
            CheckpointState(str(directory / name), not problems, tuple(problems))
        )
        if problems:
            found.damage.append(_incomplete_line(name, problems))
            if not (quarantine and run.aside is not None):  # else moved aside, below
                found.stays.append(found.damage[-1])
    newest = next((name for name in reversed(run.checkpoints) if complete[name]), None)
    found.newest_complete = str(directory / newest) if newest is not None else None
    if newest is None and run.checkpoints:
        found.damage.append("no checkpoint is complete: there is none to resume from")
        found.stays.append(found.damage[-1])
    if run.pointer is not None:
        _pointer(found, directory, run, complete, newest)
    if quarantine and run.aside is not None:
        taken: set[Path] = set()
        for name in run.checkpoints:
            if complete[name]:
                continue
            target = _free(directory / run.aside(name), taken)
            found.moves.append((directory / name, target))
            found.actions.append(
                RepairAction(
                    "quarantine",
                    str(directory / name),
                    f"incomplete: moved to {target.name}, a name resume never picks",
                )
            )


def _incomplete_line(name: str, problems: list[str]) -> str:
    first = problems[0] if problems[0].startswith("incomplete") else f"incomplete: {problems[0]}"
    more = len(problems) - 1
    return f"{name}: {first}" + (f" (and {more} more problem{'s' * (more != 1)})" if more else "")


def _pointer(
    found: _Found, directory: Path, run: RunLayout, complete: dict[str, bool], newest: str | None
) -> None:
    pointer = run.pointer
    assert pointer is not None
    if run.pointer_problem:
        why = f"unreadable ({run.pointer_problem})"
    elif run.pointed is None:
        why = "missing"
    elif run.pointed not in complete:
        what = "is not a checkpoint" if (directory / run.pointed).exists() else "does not exist"
        why = f"names {run.pointed!r}, which {what}"
    elif not complete[run.pointed]:
        why = f"names {run.pointed!r}, which is incomplete"
    else:
        return
    found.damage.append(f"{pointer}: {why}")
    if newest is None:
        found.stays.append(found.damage[-1])
        return
    found.pointer_content = newest.encode()
    found.actions.append(
        RepairAction(
            "rewrite pointer",
            str(directory / pointer),
            f"{pointer} {why}; it now names {newest!r}, the newest complete checkpoint",
        )
    )


def _free(target: Path, taken: set[Path]) -> Path:
    """``target``, or ``target.2``, ``target.3``... when that name is in use."""
    candidate, n = target, 1
    while candidate.exists() or candidate.is_symlink() or candidate in taken:
        n += 1
        candidate = target.with_name(f"{target.name}.{n}")
    taken.add(candidate)
    return candidate


def _leftovers(found: _Found, directory: Path, *, clean: bool) -> None:
    """Temp files of interrupted writes anywhere under ``directory`` (verify's rules:
    :func:`~ckpttool.commands.verify.temp_files_under`): listed; ``clean``: removed. A temp
    directory (ckpttool's staged directory) is one leftover."""
    for path, what in temp_files_under(directory):
        relative = path.relative_to(directory).as_posix()
        found.damage.append(f"{relative}: leftover temp file of {what}")
        if not clean:
            found.stays.append(found.damage[-1])
        else:
            found.removals.append(path)
            found.actions.append(RepairAction("remove", str(path), f"leftover temp file of {what}"))


def _apply(found: _Found) -> None:
    """Make the changes found: temp files removed, then the index and the pointer rewritten
    (atomically), then incomplete checkpoints moved aside."""
    for path in found.removals:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        fsync_dir(path.parent)
    for action in found.actions:
        content = {
            "rewrite index": found.index_content,
            "rewrite pointer": found.pointer_content,
        }.get(action.action)
        if content is not None:
            with atomic_write(action.path) as handle:
                handle.write(content)
    for source, target in found.moves:
        os.rename(source, target)
        fsync_dir(source.parent)
