"""``rescale-step`` for framework directories: a Trainer ``checkpoint-N/`` and an accelerate
``save_state`` folder, rewritten all-or-nothing for a new number of processes.

The rules, from the frameworks' own source (transformers 5.23, accelerate 1.15), assuming the
per-device batch size stays the same (docs/rescale-step.md explains each):

* Trainer (``trainer.py``): ``global_step`` counts optimizer steps, each of which consumed
  ``per_device_batch x gradient_accumulation x world_size`` samples. On resume
  ``_init_training_state`` derives ``epochs_trained = global_step // num_update_steps_per_epoch``
  and ``steps_trained_in_current_epoch = global_step % num_update_steps_per_epoch x
  gradient_accumulation``, and ``skip_first_batches`` skips that many *per-rank* batches. So
  ``global_step`` is rescaled like MiniMind's step: ``global_step x saved // new``. ``epoch``
  (the fraction of the data seen) is kept, scaled by the floor's loss when inexact. The
  scheduler (``scheduler.pt``, stepped once per optimizer step, not wrapped by accelerate's
  ``AcceleratedScheduler``) has ``last_epoch == global_step``: ``last_epoch`` and
  ``_step_count`` move by the same amount. RNG files: ``_load_rng_state`` reads
  ``rng_state.pth`` on one process, else ``rng_state_{process_index}.pth``, and carries on
  without a file (a log line). Ranks that remain keep their own file; ranks that disappear are
  dropped; new ranks get none (a copy of another rank's would give two ranks one random stream).
* accelerate (``checkpointing.py``, ``scheduler.py``): ``random_states_{rank}.pkl`` holds
  ``accelerator.step``, the per-rank count of batches seen through ``accumulate`` since the
  dataloader last ended: rescaled by ``saved // new``. ``AcceleratedScheduler.step`` steps the
  wrapped scheduler ``num_processes`` times per optimizer step (unless ``split_batches``), so
  ``last_epoch`` counts per-rank batches over all ranks, ``optimizer_steps x saved``: after the
  rescale it is ``(optimizer_steps x saved // new) x new``, unchanged when exact. A rank
  without its file loads no ``step`` (stays 0, so ranks would disagree on when gradient
  accumulation syncs): new ranks get a copy of rank 0's file.

Unchanged files are copied byte for byte; changed pickled files are spliced
(:func:`~ckpttool.formats.registry.field_rewrite`, never loaded or re-pickled) and read back;
``trainer_state.json`` is rewritten with its key order. The new directory is built as a temp
directory beside the target, fsynced, then renamed into place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.rescale.run import InexactRescaleError, RescalePlan, describe_repeats
from ckpttool.errors import CkptError, InputError, LayoutError, OutputExistsError, name_file
from ckpttool.formats.base import is_dcp_directory
from ckpttool.formats.registry import field_rewrite, verify_rewrite
from ckpttool.frameworks.accelerate import files as accelerate
from ckpttool.frameworks.base import list_files
from ckpttool.frameworks.huggingface import files as huggingface
from ckpttool.io.atomic import TMP_SUFFIX, fsync_dir
from ckpttool.model.lr_schedule import moved_counters

__all__ = [
    "DirectoryRescaleReport",
    "FileAction",
    "ValueChange",
    "plan_directory",
    "rescale_directory",
]

COPY, REWRITE, DROP = "copy", "rewrite", "drop"
ACCELERATE_SCHEDULER = ("scheduler.bin",)  # plus scheduler_{i}.bin (checkpointing.py)


@dataclass(frozen=True)
class ValueChange:
    """One value the rescale changes: ``file`` (its name in the output), ``key``, old, new."""

    file: str
    key: str
    old: Any
    new: Any


@dataclass(frozen=True)
class FileAction:
    """What happens to one file: ``name`` in the output (the source name for ``drop``)."""

    name: str
    source: str  # the file of the original directory it comes from
    action: str  # copy | rewrite | drop
    changes: dict[str, Any] = field(default_factory=dict)  # rewrite: top-level key -> new value
    why: str = ""


@dataclass(frozen=True)
class DirectoryRescaleReport:
    path: Path
    output: Path
    layout: str
    plan: RescalePlan  # the main counter (global_step, or accelerate's step)
    changes: tuple[ValueChange, ...]
    files: tuple[FileAction, ...]
    notes: tuple[str, ...]
    batch_size: int | None
    dry_run: bool
    written: bool
    in_place: bool
    resume_from_checkpoint: str | None = None  # Trainer: the path to pass to trainer.train


def counter_plan(key: str, old: int, saved: int, new_world: int, strict: bool) -> RescalePlan:
    if isinstance(old, bool) or not isinstance(old, int) or old < 0:
        raise LayoutError(f"{key!r} holds {old!r}, not a count of steps; nothing was changed")
    plan = RescalePlan(key, old, old * saved // new_world, saved, None, new_world, ())
    if strict and not plan.exact:
        raise InexactRescaleError(
            f"{old} x {saved} = {plan.global_batches} is not a multiple of {new_world}: "
            f"{describe_repeats(plan)}; refused (--strict)"
        )
    return plan


def _ranks(files: dict[str, int], pattern: Any) -> dict[int, str]:
    ranks = {}
    for name in files:
        match = pattern.match(name)
        if match:
            ranks[int(match.group(1))] = name
    return dict(sorted(ranks.items()))


def _saved_world_size(ranks: dict[int, Any], from_world_size: int | None, what: str) -> int:
    if from_world_size is not None:
        return from_world_size
    if ranks and sorted(ranks) == list(range(len(ranks))):
        return len(ranks)
    raise InputError(
        f"cannot tell how many processes wrote the checkpoint ({what}: ranks "
        f"{sorted(ranks) or 'none'}); pass --from-world-size M"
    )


def _top_level(path: Path) -> dict[str, Any]:
    with open_checkpoint(path) as ckpt:
        if not isinstance(ckpt.root, dict):
            raise LayoutError(f"{path}: not a dict; cannot rescale its counters")
        return dict(ckpt.root)


def _counter_changes(
    path: Path, name: str, old_steps: int, new_steps: int, *, expected_last_epoch: int
) -> tuple[dict[str, Any], list[ValueChange]]:
    """``last_epoch`` and ``_step_count`` of a scheduler state dict moved by the same amount."""
    state = _top_level(path)
    last_epoch, step_count = state.get("last_epoch"), state.get("_step_count")
    if not isinstance(last_epoch, int) or not isinstance(step_count, int):
        raise LayoutError(f"{path}: no integer last_epoch/_step_count; not a torch LR scheduler")
    if last_epoch != expected_last_epoch:
        raise LayoutError(
            f"{path}: last_epoch is {last_epoch}, expected {expected_last_epoch} from the step "
            "count; the scheduler is not stepped the way this rescale assumes, so it is refused"
        )
    delta = new_steps - old_steps
    if delta == 0:
        return {}, []
    new = moved_counters(state, delta)
    return new, [ValueChange(name, key, state[key], value) for key, value in new.items()]


def plan_directory(
    path: Path,
    world_size: int,
    *,
    from_world_size: int | None = None,
    strict: bool = False,
) -> tuple[str, RescalePlan, list[FileAction], list[ValueChange], list[str]]:
    """What the rescale of the directory ``path`` does, without writing anything."""
    if is_dcp_directory(path):
        raise LayoutError(
            f"{path}: a torch.distributed.checkpoint directory; rescale-step rewrites one "
            "checkpoint file or a Trainer/accelerate folder (DCP keeps step inside one rank's "
            "data file), so it is not supported"
        )
    files = list_files(str(path))
    if accelerate.detect(str(path)) is not None:
        return _plan_accelerate(path, files, world_size, from_world_size, strict)
    layout = huggingface.detect(str(path))
    if layout is not None and layout.layout == huggingface.HF_TRAINER:
        return _plan_trainer(path, files, world_size, from_world_size, strict)
    what = layout.title if layout is not None else "not a framework checkpoint directory"
    raise LayoutError(
        f"{path}: {what}; rescale-step rewrites a Trainer checkpoint-N/ or an accelerate "
        "save_state folder (or one checkpoint file)"
    )


def _plan_trainer(
    path: Path, files: dict[str, int], world_size: int, from_world_size: int | None, strict: bool
) -> tuple[str, RescalePlan, list[FileAction], list[ValueChange], list[str]]:
    if huggingface.TRAINER_STATE_NAME not in files:
        raise LayoutError(f"{path}: no {huggingface.TRAINER_STATE_NAME}; nothing to rescale")
    state = huggingface.read_json(huggingface.inside(str(path), huggingface.TRAINER_STATE_NAME))
    if not isinstance(state, dict) or "global_step" not in state:
        raise LayoutError(f"{path}: {huggingface.TRAINER_STATE_NAME} has no global_step")
    rng_ranks: dict[int, str] = _ranks(files, huggingface.RNG_STATE_RANK)
    if huggingface.RNG_STATE_NAME in files:
        rng_ranks = {0: huggingface.RNG_STATE_NAME, **rng_ranks}
    saved = _saved_world_size(rng_ranks, from_world_size, "RNG files")
    plan = counter_plan("global_step", state["global_step"], saved, world_size, strict)
    changes: list[ValueChange] = []
    actions: list[FileAction] = []
    notes: list[str] = []
    new_state = dict(state)
    if plan.new_step != plan.old_step:
        new_state["global_step"] = plan.new_step
        changes.append(ValueChange(huggingface.TRAINER_STATE_NAME, "global_step",
                                   plan.old_step, plan.new_step))  # fmt: skip
        epoch = state.get("epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and plan.old_step:
            # epoch = the fraction of the data seen: kept, less what the floor gives back
            new_epoch = epoch * (plan.new_step * world_size) / plan.global_batches
            if new_epoch != epoch:
                new_state["epoch"] = new_epoch
                changes.append(
                    ValueChange(huggingface.TRAINER_STATE_NAME, "epoch", epoch, new_epoch)
                )
    scheduler_changes: dict[str, Any] = {}
    if huggingface.SCHEDULER_NAME in files:
        scheduler_changes, found = _counter_changes(
            path / huggingface.SCHEDULER_NAME, huggingface.SCHEDULER_NAME,
            plan.old_step, plan.new_step, expected_last_epoch=plan.old_step,
        )  # fmt: skip
        changes += found
        if found:
            notes.append(_schedule_note(path, files, saved, world_size))
    rng_names = set(rng_ranks.values())
    for name in files:
        if name in rng_names:
            continue
        if name == huggingface.TRAINER_STATE_NAME and new_state != state:
            actions.append(FileAction(name, name, REWRITE, new_state, "global_step rescaled"))
        elif name == huggingface.SCHEDULER_NAME and scheduler_changes:
            actions.append(FileAction(name, name, REWRITE, scheduler_changes,
                                      "counts optimizer steps, like global_step"))  # fmt: skip
        else:
            actions.append(FileAction(name, name, COPY))
    for rank, source in rng_ranks.items():
        if rank >= world_size:
            actions.append(FileAction(source, source, DROP, why=f"no rank {rank} any more"))
            continue
        name = huggingface.RNG_STATE_NAME if world_size == 1 else f"rng_state_{rank}.pth"
        why = "" if name == source else f"rank {rank}'s state, named as Trainer reads it"
        actions.append(FileAction(name, source, COPY, why=why))
    for rank in range(len(rng_ranks), world_size):
        notes.append(
            f"rank {rank} gets no RNG file: Trainer's _load_rng_state logs that it found none "
            "and keeps the rank's seeded state (a copy of another rank's would repeat its stream)"
        )
    notes.append(
        "log_history, best_global_step and best_model_checkpoint are kept: they record the "
        "saved run under its own step numbers and folder names"
    )
    return huggingface.HF_TRAINER, plan, actions, changes, notes


def _schedule_note(path: Path, files: dict[str, int], saved: int, world_size: int) -> str:
    """What the resumed run must pass for the learning rate to continue the saved schedule.

    Trainer's schedules are functions of ``step / max_steps`` and ``step / warmup_steps``: with
    the step counters multiplied by saved/new, the same schedule needs ``max_steps`` and
    ``warmup_steps`` multiplied by the same factor (``warmup_ratio`` needs nothing). Then the
    rate ``scheduler.pt`` and ``optimizer.pt`` keep from the saved step is exactly the rescaled
    step's, and the first resumed optimizer step runs at the right rate too.
    """
    scaled = []
    if huggingface.TRAINING_ARGS_NAME in files:
        with (
            contextlib.suppress(CkptError),
            open_checkpoint(path / huggingface.TRAINING_ARGS_NAME) as ckpt,
        ):
            root = ckpt.root
            args = root.fields() if hasattr(root, "fields") else root
            for key in ("max_steps", "warmup_steps"):
                value = args.get(key) if isinstance(args, dict) else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    scaled.append(f"{key}={value * saved // world_size} (saved {value})")
    advice = (
        f"resume with {' and '.join(scaled)}" if scaled else
        "resume with max_steps and warmup_steps (if the run sets them) multiplied by "
        f"{saved}/{world_size}"
    )  # fmt: skip
    return (
        "learning rate: scheduler.pt and optimizer.pt keep the saved step's rate, which is the "
        f"rescaled step's rate on the same schedule: {advice}, so that the schedule (a function "
        "of step / max_steps and step / warmup_steps) continues where it stopped"
    )


def _plan_accelerate(
    path: Path, files: dict[str, int], world_size: int, from_world_size: int | None, strict: bool
) -> tuple[str, RescalePlan, list[FileAction], list[ValueChange], list[str]]:
    rng_ranks = _ranks(files, accelerate.RANDOM_STATES)
    saved = _saved_world_size(rng_ranks, from_world_size, "random_states_*.pkl")
    if 0 not in rng_ranks:
        raise LayoutError(f"{path}: no random_states_0.pkl; accelerate's step is not known")
    step = _top_level(path / rng_ranks[0]).get("step")
    plan = counter_plan("step", step if step is not None else -1, saved, world_size, strict)
    changes: list[ValueChange] = []
    actions: list[FileAction] = []
    notes: list[str] = []
    schedulers = [n for n in files if n == "scheduler.bin" or _is_numbered(n, "scheduler_")]
    for name in schedulers:
        state = _top_level(path / name)
        last_epoch = state.get("last_epoch")
        if not isinstance(last_epoch, int) or last_epoch % saved:
            raise LayoutError(
                f"{path / name}: last_epoch {last_epoch!r} is not a multiple of {saved} "
                "processes; accelerate's AcceleratedScheduler steps the scheduler once per "
                "process per optimizer step unless split_batches, which this rescale assumes"
            )
        optimizer_steps = last_epoch // saved
        new_last = optimizer_steps * saved // world_size * world_size
        new, found = _counter_changes(path / name, name, last_epoch, new_last,
                                      expected_last_epoch=last_epoch)  # fmt: skip
        changes += found
        actions.append(FileAction(name, name, REWRITE, new, "num_processes steps per "
                                  "optimizer step") if new else FileAction(name, name, COPY))  # fmt: skip
        if not new:
            notes.append(
                f"{name}: last_epoch {last_epoch} = {optimizer_steps} optimizer steps x {saved} "
                f"processes = {last_epoch // world_size} x {world_size}: unchanged, as "
                "AcceleratedScheduler steps it num_processes times per optimizer step"
            )
    rng_names = set(rng_ranks.values())
    for name in files:
        if name not in rng_names and name not in schedulers:
            actions.append(FileAction(name, name, COPY))
    for rank, source in rng_ranks.items():
        if rank >= world_size:
            actions.append(FileAction(source, source, DROP, why=f"no rank {rank} any more"))
    for rank in range(world_size):
        name = f"random_states_{rank}.pkl"
        source = rng_ranks.get(rank, rng_ranks[0])
        rank_step = _top_level(path / source).get("step")
        new_step = rank_step * saved // world_size if isinstance(rank_step, int) else rank_step
        why = "" if source == name else (
            "a copy of rank 0's: without one, load_state leaves this rank's step at 0"
        )  # fmt: skip
        if new_step != rank_step:
            changes.append(ValueChange(name, "step", rank_step, new_step))
            actions.append(FileAction(name, source, REWRITE, {"step": new_step}, why))
        else:
            actions.append(FileAction(name, source, COPY, why=why))
    if world_size > len(rng_ranks):
        notes.append(
            "new ranks start from rank 0's random states: their random streams repeat rank 0's"
        )
    return accelerate.ACCELERATE, plan, actions, changes, notes


def _is_numbered(name: str, prefix: str) -> bool:
    stem = name[len(prefix) : -len(".bin")] if name.endswith(".bin") else ""
    return name.startswith(prefix) and stem.isdigit()


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

    A DeepSpeed ZeRO save or tag directory is written as DeepSpeed's universal checkpoint
    (:func:`ckpttool.frameworks.deepspeed.universal.rescale_zero`; ``keep_global_batch`` keeps its counters).

    Writes a new directory, ``output`` or ``PATH.ws<N>`` (refused if it exists, unless
    ``overwrite``), or with ``in_place`` replaces ``path``; either way the result is built as a
    temp directory beside it and renamed into place, so a crash leaves the old checkpoint or
    the complete new one. ``dry_run`` plans and checks everything and writes nothing.
    """
    path = Path(path)
    if in_place and output is not None:
        raise InputError("--in-place and -o/--output exclude each other")
    try:
        return _rescale_directory(
            path, world_size, from_world_size=from_world_size, strict=strict, output=output,
            in_place=in_place, overwrite=overwrite, dry_run=dry_run, batch_size=batch_size,
            keep_global_batch=keep_global_batch,
        )  # fmt: skip
    except CkptError as error:
        raise name_file(error, str(path)) from None  # every error says which checkpoint


def _rescale_directory(
    path: Path,
    world_size: int,
    *,
    from_world_size: int | None,
    strict: bool,
    output: str | os.PathLike[str] | None,
    in_place: bool,
    overwrite: bool,
    dry_run: bool,
    batch_size: int | None,
    keep_global_batch: bool,
) -> DirectoryRescaleReport:
    from ckpttool.frameworks.deepspeed.consolidate import is_deepspeed_directory

    if is_deepspeed_directory(path):
        from ckpttool.frameworks.deepspeed.universal import rescale_zero

        if in_place:
            raise InputError(
                f"{path}: a DeepSpeed checkpoint is written as a new universal checkpoint "
                "directory (-o OUT, default PATH.wsN); --in-place does not apply"
            )
        return rescale_zero(
            path, world_size, from_world_size=from_world_size, strict=strict, output=output,
            overwrite=overwrite, dry_run=dry_run, batch_size=batch_size,
            keep_global_batch=keep_global_batch,
        )  # fmt: skip
    if keep_global_batch:
        raise InputError("--keep-global-batch applies to a DeepSpeed ZeRO checkpoint")
    layout, plan, actions, changes, notes = plan_directory(
        path, world_size, from_world_size=from_world_size, strict=strict
    )
    in_run = layout == huggingface.HF_TRAINER and huggingface.CHECKPOINT_DIR.match(path.name)
    if in_place:
        target = path
    elif output is not None:
        target = Path(output)
    elif in_run:
        target = trainer_run_output(path, world_size, plan.new_step)
    else:
        target = Path(f"{path}.ws{world_size}")
    if not in_place:
        if target.resolve() == path.resolve():
            raise InputError(f"{target} is the checkpoint itself; use --in-place to replace it")
        if in_run:
            proposed = trainer_run_output(path, world_size, plan.new_step)
            _check_trainer_output(path, target, proposed)
        if os.path.lexists(target) and not overwrite:
            raise OutputExistsError(f"{target} already exists (pass --force to replace it)")
    resume = None
    if layout == huggingface.HF_TRAINER:
        resume = str(target)
        notes.append(_resume_note(target))
    report = DirectoryRescaleReport(
        path, target, layout, plan, tuple(changes), tuple(actions), tuple(notes), batch_size,
        dry_run, False, in_place, resume,
    )  # fmt: skip
    if dry_run:
        _check_rewrites(path, actions)  # the same refusals as a real run
        return report
    if in_place and not changes and all(a.action == COPY and a.name == a.source for a in actions):
        return report
    _write_directory(path, target, actions, replace_existing=in_place or overwrite)
    return DirectoryRescaleReport(**{**report.__dict__, "written": True})


def trainer_run_output(path: Path, world_size: int, global_step: int) -> Path:
    """Where a Trainer ``OUTPUT_DIR/checkpoint-N`` goes by default:
    ``OUTPUT_DIR.wsM/checkpoint-<new global_step>``, a run directory of its own, where
    ``get_last_checkpoint`` finds it (under the name Trainer itself would have saved it with on M
    processes), and where the saved run's rotation (``save_total_limit``) never looks."""
    run = path.parent
    if run.name in ("", ".", ".."):
        run = Path(os.path.abspath(run))
    return run.with_name(f"{run.name}.ws{world_size}") / f"checkpoint-{global_step}"


def _check_trainer_output(path: Path, target: Path, proposed: Path) -> None:
    """Refuse an output in the saved run's own output_dir under a name that Trainer's rotation
    counts (``checkpoint-*``) but ``get_last_checkpoint`` never resumes from."""
    if not target.parent.is_dir() or not os.path.samefile(path.parent, target.parent):
        return
    name = target.name
    if huggingface.ROTATED_DIR.match(name) and not huggingface.CHECKPOINT_DIR.match(name):
        raise InputError(
            f"{target}: in the run's output_dir, Trainer's rotation (save_total_limit) counts a "
            f"checkpoint-* folder and may delete it, while get_last_checkpoint never resumes from "
            f"one not named checkpoint-<N>; write it to another run directory (the default: "
            f"{proposed})"
        )


def _resume_note(target: Path) -> str:
    note = f'resume with trainer.train(resume_from_checkpoint="{target}")'
    if huggingface.CHECKPOINT_DIR.match(target.name):
        note += (
            f", or with output_dir={str(target.parent)!r} and resume_from_checkpoint=True "
            "(get_last_checkpoint takes the highest checkpoint-<N> there)"
        )
    return note


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
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=parent))
        try:
            for action in actions:
                if action.action != DROP:
                    _write_member(path / action.source, temp / action.name, action)
            fsync_dir(temp)
            move_into_place(temp, target, replace_existing)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
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


def move_into_place(temp: Path, target: Path, replace_existing: bool) -> None:
    """Rename the finished ``temp`` to ``target``; an existing ``target`` is swapped out
    atomically where the kernel can (``renameat2(RENAME_EXCHANGE)``), else moved aside first."""
    parent = temp.parent
    if not os.path.lexists(target):
        os.rename(temp, target)
        fsync_dir(parent)
        return
    if not replace_existing:
        raise OutputExistsError(f"{target} appeared while writing; it was kept")
    if _exchange(temp, target):
        fsync_dir(parent)
        shutil.rmtree(temp)  # now holds the old checkpoint
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", suffix=TMP_SUFFIX, dir=parent))
    os.rmdir(aside)
    os.rename(target, aside)
    try:
        os.rename(temp, target)
    except BaseException:
        os.rename(aside, target)
        raise
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``). False where unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(name, use_errno=True)
        renameat2 = libc.renameat2
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) == 0:
            return True
    return False
