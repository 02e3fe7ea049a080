"""``rescale-step``: repair a resume checkpoint's ``step`` for a different number of GPUs.

A resume checkpoint's ``step`` counts dataloader batches *per rank*: saved on 8 GPUs at step
1200, the run had consumed 1200 x 8 = 9600 global batches; resumed on 2 GPUs, each rank must
skip 4800 batches, not 1200. MiniMind patches this silently at load time
(``step * saved_world_size // world_size``); here it is an explicit, inspectable repair of the
file, recorded in the file itself (``rescaled_from``).

:func:`rescale_fields` is the repair as a pure ``dict -> dict`` function; :func:`rescale_step`
applies it to a file by splicing the pickle (:func:`ckpttool.formats.registry.field_rewrite`): tensors are copied byte
for byte, never loaded, torch is never imported, and the result replaces the file atomically
after it has been read back and checked.

When ``step * saved`` is not a multiple of the new world size, the floor leaves
``r = (step * saved) % world_size`` global batches (``r * batch_size`` samples, with
``batch_size`` samples per rank-batch) that the resumed run trains a second time: ``r <
world_size``, so on average less than one batch per rank (``r / world_size`` of one). With a
sampler that deals one shuffled order out to the ranks in turn, as ``DistributedSampler`` does,
no rank repeats more than ``ceil(r * batch_size / world_size)`` samples (at most one batch), and
no sample is skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import open_checkpoint
from ckpttool.errors import (
    CkptError,
    InexactRescaleError,
    InputError,
    LayoutError,
    OutputExistsError,
    name_file,
)
from ckpttool.formats.base import FieldRewrite
from ckpttool.formats.registry import (
    directory_format_of,
    field_rewrite,
    holds_weights_only,
    verify_rewrite,
)
from ckpttool.io.atomic import atomic_group, clear_stale_backup
from ckpttool.io.progress import ProgressCallback
from ckpttool.model.lr_schedule import rescale_scheduler
from ckpttool.model.rescaling import RescalePlan, RescaleTarget, describe_repeats
from ckpttool.model.roles import LAYOUT_TITLES, LIGHTNING, TRAINING, is_resume, layout_of
from ckpttool.pickle.edit import emit

__all__ = [
    "HISTORY_KEY",
    "SCHEDULER_KEY",
    "InexactRescaleError",
    "RescalePlan",
    "RescaleReport",
    "RescaleTarget",
    "describe_repeats",
    "rescale_fields",
    "rescale_file",
    "rescale_step",
]

#: Top-level key holding the rescale history: ``[{"step": 1200, "world_size": 8}, ...]``, one
#: entry per rescale, oldest first, each with the step (under the rescaled key's name) and the
#: world size it was counted under before that rescale.
HISTORY_KEY = "rescaled_from"
WORLD_SIZE_KEY = "world_size"
#: Where save_checkpoint (and training dicts of its kind) keep the LR scheduler's state dict.
SCHEDULER_KEY = "scheduler"


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return value


def rescale_fields(
    fields: Mapping[str, Any],
    world_size: int,
    *,
    from_world_size: int | None = None,
    step_key: str = "step",
    strict: bool = False,
) -> tuple[dict[str, Any], RescalePlan]:
    """Rescale ``fields[step_key]`` from the saved world size to ``world_size``.

    Returns the new top-level fields (a new dict: ``step_key`` and ``world_size`` updated in
    place, ``world_size`` and ``rescaled_from`` appended when absent, a torch LR scheduler's
    state under ``scheduler`` moved by the same factor (:func:`ckpttool.model.lr_schedule.rescale_scheduler`;
    the plan says what moved, or why it did not), everything else and the key order untouched)
    and the plan. The saved world size is ``from_world_size`` when given
    (for files without one, or with a wrong one), else the file's ``world_size``. When nothing
    would change, the fields come back equal and ``plan.changed`` is False.

    >>> new, plan = rescale_fields({"epoch": 1, "step": 1200, "world_size": 8}, 2)
    >>> new
    {'epoch': 1, 'step': 4800, 'world_size': 2, 'rescaled_from': [{'step': 1200, 'world_size': 8}]}
    """
    world_size = _positive(world_size, "the new world size")
    if step_key in (WORLD_SIZE_KEY, HISTORY_KEY):
        raise InputError(f"{step_key!r} cannot be the step key")
    if step_key not in fields:
        names = ", ".join(map(str, fields)) or "none"
        raise LayoutError(f"no {step_key!r} field to rescale (top-level keys: {names})")
    old_step = fields[step_key]
    if isinstance(old_step, bool) or not isinstance(old_step, int) or old_step < 0:
        raise LayoutError(
            f"{step_key!r} holds {old_step!r}, not a count of batches (a non-negative int); "
            "nothing was changed"
        )
    file_world_size = fields.get(WORLD_SIZE_KEY)
    if from_world_size is not None:
        saved = _positive(from_world_size, "--from-world-size")
    elif isinstance(file_world_size, int) and not isinstance(file_world_size, bool):
        saved = _positive(file_world_size, "the file's world_size")
    else:
        has = "no world_size" if file_world_size is None else f"world_size {file_world_size!r}"
        raise InputError(
            f"the checkpoint has {has}, so the number of GPUs its step was counted on is "
            "unknown: pass --from-world-size M (older MiniMind files do not record it)"
        )
    new_step = old_step * saved // world_size
    history_before = fields.get(HISTORY_KEY, [])
    if not isinstance(history_before, list) or not all(
        isinstance(entry, dict) for entry in history_before
    ):
        raise LayoutError(
            f"{HISTORY_KEY!r} holds {history_before!r:.60}, not ckpttool's history list; "
            "refusing to overwrite it"
        )
    history = [dict(entry) for entry in history_before]
    plan = RescalePlan(step_key, old_step, new_step, saved, file_world_size, world_size, ())
    if not plan.changed:
        return dict(fields), replace(plan, history=tuple(history))
    if strict and not plan.exact:
        raise InexactRescaleError(
            f"{old_step} x {saved} = {plan.global_batches} global batches is not a multiple of "
            f"{world_size}: {describe_repeats(plan)}; refused (--strict)"
        )
    history.append({step_key: old_step, WORLD_SIZE_KEY: saved})
    new_fields = dict(fields)
    new_fields[step_key] = new_step
    new_fields[WORLD_SIZE_KEY] = world_size
    new_fields[HISTORY_KEY] = history
    plan = replace(plan, history=tuple(history))
    if fields.get(SCHEDULER_KEY) is not None:
        moved = rescale_scheduler(fields[SCHEDULER_KEY], saved, world_size)
        if moved.state is not None:
            new_fields[SCHEDULER_KEY] = moved.state
        plan = replace(plan, scheduler_changes=moved.changes, scheduler_note=moved.note)
    return new_fields, plan


@dataclass(frozen=True)
class RescaleReport:
    path: Path
    output: Path  # where the result goes (== path when in place)
    format: str
    layout: str
    plan: RescalePlan
    batch_size: int | None
    dry_run: bool
    written: bool  # False for a dry run and when nothing would change
    backup: Path | None


def rescale_step(
    path: str | os.PathLike[str],
    world_size: int,
    *,
    from_world_size: int | None = None,
    step_key: str | None = None,
    strict: bool = False,
    output: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    backup: bool = False,
    dry_run: bool = False,
    batch_size: int | None = None,
    progress: ProgressCallback | None = None,
) -> RescaleReport:
    """Rescale the step of the resume checkpoint at ``path`` for ``world_size`` ranks.

    Writes in place (atomically: temp file, fsync, rename, fsync of the directory) or to
    ``output`` (refused if it exists, unless ``overwrite``). ``backup`` keeps the original as
    ``PATH.bak`` (refused if that exists). ``dry_run`` plans and checks everything but writes
    nothing. ``step_key`` names the field to rescale; when not given, the file must be a
    resume checkpoint and ``step`` is used. Raises a :class:`~ckpttool.errors.CkptError`.
    (:func:`rescale_file` with the :class:`RescaleTarget` made of the keywords.)
    """
    target = RescaleTarget(
        world_size, from_world_size=from_world_size, batch_size=batch_size, strict=strict,
        step_key=step_key,
    )  # fmt: skip
    return rescale_file(path, target, output=output, overwrite=overwrite, backup=backup,
                        dry_run=dry_run, progress=progress)  # fmt: skip


def rescale_file(
    path: str | os.PathLike[str],
    target: RescaleTarget,
    *,
    output: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    backup: bool = False,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
) -> RescaleReport:
    """Rescale the step of the resume checkpoint at ``path`` for ``target``; the rest as
    :func:`rescale_step`."""
    from ckpttool.io.source import is_url

    if is_url(path) or (output is not None and is_url(output)):
        raise InputError(
            f"{output if output is not None and is_url(output) else path}: rescale-step "
            "rewrites a local file (atomically, with a rename); download the checkpoint first"
        )
    path = Path(path)
    written_to = Path(output) if output is not None else path
    in_place = _same_file(path, written_to)
    backup_path = path.with_name(path.name + ".bak") if backup else None
    _check_request(path, written_to, in_place=in_place, backup_path=backup_path,
                   overwrite=overwrite, batch_size=target.batch_size, dry_run=dry_run)  # fmt: skip
    try:
        return _rescale_file(path, written_to, target, in_place=in_place,
                             backup_path=backup_path, dry_run=dry_run, progress=progress)  # fmt: skip
    except CkptError as error:
        raise name_file(error, str(path)) from None  # every error says which file


def _rescale_file(
    path: Path,
    written_to: Path,
    target: RescaleTarget,
    *,
    in_place: bool,
    backup_path: Path | None,
    dry_run: bool,
    progress: ProgressCallback | None,
) -> RescaleReport:
    step_key = target.step_key
    with open_checkpoint(path, track_spans=True) as ckpt:
        layout = layout_of(ckpt)
        if step_key is None and layout == TRAINING and isinstance(ckpt.root, dict):
            step_key = training_counter(ckpt.root)
        _check_layout(path, ckpt.format, layout, ckpt.root, step_key)
        new_fields, plan = rescale_fields(
            ckpt.root,
            target.world_size,
            from_world_size=target.from_world_size,
            step_key=step_key or "step",
            strict=target.strict,
        )
        report = RescaleReport(
            path, written_to, ckpt.format, layout, plan, target.batch_size, dry_run, False, None
        )
        if not plan.changed:
            return report
        keys = [plan.step_key, WORLD_SIZE_KEY, HISTORY_KEY]
        if plan.scheduler_changes and not _emittable(new_fields[SCHEDULER_KEY]):
            plan = replace(plan, scheduler_changes=(), scheduler_note=(
                "its state holds values other than plain numbers, strings and lists, which "
                "ckpttool does not rewrite: left at last_epoch "
                f"{ckpt.root[SCHEDULER_KEY].get('last_epoch')}; rebuild it for the new number "
                "of processes"
            ))  # fmt: skip
            report = replace(report, plan=plan)
        if plan.scheduler_changes:
            keys.append(SCHEDULER_KEY)  # the whole value is re-emitted (plain data only)
        changes = {key: new_fields[key] for key in keys}
        with field_rewrite(ckpt, changes) as rewrite:
            if dry_run:
                return report
            made_backup = _rewrite_file(rewrite, path, written_to, in_place, backup_path, progress)
    return replace(report, written=True, backup=made_backup)


def _emittable(value: Any) -> bool:
    try:
        emit(value)
    except TypeError:
        return False
    return True


def _check_request(
    path: Path,
    target: Path,
    *,
    in_place: bool,
    backup_path: Path | None,
    overwrite: bool,
    batch_size: int | None,
    dry_run: bool,
) -> None:
    """The refusals that need no reading of the file: the options and the paths (a stale
    backup, :func:`~ckpttool.io.atomic.clear_stale_backup`, is removed, not refused)."""
    if backup_path is not None and not in_place:
        raise InputError("--backup applies to in-place rewrites; with -o the original is kept")
    if (
        backup_path is not None
        and os.path.lexists(backup_path)
        and not clear_stale_backup(path, backup_path, dry_run=dry_run)
    ):
        raise OutputExistsError(
            f"{backup_path} already exists: move it away first (it is never overwritten)"
        )
    if not in_place and os.path.lexists(target) and not overwrite:
        raise OutputExistsError(f"{target} already exists (pass --force to replace it)")
    directory_format = directory_format_of(path) if path.is_dir() else None
    if directory_format is not None:
        raise LayoutError(
            f"{path}: a {directory_format.directory_title} directory; rescale-step rewrites one "
            f"checkpoint file ({directory_format.no_rescale_why}), so it is not supported"
        )
    if target.is_dir():
        raise InputError(f"{target} is a directory; -o takes the output file's path")
    if batch_size is not None:
        _positive(batch_size, "--batch-size")


def _rewrite_file(
    rewrite: FieldRewrite,
    path: Path,
    target: Path,
    in_place: bool,
    backup_path: Path | None,
    progress: ProgressCallback | None,
) -> Path | None:
    """Write the rewritten file to ``target`` or, in place, over ``path`` keeping its mode.
    Returns the backup made, if any."""
    mode = os.stat(path).st_mode & 0o7777
    # Through a symlink, replace the file it points to, not the link.
    write_to = Path(os.path.realpath(path)) if in_place else target
    try:
        made_backup = _write(rewrite, write_to, backup_path, progress)
    except OSError as error:
        raise InputError(f"cannot write {target} ({error.strerror or error})") from error
    if in_place:
        with contextlib.suppress(OSError):
            os.chmod(write_to, mode)  # new files get the umask's mode; keep the original's
    return backup_path if made_backup else None


def _write(
    rewrite: FieldRewrite,
    target: Path,
    backup_path: Path | None,
    progress: ProgressCallback | None,
) -> bool:
    """Write, read back and check, keep the backup, replace. Returns whether a backup was made.

    The check and the backup run on the complete, fsynced temp file before the rename, so any
    failure leaves the original in place (and no backup of ours behind).
    """
    made_backup = False
    original = os.stat(rewrite.ckpt.path)

    def check_then_backup(temps: list[Path]) -> None:
        nonlocal made_backup
        verify_rewrite(rewrite.ckpt, temps[0], rewrite.changes)
        if backup_path is not None:
            _make_backup(Path(os.path.realpath(rewrite.ckpt.path)), backup_path)
            made_backup = True

    try:
        with atomic_group([target], check=check_then_backup) as (handle,):
            rewrite.write(handle, progress)
    except BaseException:
        if made_backup and backup_path is not None and _unchanged(target, original):
            with contextlib.suppress(OSError):
                backup_path.unlink()
        raise
    return made_backup


def _unchanged(path: Path, before: os.stat_result) -> bool:
    """Whether ``path`` is still the file ``before`` described (not yet replaced)."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino)


def _make_backup(path: Path, backup_path: Path) -> None:
    """A hard link: instant and exact (the rewrite gives ``path`` a new inode); else a copy.

    ``path`` is the real file: ``os.link`` on a symlink would link the symlink itself.
    """
    try:
        os.link(path, backup_path)
    except FileExistsError:
        raise OutputExistsError(f"{backup_path} appeared while rewriting; it was kept") from None
    except OSError:
        with open(backup_path, "xb") as out, open(path, "rb") as source:
            shutil.copyfileobj(source, out, 8 << 20)
            out.flush()
            os.fsync(out.fileno())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


#: The counters of a role-recognised training checkpoint (the tutorial's dict and its kin) that
#: count batches or optimizer steps per rank, in the order one is chosen. ``epoch`` stays (it
#: counts passes over the data, whatever the number of ranks), and sample counts
#: (``consumed_samples``...) are the same on any number of ranks.
TRAINING_STEP_KEYS = (
    "step", "global_step", "global_steps", "iteration", "iter", "iter_num", "num_updates",
)  # fmt: skip


def training_counter(root: Mapping[str, Any]) -> str | None:
    """The per-rank step counter of a training checkpoint's top level, or None."""
    for key in TRAINING_STEP_KEYS:
        value = root.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key
    return None


def _check_layout(
    path: Path, file_format: str, layout: str, root: Any, step_key: str | None
) -> None:
    if holds_weights_only(file_format):
        raise LayoutError(
            f"{path}: a {file_format} file holds weights only; there is no training step to rescale"
        )
    if not isinstance(root, dict):
        raise LayoutError(
            f"{path}: the file holds {LAYOUT_TITLES.get(layout, layout)!r}, not a dict"
        )
    if step_key is not None or is_resume(layout):
        return
    if layout == LIGHTNING:
        raise LayoutError(
            f"{path}: a Lightning checkpoint; its global_step counts optimizer steps, not "
            "dataloader batches per rank, so rescaling it is not the right repair by default. "
            "If you know it should scale with the number of GPUs, name it: --step-key global_step"
        )
    if layout == TRAINING:
        raise LayoutError(
            f"{path}: a training checkpoint with no step counter ({', '.join(TRAINING_STEP_KEYS)}"
            "); epoch counts passes over the data and stays. To rescale another top-level field "
            "that counts batches per rank, name it with --step-key KEY"
        )
    raise LayoutError(
        f"{path}: a {LAYOUT_TITLES.get(layout, layout)}, not a resume checkpoint (those have "
        "model, optimizer, epoch and step); nothing to rescale. To rescale another top-level "
        "field that counts batches per rank, name it with --step-key KEY"
    )
