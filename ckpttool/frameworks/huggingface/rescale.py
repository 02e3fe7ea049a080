"""``rescale-step`` of a Trainer ``checkpoint-N/``: ``global_step``, ``epoch``, the scheduler's
counters and the per-rank RNG files, planned file by file (the command writes the directory),
and where the output goes so that Trainer resumes from it.

The rules, from transformers' own source (5.23, ``trainer.py``), assuming the per-device batch
size stays the same (docs/rescale-step.md explains each): ``global_step`` counts optimizer
steps, each of which consumed
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
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, InputError, LayoutError
from ckpttool.frameworks.base import inside, list_files, open_member, read_json
from ckpttool.frameworks.huggingface.files import CHECKPOINT_DIR, HF_TRAINER, ROTATED_DIR
from ckpttool.frameworks.rescale import moved_scheduler, ranks_of, saved_world_size
from ckpttool.frameworks.trainer_files import (
    RNG_STATE_NAME,
    RNG_STATE_RANK,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
)
from ckpttool.model.rescaling import (
    COPY,
    DROP,
    REWRITE,
    DirectoryPlan,
    FileAction,
    RescaleRequest,
    ValueChange,
    counter_plan,
)


def plan_trainer(path: Path, request: RescaleRequest) -> DirectoryPlan:
    """What ``rescale-step`` does to each file of a Trainer ``checkpoint-N/`` (the module
    docstring gives the rules)."""
    files = list_files(str(path))
    world_size, from_world_size, strict = (
        request.world_size,
        request.from_world_size,
        request.strict,
    )
    if TRAINER_STATE_NAME not in files:
        raise LayoutError(f"{path}: no {TRAINER_STATE_NAME}; nothing to rescale")
    state = read_json(inside(str(path), TRAINER_STATE_NAME))
    if not isinstance(state, dict) or "global_step" not in state:
        raise LayoutError(f"{path}: {TRAINER_STATE_NAME} has no global_step")
    rng_ranks: dict[int, str] = ranks_of(files, RNG_STATE_RANK)
    if RNG_STATE_NAME in files:
        rng_ranks = {0: RNG_STATE_NAME, **rng_ranks}
    saved = saved_world_size(rng_ranks, from_world_size, "RNG files")
    plan = counter_plan("global_step", state["global_step"], saved, world_size, strict)
    changes: list[ValueChange] = []
    actions: list[FileAction] = []
    notes: list[str] = []
    new_state = dict(state)
    if plan.new_step != plan.old_step:
        new_state["global_step"] = plan.new_step
        changes.append(ValueChange(TRAINER_STATE_NAME, "global_step",
                                   plan.old_step, plan.new_step))  # fmt: skip
        epoch = state.get("epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and plan.old_step:
            # epoch = the fraction of the data seen: kept, less what the floor gives back
            new_epoch = epoch * (plan.new_step * world_size) / plan.global_batches
            if new_epoch != epoch:
                new_state["epoch"] = new_epoch
                changes.append(ValueChange(TRAINER_STATE_NAME, "epoch", epoch, new_epoch))
    scheduler_changes: dict[str, Any] = {}
    if SCHEDULER_NAME in files:
        scheduler_changes, found = moved_scheduler(
            path / SCHEDULER_NAME, SCHEDULER_NAME,
            plan.old_step, plan.new_step, expected_last_epoch=plan.old_step,
        )  # fmt: skip
        changes += found
        if found:
            notes.append(_schedule_note(path, files, saved, world_size))
    rng_names = set(rng_ranks.values())
    for name in files:
        if name in rng_names:
            continue
        if name == TRAINER_STATE_NAME and new_state != state:
            actions.append(FileAction(name, name, REWRITE, new_state, "global_step rescaled"))
        elif name == SCHEDULER_NAME and scheduler_changes:
            actions.append(FileAction(name, name, REWRITE, scheduler_changes,
                                      "counts optimizer steps, like global_step"))  # fmt: skip
        else:
            actions.append(FileAction(name, name, COPY))
    for rank, source in rng_ranks.items():
        if rank >= world_size:
            actions.append(FileAction(source, source, DROP, why=f"no rank {rank} any more"))
            continue
        name = RNG_STATE_NAME if world_size == 1 else f"rng_state_{rank}.pth"
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
    in_run = CHECKPOINT_DIR.match(path.name) is not None
    return DirectoryPlan(
        HF_TRAINER, plan, actions, changes, notes,
        default_output=trainer_run_output(path, world_size, plan.new_step) if in_run else None,
        check_output=(lambda target: _check_trainer_output(path, target, world_size, plan.new_step))
        if in_run else None,
        resume_note=_resume_note,
    )  # fmt: skip


def _schedule_note(path: Path, files: dict[str, int], saved: int, world_size: int) -> str:
    """What the resumed run must pass for the learning rate to continue the saved schedule.

    Trainer's schedules are functions of ``step / max_steps`` and ``step / warmup_steps``: with
    the step counters multiplied by saved/new, the same schedule needs ``max_steps`` and
    ``warmup_steps`` multiplied by the same factor (``warmup_ratio`` needs nothing). Then the
    rate ``scheduler.pt`` and ``optimizer.pt`` keep from the saved step is exactly the rescaled
    step's, and the first resumed optimizer step runs at the right rate too.
    """
    scaled = []
    if TRAINING_ARGS_NAME in files:
        with (
            contextlib.suppress(CkptError),
            open_member(path / TRAINING_ARGS_NAME) as ckpt,
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


def trainer_run_output(path: Path, world_size: int, global_step: int) -> Path:
    """Where a Trainer ``OUTPUT_DIR/checkpoint-N`` goes by default:
    ``OUTPUT_DIR.wsM/checkpoint-<new global_step>``, a run directory of its own, where
    ``get_last_checkpoint`` finds it (under the name Trainer itself would have saved it with on M
    processes), and where the saved run's rotation (``save_total_limit``) never looks."""
    run = path.parent
    if run.name in ("", ".", ".."):
        run = Path(os.path.abspath(run))
    return run.with_name(f"{run.name}.ws{world_size}") / f"checkpoint-{global_step}"


def _check_trainer_output(path: Path, target: Path, world_size: int, new_step: int) -> None:
    """Refuse an output in the saved run's own output_dir under a name that Trainer's rotation
    counts (``checkpoint-*``) but ``get_last_checkpoint`` never resumes from."""
    if not target.parent.is_dir() or not os.path.samefile(path.parent, target.parent):
        return
    proposed = trainer_run_output(path, world_size, new_step)
    name = target.name
    if ROTATED_DIR.match(name) and not CHECKPOINT_DIR.match(name):
        raise InputError(
            f"{target}: in the run's output_dir, Trainer's rotation (save_total_limit) counts a "
            f"checkpoint-* folder and may delete it, while get_last_checkpoint never resumes from "
            f"one not named checkpoint-<N>; write it to another run directory (the default: "
            f"{proposed})"
        )


def _resume_note(target: Path) -> str:
    note = f'resume with trainer.train(resume_from_checkpoint="{target}")'
    if CHECKPOINT_DIR.match(target.name):
        note += (
            f", or with output_dir={str(target.parent)!r} and resume_from_checkpoint=True "
            "(get_last_checkpoint takes the highest checkpoint-<N> there)"
        )
    return note
