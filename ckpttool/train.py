"""Save and resume a training loop exactly: MiniMind's checkpoint layout, made durable and exact.

MiniMind (``trainer/trainer_utils.py: lm_checkpoint``, ``SkipBatchSampler``) writes two files per
save: ``{weight}_{hidden}[_moe].pth`` (fp16 weights, for inference and the next stage) and
``{weight}_{hidden}[_moe]_resume.pth`` (weights, optimizer, epoch, step, world_size, wandb_id,
scaler). This module keeps those names and that layout, so files move freely between the two, and
fixes what keeps MiniMind's resume from being exact or safe:

* **Lossy weights.** MiniMind stores the resume file's ``model`` as ``v.half()``: a resumed run
  continues from fp16-rounded fp32 weights, so it drifts from the run it replaces. Here the resume
  file keeps the training dtype; only the weights file is fp16.
* **No fsync.** ``torch.save(tmp); os.replace(tmp, path)`` is atomic against a crashed process but
  not against a power loss: the rename can reach the disk before the data does. Both files go
  through :func:`ckpttool.io.atomic.atomic_write` (fsync file, replace, fsync directory).
* **No RNG, no scheduler.** Without the RNG state, dropout masks after a resume differ from those
  of the uninterrupted run; without the scheduler, the LR restarts its warmup. Both are saved.
  RNG states are stored as tensors, ints and tuples, so the file loads with
  ``torch.load(weights_only=True)`` without allow-listing anything: loading never runs code.

``step`` counts the batches already trained in ``epoch`` (MiniMind's dataloader step, not an
optimizer-update count). ``step == batches_per_epoch`` therefore means "epoch finished": resuming
gives ``SkipBatchSampler`` a skip that covers the whole epoch, the first resumed epoch is empty,
and training goes on with the next one, with no special case in the loop.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import logging
import math
import os
import pickle
import random
import re
import shutil
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.utils.data import Sampler

from ckpttool.errors import (
    CheckpointKeyError,
    CkptError,
    CorruptCheckpointError,
    InputError,
    LayoutError,
    UnsafePickleError,
)
from ckpttool.io.atomic import atomic_write, fsync_dir
from ckpttool.model.lr_schedule import rescale_scheduler

logger = logging.getLogger("ckpttool")

#: Keys of the resume dict that ``save_checkpoint`` owns; ``extra_state`` may not use them.
RESERVED_KEYS = frozenset(
    {"model", "optimizer", "epoch", "step", "world_size", "wandb_id", "scaler", "scheduler", "rng"}
)

__all__ = [
    "RESERVED_KEYS",
    "SkipBatchSampler",
    "capture_rng_state",
    "checkpoint_paths",
    "earlier_resume_paths",
    "load_checkpoint",
    "release_staging_buffer",
    "restore_rng_state",
    "resume_training",
    "save_checkpoint",
    "wait_for_save",
]


def checkpoint_paths(
    save_dir: str | Path, weight: str, hidden_size: int, use_moe: bool = False
) -> tuple[Path, Path]:
    """MiniMind's two file names: ``(weights_path, resume_path)``.

    >>> checkpoint_paths("checkpoints", "pretrain", 768, use_moe=True)[1]
    PosixPath('checkpoints/pretrain_768_moe_resume.pth')
    """
    stem = f"{weight}_{hidden_size}{'_moe' if use_moe else ''}"
    save_dir = Path(save_dir)
    return save_dir / f"{stem}.pth", save_dir / f"{stem}_resume.pth"


def earlier_resume_paths(resume_path: str | Path) -> list[Path]:
    """The earlier resume checkpoints ``save_checkpoint(keep_last=N)`` keeps beside
    ``resume_path``, newest first: ``{stem}_resume.{n}.pth``, ``n`` counting up from 1."""
    resume_path = Path(resume_path)
    stem = resume_path.name.removesuffix(".pth")
    found: list[tuple[int, Path]] = []
    for path in resume_path.parent.glob(glob.escape(stem) + ".*.pth"):
        number = path.name[len(stem) + 1 : -len(".pth")]
        if number.isdigit() and path.is_file():
            found.append((int(number), path))
    return [path for _, path in sorted(found, reverse=True)]


def _keep_previous(resume_path: Path) -> None:
    """Give the current resume file a second name, the next ``{stem}_resume.{n}.pth``, before
    it is replaced (a hard link: no copy, and the file stays where MiniMind looks for it)."""
    if not resume_path.is_file():
        return
    earlier = earlier_resume_paths(resume_path)
    if earlier and os.path.samefile(earlier[0], resume_path):
        return  # kept already (a save that stopped before replacing it)
    number = int(earlier[0].name.removesuffix(".pth").rsplit(".", 1)[1]) + 1 if earlier else 1
    kept = resume_path.with_name(f"{resume_path.name.removesuffix('.pth')}.{number}.pth")
    try:
        os.link(resume_path, kept)
    except OSError:  # a filesystem without hard links: a durable copy
        with atomic_write(kept) as handle, resume_path.open("rb") as source:
            shutil.copyfileobj(source, handle, 1 << 24)
    fsync_dir(resume_path.parent)


def _drop_earlier(resume_path: Path, keep: int) -> None:
    """Delete the earlier resume files but the newest ``keep`` (after the new one is durable)."""
    dropped = earlier_resume_paths(resume_path)[keep:]
    for path in dropped:
        path.unlink()
    if dropped:
        fsync_dir(resume_path.parent)


def _unwrap(obj: Any) -> Any:
    """The module a DDP / DataParallel / ``torch.compile`` wrapper holds, in any nesting order."""
    while True:
        if isinstance(obj, DistributedDataParallel | DataParallel):
            obj = obj.module
        elif isinstance(getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod
        else:
            return obj


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _current_world_size() -> int:
    """The torch.distributed world size when a process group is up, else 1."""
    return dist.get_world_size() if _distributed() else 1


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (global), torch CPU and every CUDA device's RNG state, as safe-to-load types.

    NumPy's ``get_state()`` tuple holds an ndarray, which ``weights_only`` loading refuses; its
    MT19937 key is stored as an int64 tensor instead, beside the plain-int/float rest.
    """
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(name),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Undo :func:`capture_rng_state`; CUDA states only for devices this process has."""
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        saved = state["numpy"]
        key = np.asarray(torch.as_tensor(saved["key"]).cpu().numpy(), dtype=np.uint32)
        rest = (saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        np.random.set_state((saved["bit_generator"], key, *rest))
    if "torch" in state:
        # map_location="cuda" moves every tensor of the file, RNG states included.
        torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        device_count = torch.cuda.device_count()
        for device, device_state in enumerate(cuda_states[:device_count]):
            torch.cuda.set_rng_state(device_state.cpu(), device)
        if len(cuda_states) > device_count:
            logger.info(
                "checkpoint has RNG states for %d CUDA devices, this process sees %d; "
                "the extra ones are ignored",
                len(cuda_states),
                device_count,
            )


def _cpu_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``{k: v.detach().cpu()}`` for the tensors, the rest as is."""
    return {
        key: value.detach().cpu() if isinstance(value, torch.Tensor) else value
        for key, value in state_dict.items()
    }


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    save_dir: str | Path,
    weight: str,
    hidden_size: int,
    use_moe: bool = False,
    epoch: int,
    step: int,
    scaler: Any | None = None,
    scheduler: Any | None = None,
    extra_state: Mapping[str, Any] | None = None,
    wandb_id: str | None = None,
    weights_dtype: torch.dtype | None = torch.float16,
    keep_last: int = 1,
    async_save: bool = False,
) -> tuple[Path | None, Path]:
    """Write the weights file and the resume file atomically; return ``(weights_path, resume_path)``.

    The weights file is ``{name: tensor.half().cpu()}`` as in MiniMind, except that only
    floating-point tensors are halved (halving an int or bool buffer would corrupt it).
    ``weights_dtype`` chooses its floating dtype (``torch.bfloat16``, ``torch.float32``...); with
    ``None`` no weights file is written and ``weights_path`` comes back ``None``. Values beyond
    that dtype's range become inf in the weights file: a WARNING on ``"ckpttool"`` names every such
    tensor, with its count and largest value (the resume file keeps them exactly). The resume
    file is a dict, in this key order: ``model`` (training dtype, CPU), ``optimizer``, ``epoch``,
    ``step`` (batches trained in ``epoch``), ``world_size``, ``wandb_id``, ``scaler`` and
    ``scheduler`` (their state dicts, when given), ``rng`` (:func:`capture_rng_state`), then the
    ``extra_state`` items: a value with ``state_dict()`` is stored as its state dict (DDP and
    ``torch.compile`` wrappers unwrapped), anything else as is.

    ``keep_last=N`` keeps the newest ``N`` resume checkpoints (default 1: MiniMind's one file,
    replaced by each save). The newest is always ``{stem}_resume.pth``; before it is replaced, it
    gets a second name, ``{stem}_resume.{n}.pth`` (``n`` counting up, a hard link: nothing is
    copied), and the earlier ones beyond ``N - 1`` are deleted only once the new resume file is
    durable. :func:`load_checkpoint` falls back to them when the newest is damaged. The weights
    file is the newest's only.

    ``async_save=True`` copies the state (every tensor, storages shared as they are; CPU ones
    into a staging buffer reused by every asynchronous save, others on their device) on the
    caller's thread, so training may change the model and optimizer as soon as it returns, then writes and fsyncs the files on a background thread: the same bytes as a
    synchronous save. The next ``save_checkpoint``, ``load_checkpoint`` or
    :func:`wait_for_save` blocks until they are durable and raises what went wrong in the
    background, if anything.

    Under torch.distributed only rank 0 writes; every rank then waits at ``dist.barrier()`` so no
    rank returns before the files are complete. With ``async_save=True`` every rank returns once
    rank 0 has taken its copy, and every rank's next ``save_checkpoint``, ``load_checkpoint`` or
    :func:`wait_for_save` (call it on every rank: it is collective) waits until rank 0's files
    are durable; where rank 0's background write failed, rank 0 raises its error there and the
    other ranks :class:`CorruptCheckpointError`. ``model`` may be wrapped in DDP and/or
    ``torch.compile``. Raises :class:`CheckpointKeyError` when ``extra_state`` uses a reserved key.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise InputError(
            f"keep_last must be a whole number of checkpoints, 1 or more: {keep_last!r}"
        )
    extra_state = dict(extra_state or {})
    collisions = sorted(RESERVED_KEYS.intersection(extra_state))
    if collisions:
        raise CheckpointKeyError(
            f"extra_state key {collisions[0]!r} collides with a key save_checkpoint writes itself "
            f"(reserved: {', '.join(sorted(RESERVED_KEYS))}); rename it"
        )
    weights_path, resume_path = checkpoint_paths(save_dir, weight, hidden_size, use_moe)
    wait_for_save()  # the previous async save durable first (and its error raised here)
    written = False
    try:
        if not _distributed() or dist.get_rank() == 0:
            weights_path.parent.mkdir(parents=True, exist_ok=True)
            cpu_model = _cpu_state_dict(_unwrap(model).state_dict())
            resume_data: dict[str, Any] = {
                "model": cpu_model,
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "step": step,
                "world_size": _current_world_size(),
                "wandb_id": wandb_id,
            }
            if scaler is not None:
                resume_data["scaler"] = scaler.state_dict()
            if scheduler is not None:
                resume_data["scheduler"] = scheduler.state_dict()
            resume_data["rng"] = capture_rng_state()
            for key, value in extra_state.items():
                raw = _unwrap(value)
                resume_data[key] = raw.state_dict() if hasattr(raw, "state_dict") else value
            write = _Write(weights_path, resume_path, resume_data, weights_dtype, keep_last)
            if async_save:  # training may change the state as soon as this returns
                write.resume_data = _Snapshot(_staging).copy(resume_data)
                _start(write)
            else:
                write.run()
        written = True
    finally:
        # Also when rank 0's write fails: the other ranks must not hang, and must not carry on
        # as if the files were there.
        if _distributed():
            _agree_on_write(written)  # rank 0 took its copy (async) or wrote its files
            if async_save and written:
                _agree_later()  # on durability, at the next collective wait_for_save
    return (weights_path if weights_dtype is not None else None), resume_path


class _Write:
    """One save's files, written in order: the weights file, then the resume file (keeping the
    previous one first when ``keep_last > 1``, deleting the earlier ones after)."""

    def __init__(
        self,
        weights_path: Path,
        resume_path: Path,
        resume_data: dict[str, Any],
        weights_dtype: torch.dtype | None,
        keep_last: int,
    ) -> None:
        self.weights_path = weights_path
        self.resume_path = resume_path
        self.resume_data = resume_data
        self.weights_dtype = weights_dtype
        self.keep_last = keep_last
        self.error: BaseException | None = None

    def run(self) -> None:
        if self.weights_dtype is not None:
            weights = _weights_state_dict(
                self.resume_data["model"], self.weights_dtype, self.weights_path
            )
            with atomic_write(self.weights_path) as handle:
                torch.save(weights, handle)
            del weights
        if self.keep_last > 1:
            _keep_previous(self.resume_path)
        with atomic_write(self.resume_path) as handle:
            torch.save(self.resume_data, handle)
        _drop_earlier(self.resume_path, self.keep_last - 1)

    def run_catching(self) -> None:
        try:
            self.run()
        except BaseException as error:  # raised on the caller's thread by wait_for_save
            self.error = error
        finally:
            self.resume_data = {}  # the copies go as soon as they are on disk


_pending: tuple[threading.Thread, _Write] | None = None
# Under torch.distributed, an asynchronous save whose durability the ranks have not agreed on
# yet: every rank's next wait_for_save waits for rank 0's write and learns how it ended.
_unagreed = False


def _agree_later() -> None:
    global _unagreed
    _unagreed = True


def _start(write: _Write) -> None:
    global _pending
    # not a daemon: an interpreter that exits waits for the files to be durable
    thread = threading.Thread(
        target=write.run_catching, name=f"ckpttool save {write.resume_path.name}"
    )
    _pending = thread, write
    thread.start()


def wait_for_save() -> None:
    """Block until the last ``save_checkpoint(..., async_save=True)`` has written its files and
    made them durable; raise what went wrong in it, if anything (once). Returns at once when no
    save is under way. ``save_checkpoint`` and ``load_checkpoint`` call it first.

    Under torch.distributed, after an asynchronous save, it is collective: every rank calls it
    (``save_checkpoint`` and ``load_checkpoint`` do, on every rank), and every rank returns once
    rank 0's files are durable; where rank 0's write failed, rank 0 raises its error and the
    others :class:`CorruptCheckpointError`."""
    global _pending, _unagreed
    pending, _pending = _pending, None
    unagreed, _unagreed = _unagreed, False
    error = None
    if pending is not None:  # rank 0's (or a single process's) write
        thread, write = pending
        thread.join()
        error, write.error = write.error, None
    if unagreed and _distributed():
        _agree_on_write(error is None)  # the other ranks raise here if rank 0's write failed
    if error is not None:
        raise error


STAGING_ALIGN = 64  # bytes: where each storage starts in the staging buffer


class _StagingBuffer:
    """The CPU memory asynchronous saves copy the state's CPU storages into: allocated at the
    first asynchronous save, sized to its state (grown, never shrunk, when a later state is
    larger), and reused by every later one, so that a copy writes into pages faulted in once
    (fresh memory for each save cost half of the time the loop was blocked). Plain memory:
    only CPU storages are staged (a storage on a device is copied on its device, so that the
    file records the device as a synchronous save's does), and page-locking helps only
    copies from a device. A save reuses it only after the previous save is durable
    (``save_checkpoint`` waits for that first). It is held until the process ends;
    :func:`release_staging_buffer` frees it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.memory: memoryview | None = None

    def reserve(self, nbytes: int) -> None:
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return
        self.release()  # (the smaller one first: never both at once)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.memory = self.buffer.numpy().data

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage of its own (as ``torch.save`` sees it) over ``nbytes`` of the buffer."""
        assert self.memory is not None
        view = torch.frombuffer(self.memory[offset : offset + nbytes], dtype=torch.uint8)
        return view.untyped_storage()

    def release(self) -> None:
        self.buffer = self.memory = None


_staging = _StagingBuffer()


def release_staging_buffer() -> None:
    """Free the memory asynchronous saves stage the state in (the next one allocates it
    again), after waiting for the save under way."""
    wait_for_save()
    _staging.release()


def _staged(tensor: torch.Tensor) -> bool:
    """Whether a tensor's storage goes to the staging buffer: a plain CPU tensor's, not empty."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.untyped_storage().nbytes() > 0  # (an empty one has no address of its own)
    )


class _Snapshot:
    """A copy of a save's state: every tensor copied, the copies sharing storages as the
    originals do, and every dict and list rebuilt (of its type, attributes kept: a state dict's
    ``_metadata``), so that ``torch.save`` of the copy writes the original's bytes. CPU
    storages are copied into the staging buffer, one after the other; others are cloned on
    their device."""

    def __init__(self, staging: _StagingBuffer) -> None:
        self.staging = staging
        self.memo: dict[Any, Any] = {}
        self.offset = 0

    def copy(self, value: Any) -> Any:
        sizes: dict[tuple[int, int], int] = {}
        for tensor in _tensors(value):
            if _staged(tensor):
                storage = tensor.untyped_storage()
                sizes[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        if sizes:
            self.staging.reserve(sum(_aligned(n) for n in sizes.values()))
        return self._copy(value)

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, dict):
            rebuilt = copy.copy(value)
            for key, item in value.items():
                rebuilt[key] = self._copy(item)
            return rebuilt
        if type(value) in (list, tuple):
            return type(value)(self._copy(item) for item in value)
        return value

    def _tensor(self, value: torch.Tensor) -> torch.Tensor:
        memo = self.memo
        known = memo.get(id(value))
        if known is not None:
            return known
        tensor = value.detach()
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            copied = tensor.clone()
        else:
            storage = tensor.untyped_storage()
            key = (storage.device, storage.data_ptr(), storage.nbytes())
            clone = memo.get(key)
            if clone is None:
                if _staged(tensor):
                    clone = self.staging.storage(self.offset, storage.nbytes())
                    clone.copy_(storage)
                    self.offset += _aligned(storage.nbytes())
                else:
                    clone = storage.clone()
                memo[key] = clone
            copied = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
            copied.set_(clone, tensor.storage_offset(), tensor.size(), tensor.stride())
        if isinstance(value, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
        memo[id(value)] = copied
        return copied


def _aligned(nbytes: int) -> int:
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a state's dicts, lists and tuples (what :class:`_Snapshot` copies)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif type(value) in (list, tuple):
        for item in value:
            yield from _tensors(item)


def _weights_state_dict(
    cpu_model: Mapping[str, Any], dtype: torch.dtype, weights_path: Path
) -> dict[str, Any]:
    """The weights file's dict: floating tensors cast to ``dtype``, overflows reported by
    ``convert``'s own check (:func:`ckpttool.model.cast.count_overflow`)."""
    weights: dict[str, Any] = {}
    overflowed: list[str] = []
    for key, value in cpu_model.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            weights[key] = value
            continue
        weights[key] = narrowed = value.to(dtype)
        lost, largest = _overflow(value, narrowed)
        if lost:
            overflowed.append(f"{key} ({lost:,} value(s), max |x| = {largest:.6g})")
    if overflowed:
        target = str(dtype).removeprefix("torch.")
        logger.warning(
            "%s: %d tensor(s) hold values beyond %s's range, written as inf in the weights file "
            "(the resume file keeps them exactly): %s; pass weights_dtype=torch.bfloat16 (or "
            "torch.float32) to save_checkpoint",
            weights_path,
            len(overflowed),
            target,
            "; ".join(overflowed),
        )
    return weights


def _overflow(value: torch.Tensor, narrowed: torch.Tensor) -> tuple[int, float]:
    from ckpttool.model.cast import CASTABLE, count_overflow

    source = str(value.dtype).removeprefix("torch.")
    target = str(narrowed.dtype).removeprefix("torch.")
    if source not in CASTABLE or target not in CASTABLE or not value.numel():
        return 0, 0.0
    return count_overflow(_stored(value), source, _stored(narrowed), target)


def _stored(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as NumPy holds them for :mod:`ckpttool.model.cast` (bf16: the bits)."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def _agree_on_write(written: bool) -> None:
    """Wait for rank 0's write; every other rank raises if it failed (rank 0 raises its own)."""
    dist.barrier()
    outcome = [written]
    dist.broadcast_object_list(outcome, src=0)
    if not outcome[0] and dist.get_rank() != 0:
        raise CorruptCheckpointError(
            "rank 0 failed to write the checkpoint (its own error says why); "
            "the files on disk are the previous ones"
        )


def load_checkpoint(
    save_dir: str | Path,
    weight: str,
    hidden_size: int,
    use_moe: bool = False,
    map_location: str | torch.device = "cpu",
    *,
    fallback: bool = True,
) -> dict[str, Any] | None:
    """Load the newest resume checkpoint that verifies, or return ``None`` when there is none.

    The resume file is checked before it is used: ``torch.load(weights_only=True)`` reads it,
    ckpttool's reader checks its structure and the CRC-32 of every record (``ckpttool verify``'s
    checks), and it must hold the parts :func:`resume_training` restores (``model``,
    ``optimizer``, ``epoch``). When it does not pass (a save cut short, a torn or damaged file),
    the earlier resume checkpoints that ``save_checkpoint(keep_last=N)`` kept are tried, newest
    first, and the first that passes is loaded, with a WARNING on ``"ckpttool"`` naming what
    was wrong with each newer one. ``fallback=False`` refuses instead: the newest's problem is
    raised (:class:`CorruptCheckpointError`, :class:`LayoutError`). When none passes, the
    newest's problem is raised; a newest file that reads and verifies but lacks a part is then
    returned as it is (:func:`resume_training` says what is missing).

    Loads with ``torch.load(weights_only=True)``: a file naming any class beyond tensors and plain
    containers is refused with :class:`UnsafePickleError`, never loaded unsafely (and never
    skipped for an earlier one). When the saved
    ``world_size`` (1 if absent, as in old MiniMind files) differs from the current one, ``step``
    is rescaled to ``step * saved // current`` (MiniMind's rule: the same number of samples seen)
    and ``world_size`` set to the current one; a saved LR scheduler, which counts optimizer
    steps, moves by the same factor (``rescale-step``'s rule,
    :func:`ckpttool.model.lr_schedule.rescale_scheduler`). The change is logged at INFO on
    ``"ckpttool"``; at WARNING when the division is not exact (some batches will be trained
    twice) or when the scheduler's state cannot be moved (it is then left as it was).
    """
    wait_for_save()  # an async save under way: its files first
    _, resume_path = checkpoint_paths(save_dir, weight, hidden_size, use_moe)
    candidates = [resume_path] if resume_path.is_file() else []
    for earlier in earlier_resume_paths(resume_path):
        if not any(os.path.samefile(earlier, seen) for seen in candidates):
            candidates.append(earlier)  # (a save stopped between keeping and replacing)
    if not candidates:
        return None
    if candidates[0] != resume_path:  # gone, but earlier ones were kept
        if not fallback:
            raise CorruptCheckpointError(
                f"{resume_path} is missing (earlier resume checkpoints are there: "
                f"{candidates[0].name}...); not loaded, as fallback=False asks"
            )
        skipped = [f"{resume_path} is missing"]
    else:
        skipped = []
    ckpt = _newest_good(candidates, map_location, fallback, skipped)
    saved_world_size = ckpt.get("world_size", 1)
    current_world_size = _current_world_size()
    if saved_world_size != current_world_size:
        saved_step = ckpt.get("step", 0)
        ckpt["step"] = saved_step * saved_world_size // current_world_size
        ckpt["world_size"] = current_world_size
        logger.info(
            "world_size changed %d -> %d: step %d -> %d",
            saved_world_size,
            current_world_size,
            saved_step,
            ckpt["step"],
        )
        _rescale_scheduler(ckpt, saved_world_size, current_world_size)
        repeated = saved_step * saved_world_size - ckpt["step"] * current_world_size
        if repeated:
            logger.warning(
                "step %d x world_size %d = %d global batches is not a multiple of %d: the "
                "resumed run trains %d of the saved run's global batches a second time",
                saved_step,
                saved_world_size,
                saved_step * saved_world_size,
                current_world_size,
                repeated,
            )
    return ckpt


#: What :func:`resume_training` restores, so what a resume checkpoint must hold to be used.
RESUME_PARTS = ("model", "optimizer", "epoch")


def _newest_good(
    candidates: list[Path], map_location: str | torch.device, fallback: bool, skipped: list[str]
) -> dict[str, Any]:
    """The first of ``candidates`` (newest first) that loads, verifies and has every part;
    ``skipped`` (what was wrong with each newer one) grows as they are tried."""
    newest_incomplete: tuple[Path, dict[str, Any]] | None = None
    first_error: CkptError | None = None
    known = len(skipped)  # what was wrong before any file was tried (the resume file missing)
    for index, path in enumerate(candidates):
        try:
            ckpt = _load_verified(path, map_location)
        except UnsafePickleError:
            raise  # not damage: a refusal the caller must see
        except (CorruptCheckpointError, LayoutError) as error:
            if index == 0 and not fallback:
                raise
            first_error = first_error or error
            skipped.append(str(error))
            continue
        missing = [key for key in RESUME_PARTS if key not in ckpt]
        if missing:
            if index == 0 and not fallback:
                return ckpt
            if index == 0:
                newest_incomplete = path, ckpt
            skipped.append(
                f"{path} has no {', '.join(map(repr, missing))} (what resume_training restores)"
            )
            continue
        _warn_skipped(path, ckpt, skipped)
        return ckpt
    if newest_incomplete is not None:  # nothing better: as it is (resume_training says why)
        path, ckpt = newest_incomplete
        _warn_skipped(path, ckpt, skipped[:known])
        return ckpt
    assert first_error is not None
    raise first_error


def _warn_skipped(path: Path, ckpt: Mapping[str, Any], skipped: list[str]) -> None:
    if skipped:
        logger.warning(
            "resuming from %s (epoch %s, step %s), the newest resume checkpoint that verifies; "
            "skipped: %s",
            path,
            ckpt.get("epoch"),
            ckpt.get("step"),
            "; ".join(skipped),
        )


def _load_verified(path: Path, map_location: str | torch.device) -> dict[str, Any]:
    """``path`` loaded weights-only, once its structure and every record's CRC-32 check out."""
    ckpt = _load_weights_only(path, map_location)
    if not isinstance(ckpt, dict):
        raise LayoutError(
            f"{path} holds a {type(ckpt).__name__}, not a resume dict; "
            f"see its layout with `ckpttool show {path}`"
        )
    problems = _verify_problems(path)
    if problems:
        raise CorruptCheckpointError(
            f"{path} fails verification ({'; '.join(problems)}); it was not used. Inspect it "
            f"with `ckpttool verify {path}`"
        )
    return ckpt


def _verify_problems(path: Path) -> list[str]:
    """What ``ckpttool verify`` finds wrong with the file (its structure, every record's CRC)."""
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.formats.registry import find_format

    try:
        with open_checkpoint(path, strict=False, refuse_dangerous=False) as opened:
            problems = list(opened.problems)
            fmt = find_format(opened.format)
            if fmt is not None:
                problems.extend(fmt.verify(opened, None)[0])
    except CkptError as error:
        problems = [str(error).removeprefix(f"{path}: ")]
    return problems


def _rescale_scheduler(ckpt: dict[str, Any], saved_world_size: int, world_size: int) -> None:
    """Move the saved LR scheduler with ``step`` (``rescale-step``'s rule, in memory)."""
    if ckpt.get("scheduler") is None:
        return
    moved = rescale_scheduler(ckpt["scheduler"], saved_world_size, world_size)
    if moved.state is not None:
        ckpt["scheduler"] = moved.state
        logger.info(
            "world_size changed %d -> %d: scheduler %s (it counts optimizer steps, scaled "
            "like step)",
            saved_world_size,
            world_size,
            ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in moved.changes),
        )
    elif moved.note:
        logger.warning(
            "world_size changed %d -> %d: scheduler not moved: %s",
            saved_world_size,
            world_size,
            moved.note,
        )


def _load_weights_only(path: Path, map_location: str | torch.device) -> Any:
    # argparse.Namespace only sets attributes: plain data, as ckpttool's reader and `scan` treat
    # it. Training scripts save their args in the resume file (MiniMind's trainers do).
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    try:
        with allow([argparse.Namespace]) if allow is not None else contextlib.nullcontext():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        message = str(error)
        # torch >= 2.4 says "GLOBAL mod.Name was not an allowed global", older "Unsupported class".
        unsupported = re.search(r"(?:GLOBAL|Unsupported class) ([\w.]+)", message)
        if unsupported:
            raise UnsafePickleError(
                f"{path} names {unsupported.group(1)}, which a weights-only load refuses; "
                f"it was not loaded. Inspect it with `ckpttool scan {path}`; if you trust it, "
                f"allow the class with torch.serialization.add_safe_globals, or re-save the "
                f"file with only tensors and plain containers"
            ) from None
        reason = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", message, re.DOTALL)
        raise CorruptCheckpointError(
            f"{path} is not a readable checkpoint ({reason.group(1) if reason else 'bad pickle'});"
            f" it was not loaded. Inspect it with `ckpttool show {path}`"
        ) from None
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        # OSError: torch's zip reader on a file cut short ("[Errno 22] Invalid argument").
        # torch's messages go on with advice for torch.load's callers: keep the first sentence.
        summary = str(error).strip().split(". ")[0].split("\n")[0] or type(error).__name__
        raise CorruptCheckpointError(
            f"{path} is truncated or corrupt ({summary}); inspect it with `ckpttool show {path}`"
        ) from None


def resume_training(
    ckpt: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: Any | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
) -> tuple[int, int]:
    """Restore a loop's state from :func:`load_checkpoint`'s dict; return ``(start_epoch, start_step)``.

    Restores the model (fp16 weights of MiniMind files are cast to the model's dtype by
    ``load_state_dict``, which copies), the optimizer, then the scaler and scheduler when both the
    checkpoint and the caller have one, then the RNG state when ``restore_rng``. Call it after
    building model, optimizer, scaler and scheduler and after any seeding, right before the loop.

    Whatever it cannot restore exactly is logged once as a WARNING on ``"ckpttool"``: model
    tensors stored in another dtype than the model's (one line per pair of dtypes), a scaler or
    scheduler passed without state in the file (or state in the file with none passed), an
    empty scaler state, and no RNG state (or a part of it missing) when ``restore_rng``.

    Under DDP the file holds rank 0's RNG state; restoring it on every rank gives all ranks the
    same dropout stream, so pass ``restore_rng=(rank == 0)`` there if that matters.
    """
    missing = [key for key in ("model", "optimizer", "epoch") if key not in ckpt]
    if missing == ["optimizer"]:
        raise LayoutError(
            "not a resume checkpoint: no 'optimizer' key: it was made for inference (its "
            "training state dropped, as `ckpttool edit --for-inference` does); resume from a "
            "full resume checkpoint, or load only its 'model'"
        )
    if missing:
        raise LayoutError(
            f"not a resume checkpoint: no {', '.join(map(repr, missing))} key "
            f"(keys: {', '.join(map(str, ckpt))})"
        )
    live_model = _unwrap(model)
    _warn_about_casts(ckpt["model"], live_model.state_dict())
    live_model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    for key, target in (("scaler", scaler), ("scheduler", scheduler)):
        _restore_optional(ckpt, key, target)
    if restore_rng:
        _restore_rng(ckpt.get("rng"))
    return int(ckpt["epoch"]), int(ckpt.get("step", 0))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _warn_about_casts(saved: Any, live: Mapping[str, Any]) -> None:
    """One warning per (file dtype, model dtype) pair that ``load_state_dict`` will cast."""
    if not isinstance(saved, Mapping):
        return  # load_state_dict says what is wrong with it
    casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
    for key, value in saved.items():
        target = live.get(key)
        if (
            isinstance(value, torch.Tensor)
            and isinstance(target, torch.Tensor)
            and value.dtype != target.dtype
        ):
            casts[value.dtype, target.dtype] += 1
    for (stored, held), count in casts.items():
        hint = (
            " (MiniMind's resume files store the model in float16; "
            "ckpttool.save_checkpoint keeps the training dtype)"
            if stored == torch.float16
            else ""
        )
        logger.warning(
            "model tensors stored as %s are loaded into %s (%d tensor%s): load_state_dict "
            "casts them, so the resume is exact only where the saved run's values fit both "
            "dtypes exactly%s",
            _dtype_name(stored),
            _dtype_name(held),
            count,
            "s" if count != 1 else "",
            hint,
        )


def _restore_rng(state: Any) -> None:
    """Restore the RNG state, warning about every generator the file has no state for."""
    if not isinstance(state, Mapping):
        logger.warning(
            "checkpoint has no RNG state (MiniMind's files do not save one): random draws "
            "after the resume (dropout masks...) differ from the uninterrupted run's"
        )
        return
    missing = [name for name in ("python", "numpy", "torch") if name not in state]
    if torch.cuda.is_available() and not state.get("cuda"):
        missing.append("cuda")
    if missing:
        logger.warning(
            "checkpoint's RNG state has no %s state: those generators go on from this "
            "process's seed, not from the saved run's state",
            ", ".join(missing),
        )
    restore_rng_state(state)


def _restore_optional(ckpt: Mapping[str, Any], key: str, target: Any | None) -> None:
    if target is None:
        if key in ckpt:
            logger.warning("checkpoint has %s state but no %s was passed; not restored", key, key)
        return
    if key not in ckpt:
        logger.warning("checkpoint has no %s state; the %s passed starts fresh", key, key)
        return
    state = ckpt[key]
    is_enabled = getattr(target, "is_enabled", None)
    if not state and callable(is_enabled) and is_enabled():
        # A disabled GradScaler (MiniMind with bf16) saves {}; an enabled one cannot load that.
        logger.warning("checkpoint's %s state is empty (saved disabled); %s starts fresh", key, key)
        return
    target.load_state_dict(state)


class _SizedIndices(Protocol):
    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...


class SkipBatchSampler(Sampler[list[int]]):
    """Batch ``sampler``'s indices and drop the first ``skip_batches`` full batches (MiniMind's).

    The trailing partial batch is yielded only when all ``skip_batches`` were skipped, so a skip
    covering the whole epoch yields nothing. Only indices are iterated; the dataset is never read.

    >>> list(SkipBatchSampler(range(10), 3, skip_batches=2))
    [[6, 7, 8], [9]]
    """

    def __init__(self, sampler: _SizedIndices, batch_size: int, skip_batches: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        skipped = 0
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                if skipped < self.skip_batches:
                    skipped += 1
                else:
                    yield batch
                batch = []
        if batch and skipped >= self.skip_batches:
            yield batch

    def __len__(self) -> int:
        # A partial batch is yielded iff skip <= full batches, which this formula also counts.
        return max(0, math.ceil(len(self.sampler) / self.batch_size) - self.skip_batches)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped sampler (e.g. ``DistributedSampler``) when it has ``set_epoch``."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
