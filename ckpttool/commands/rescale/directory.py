"""``rescale-step`` for framework directories, rewritten all-or-nothing for a new number of
processes.

The framework of the directory (:mod:`ckpttool.frameworks.registry`) plans what happens to each
file (:meth:`~ckpttool.frameworks.base.Framework.rescale_plan`: a Trainer ``checkpoint-N/`` in
:mod:`ckpttool.frameworks.huggingface.rescale`, an accelerate ``save_state`` folder in
:mod:`ckpttool.frameworks.accelerate.rescale`, each with its rules from the framework's own
source), or writes its own output (:attr:`~ckpttool.frameworks.base.Framework.rescales_itself`:
DeepSpeed's universal checkpoint). Here the plan is carried out, naming no framework.

Unchanged files are copied byte for byte; changed pickled files are spliced
(:func:`~ckpttool.formats.registry.field_rewrite`, never loaded or re-pickled) and read back;
JSON files (``trainer_state.json``) are rewritten with their key order. The new directory is
built as a temp directory beside the target, fsynced, then renamed into place
(:func:`ckpttool.io.atomic.staged_directory`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from ckpttool.checkpoint import open_checkpoint
from ckpttool.errors import CkptError, InputError, LayoutError, OutputExistsError, name_file
from ckpttool.formats.registry import directory_format_of, field_rewrite, verify_rewrite
from ckpttool.frameworks.base import Framework, FrameworkDirectory
from ckpttool.frameworks.registry import detect_before_format, detect_once, frameworks
from ckpttool.io.atomic import fsync_dir, staged_directory
from ckpttool.model.rescaling import (
    COPY,
    DROP,
    REWRITE,
    DirectoryPlan,
    DirectoryRescaleReport,
    FileAction,
    RescaleRequest,
    RescaleTarget,
    ValueChange,
)

__all__ = [
    "DirectoryRescaleReport",
    "FileAction",
    "ValueChange",
    "plan_directory",
    "rescale_directory",
    "rescale_directory_to",
]


def rescale_directory(
    path: str | os.PathLike[str],
    world_size: int,
    *,
    from_world_size: int | None = None,
    strict: bool = False,
    output: str | os.PathLike[str] | None = None,
    in_place: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    batch_size: int | None = None,
    keep_global_batch: bool = False,
) -> DirectoryRescaleReport:
    """Rescale the framework checkpoint directory ``path`` for ``world_size`` processes.

    A framework that writes its rescale itself (DeepSpeed ZeRO: a universal checkpoint,
    ``keep_global_batch`` keeps its counters) is asked first; any other framework plans what
    happens to each file (:meth:`~ckpttool.frameworks.base.Framework.rescale_plan`) and the
    directory is written here.

    Writes a new directory, ``output`` or ``PATH.ws<N>`` (refused if it exists, unless
    ``overwrite``), or with ``in_place`` replaces ``path``; either way the result is built as a
    temp directory beside it and renamed into place, so a crash leaves the old checkpoint or
    the complete new one. ``dry_run`` plans and checks everything and writes nothing.
    (:func:`rescale_directory_to` with the :class:`RescaleTarget` made of the keywords.)
    """
    target = RescaleTarget(
        world_size, from_world_size=from_world_size, batch_size=batch_size, strict=strict,
        keep_global_batch=keep_global_batch,
    )  # fmt: skip
    return rescale_directory_to(path, target, output=output, in_place=in_place,
                                overwrite=overwrite, dry_run=dry_run)  # fmt: skip


def rescale_directory_to(
    path: str | os.PathLike[str],
    target: RescaleTarget,
    *,
    output: str | os.PathLike[str] | None = None,
    in_place: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
) -> DirectoryRescaleReport:
    """Rescale the framework checkpoint directory ``path`` for ``target``; the rest as
    :func:`rescale_directory`."""
    path = Path(path)
    if in_place and output is not None:
        raise InputError("--in-place and -o/--output exclude each other")
    request = RescaleRequest(
        target.world_size, target.from_world_size, target.strict, output, in_place, overwrite,
        dry_run, target.batch_size, target.keep_global_batch, target.step_key,
    )  # fmt: skip
    try:
        return _rescale_directory(path, request)
    except CkptError as error:
        raise name_file(error, str(path)) from None  # every error says which checkpoint


def _rescale_directory(path: Path, request: RescaleRequest) -> DirectoryRescaleReport:
    known: dict[str, FrameworkDirectory | None] = {}
    for framework in frameworks():
        if framework.rescales_itself:
            found = detect_once(framework, str(path), known)
            if found is not None:
                _check_step_key(path, framework, found, request)
                return framework.rescale(path, found, request)
    if request.keep_global_batch:
        raise InputError("--keep-global-batch applies to a DeepSpeed ZeRO checkpoint")
    planned = _plan(path, request, known)
    layout, plan, actions, changes, notes = (
        planned.layout, planned.plan, planned.actions, planned.changes, planned.notes
    )  # fmt: skip
    world_size, output, in_place = request.world_size, request.output, request.in_place
    in_run = planned.default_output is not None
    if in_place:
        target = path
    elif output is not None:
        target = Path(output)
    elif planned.default_output is not None:
        target = planned.default_output
    else:
        target = Path(f"{path}.ws{world_size}")
    if not in_place:
        if target.resolve() == path.resolve():
            raise InputError(f"{target} is the checkpoint itself; use --in-place to replace it")
        if in_run and planned.check_output is not None:
            planned.check_output(target)
        if os.path.lexists(target) and not request.overwrite:
            raise OutputExistsError(f"{target} already exists (pass --force to replace it)")
    resume = None
    if planned.resume_note is not None:
        resume = str(target)
        notes.append(planned.resume_note(target))
    report = DirectoryRescaleReport(
        path, target, layout, plan, tuple(changes), tuple(actions), tuple(notes),
        request.batch_size, request.dry_run, False, in_place, resume,
    )  # fmt: skip
    if request.dry_run:
        _check_rewrites(path, actions)  # the same refusals as a real run
        return report
    if in_place and not changes and all(a.action == COPY and a.name == a.source for a in actions):
        return report
    _write_directory(path, target, actions, replace_existing=in_place or request.overwrite)
    return DirectoryRescaleReport(**{**report.__dict__, "written": True})


def plan_directory(
    path: Path,
    world_size: int,
    *,
    from_world_size: int | None = None,
    strict: bool = False,
) -> DirectoryPlan:
    """What the rescale of the directory ``path`` does, without writing anything."""
    return _plan(path, RescaleRequest(world_size, from_world_size, strict), {})


def _plan(
    path: Path, request: RescaleRequest, known: dict[str, FrameworkDirectory | None]
) -> DirectoryPlan:
    directory_format = directory_format_of(path) if path.is_dir() else None
    if directory_format is not None and detect_before_format(str(path), known) is None:
        raise LayoutError(
            f"{path}: a {directory_format.directory_title} directory; rescale-step rewrites one "
            "checkpoint file or a Trainer/accelerate folder "
            f"({directory_format.no_rescale_why}), so it is not supported"
        )
    found: tuple[Framework, FrameworkDirectory] | None = None
    # the first framework that knows the directory and rescales it: a Trainer checkpoint-N/ of
    # a PEFT model is a PEFT adapter to show, and a Trainer checkpoint to rescale
    for framework in frameworks():
        layout = detect_once(framework, str(path), known)
        if layout is not None and not layout.collection:
            found = found or (framework, layout)
            _check_step_key(path, framework, layout, request)
            planned = framework.rescale_plan(path, layout, request)
            if planned is not None:
                return planned
    what = found[1].title if found is not None else "not a framework checkpoint directory"
    raise LayoutError(
        f"{path}: {what}; rescale-step rewrites a Trainer checkpoint-N/ or an accelerate "
        "save_state folder (or one checkpoint file)"
    )


def _check_step_key(
    path: Path, framework: Framework, layout: FrameworkDirectory, request: RescaleRequest
) -> None:
    """``--step-key`` names a counter the framework rescales only when asked; any other is
    refused rather than ignored."""
    if request.step_key is None or request.step_key in framework.rescale_step_keys:
        return
    accepted = ", ".join(framework.rescale_step_keys)
    raise InputError(
        f"{path}: a {layout.title}; --step-key "
        + (f"takes {accepted} here" if accepted else "applies to one checkpoint file")
    )


def _check_rewrites(path: Path, actions: list[FileAction]) -> None:
    for action in actions:
        if action.action == REWRITE and not action.source.endswith(".json"):
            with open_checkpoint(path / action.source, track_spans=True) as ckpt:
                field_rewrite(ckpt, action.changes).close()


def _write_directory(
    path: Path, target: Path, actions: list[FileAction], *, replace_existing: bool
) -> None:
    parent = target.resolve().parent
    made_parent = not parent.exists()
    if made_parent:  # a new run directory (OUTPUT_DIR.wsM/): made here, removed if left empty
        parent.mkdir()
        fsync_dir(parent.parent)
    try:
        with staged_directory(target, replace_existing=replace_existing, parent=parent) as temp:
            for action in actions:
                if action.action != DROP:
                    _write_member(path / action.source, temp / action.name, action)
    except BaseException:
        if made_parent:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _write_member(source: Path, destination: Path, action: FileAction) -> None:
    with open(destination, "xb") as out:
        if action.action == COPY:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, out, 8 << 20)
        elif source.name.endswith(".json"):
            out.write((json.dumps(action.changes, indent=2) + "\n").encode())
        else:
            with (
                open_checkpoint(source, track_spans=True) as ckpt,
                field_rewrite(ckpt, action.changes) as rewrite,
            ):
                rewrite.write(out)
        out.flush()
        os.fsync(out.fileno())
    if action.action == REWRITE and not source.name.endswith(".json"):
        with open_checkpoint(source) as ckpt:
            verify_rewrite(ckpt, destination, action.changes)
