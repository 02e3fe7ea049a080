"""Unit tests of ckpttool.train: paths, SkipBatchSampler, atomic saves, the resume layout, loading
(world-size rescale, MiniMind files, unsafe files) and resuming."""

from __future__ import annotations

import argparse
import io
import logging
import math
import os
import pickle
import random
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

import ckpttool.train
from ckpttool import (
    SkipBatchSampler,
    capture_rng_state,
    checkpoint_paths,
    load_checkpoint,
    restore_rng_state,
    resume_training,
    save_checkpoint,
)
from ckpttool.errors import (
    CheckpointKeyError,
    CorruptCheckpointError,
    LayoutError,
    UnsafePickleError,
)
from ckpttool.io.atomic import temp_name_pattern
from tests.support.timeouts import scaled

# --- checkpoint_paths ------------------------------------------------------------------------


@pytest.mark.parametrize("as_path", [False, True])
@pytest.mark.parametrize(
    ("use_moe", "weights_name", "resume_name"),
    [
        (False, "pretrain_768.pth", "pretrain_768_resume.pth"),
        (True, "pretrain_768_moe.pth", "pretrain_768_moe_resume.pth"),
    ],
)
def test_checkpoint_paths(
    tmp_path: Path, as_path: bool, use_moe: bool, weights_name: str, resume_name: str
) -> None:
    save_dir = tmp_path / "ckpts"
    paths = checkpoint_paths(save_dir if as_path else str(save_dir), "pretrain", 768, use_moe)
    assert paths == (save_dir / weights_name, save_dir / resume_name)
    assert all(isinstance(path, Path) for path in paths)


# --- SkipBatchSampler ------------------------------------------------------------------------


def minimind_skip_batches(sampler: Iterable[int], batch_size: int, skip_batches: int) -> Iterator:
    """MiniMind's SkipBatchSampler.__iter__ (trainer/trainer_utils.py), verbatim."""
    batch = []
    skipped = 0
    for idx in sampler:
        batch.append(idx)
        if len(batch) == batch_size:
            if skipped < skip_batches:
                skipped += 1
                batch = []
                continue
            yield batch
            batch = []
    if len(batch) > 0 and skipped >= skip_batches:
        yield batch


def test_skip_batch_sampler_minimind_example() -> None:
    assert list(SkipBatchSampler(range(10), 3, 2)) == [[6, 7, 8], [9]]


@pytest.mark.parametrize(
    ("size", "batch_size", "skip", "expected"),
    [
        (10, 3, 0, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]),
        (10, 3, 3, [[9]]),  # all full batches skipped: the partial one is still due
        (10, 3, 4, []),  # the skip covers the epoch (step == iters at an epoch boundary)
        (10, 3, 9, []),
        (9, 3, 1, [[3, 4, 5], [6, 7, 8]]),  # exact multiple
        (9, 3, 3, []),
        (0, 3, 0, []),
        (0, 3, 2, []),
        (3, 1, 1, [[1], [2]]),
        (3, 1, 3, []),
    ],
)
def test_skip_batch_sampler_cases(
    size: int, batch_size: int, skip: int, expected: list[list[int]]
) -> None:
    sampler = SkipBatchSampler(range(size), batch_size, skip)
    assert list(sampler) == expected
    assert len(sampler) == len(expected)


@given(size=st.integers(0, 40), batch_size=st.integers(1, 12), skip=st.integers(0, 15))
def test_skip_batch_sampler_matches_minimind(size: int, batch_size: int, skip: int) -> None:
    sampler = SkipBatchSampler(range(size), batch_size, skip)
    expected = list(minimind_skip_batches(range(size), batch_size, skip))
    assert list(sampler) == expected
    assert len(sampler) == len(expected)
    # Skipping k batches yields exactly the tail of the unskipped batches.
    unskipped = list(SkipBatchSampler(range(size), batch_size))
    assert expected == unskipped[skip:]
    assert len(unskipped) == math.ceil(size / batch_size)


@pytest.mark.parametrize(("batch_size", "skip"), [(0, 0), (-1, 0), (2, -1)])
def test_skip_batch_sampler_rejects_bad_arguments(batch_size: int, skip: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        SkipBatchSampler(range(4), batch_size, skip)


class CountingDataset(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.fetched.append(index)
        return index


def test_skipping_never_reads_the_dataset() -> None:
    dataset = CountingDataset(10)
    order = [9, 3, 0, 7, 1, 8, 2, 6, 4, 5]
    loader = DataLoader(dataset, batch_sampler=SkipBatchSampler(order, 3, skip_batches=2))
    assert [batch.tolist() for batch in loader] == [[2, 6, 4], [5]]
    assert dataset.fetched == [2, 6, 4, 5]


def test_skip_batch_sampler_over_random_sampler() -> None:
    def batches(skip: int) -> list[list[int]]:
        sampler = RandomSampler(range(11), generator=torch.Generator().manual_seed(3))
        return list(SkipBatchSampler(sampler, 4, skip))

    assert batches(1) == batches(0)[1:]
    assert sorted(i for batch in batches(0) for i in batch) == list(range(11))


def test_skip_batch_sampler_forwards_set_epoch() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(
        CountingDataset(20), num_replicas=2, rank=0, seed=42
    )
    skipping = SkipBatchSampler(sampler, 3, skip_batches=1)
    skipping.set_epoch(5)
    assert sampler.epoch == 5
    assert len(skipping) == len(list(skipping)) == 3
    SkipBatchSampler(range(4), 2).set_epoch(1)  # no set_epoch to forward: a no-op


# --- save_checkpoint -------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("position_ids", torch.arange(5))
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def make_training(seed: int = 0) -> tuple[Tiny, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(model: nn.Module, optimizer: torch.optim.Optimizer, save_dir: Path, **kw: Any) -> Any:
    kw = {"epoch": 1, "step": 7, **kw}
    return save_checkpoint(
        model, optimizer, save_dir=save_dir, weight="pretrain", hidden_size=4, **kw
    )


def test_resume_file_keeps_training_dtype_weights_file_is_fp16(tmp_path: Path) -> None:
    model, optimizer = make_training()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    scaler = torch.amp.GradScaler("cpu")
    weights_path, resume_path = save(
        model, optimizer, tmp_path / "new", scaler=scaler, scheduler=scheduler, wandb_id="run-1"
    )
    assert (weights_path, resume_path) == checkpoint_paths(tmp_path / "new", "pretrain", 4)

    weights = torch.load(weights_path, weights_only=True)
    assert weights["linear.weight"].dtype == torch.float16
    assert torch.equal(weights["linear.weight"], model.linear.weight.detach().half())
    # Only floating-point tensors are halved: halving int/bool buffers would corrupt them.
    assert torch.equal(weights["position_ids"], torch.arange(5))
    assert weights["mask"].dtype == torch.bool

    resume = torch.load(resume_path, weights_only=True)  # nothing to allow-list
    assert list(resume) == [
        "model", "optimizer", "epoch", "step", "world_size", "wandb_id", "scaler", "scheduler", "rng",
    ]  # fmt: skip
    assert resume["model"]["linear.weight"].dtype == torch.float32
    assert torch.equal(resume["model"]["linear.weight"], model.linear.weight.detach())
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (1, 7, 1)
    assert resume["wandb_id"] == "run-1"
    assert resume["scaler"] == scaler.state_dict()
    assert resume["scheduler"] == scheduler.state_dict()
    assert set(resume["rng"]) >= {"python", "numpy", "torch"}


def test_weights_beyond_fp16_range_are_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = make_training()
    with torch.no_grad():
        model.linear.weight[0, :2] = torch.tensor([70000.0, -1e6])  # float16 ends at 65504
        model.linear.bias[0] = 65504.0  # the largest float16: no overflow
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        weights_path, resume_path = save(model, optimizer, tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        f"{weights_path}: 1 tensor(s) hold values beyond float16's range, written as inf in the "
        "weights file (the resume file keeps them exactly): linear.weight (2 value(s), max |x| = "
        "1e+06); pass weights_dtype=torch.bfloat16 (or torch.float32) to save_checkpoint"
    ]
    assert torch.isinf(torch.load(weights_path, weights_only=True)["linear.weight"]).sum() == 2
    resume = torch.load(resume_path, weights_only=True)
    assert resume["model"]["linear.weight"][0, 1] == -1e6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_dtype_chooses_the_weights_file_dtype(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dtype: torch.dtype
) -> None:
    model, optimizer = make_training()
    with torch.no_grad():
        model.linear.weight[0, 0] = 70000.0
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        weights_path, _ = save(model, optimizer, tmp_path, weights_dtype=dtype)
    assert caplog.records == []  # in range of both
    assert weights_path is not None
    weights = torch.load(weights_path, weights_only=True)
    assert weights["linear.weight"].dtype == dtype
    assert torch.equal(weights["linear.weight"], model.linear.weight.detach().to(dtype))
    assert weights["position_ids"].dtype == torch.int64


def test_weights_dtype_none_writes_no_weights_file(tmp_path: Path) -> None:
    model, optimizer = make_training()
    weights_path, resume_path = save(model, optimizer, tmp_path, weights_dtype=None)
    assert weights_path is None and sorted(os.listdir(tmp_path)) == [resume_path.name]


def test_tied_weights_stay_shared_in_the_resume_file(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # MiniMind ties embedding and lm_head
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights_path, resume_path = save(model, optimizer, tmp_path)
    resume_model = torch.load(resume_path, weights_only=True)["model"]
    storages = {resume_model[k].untyped_storage().data_ptr() for k in ("0.weight", "1.weight")}
    assert len(storages) == 1  # stored once
    # The weights file is MiniMind's {k: v.half().cpu()}: one fp16 copy per key.
    weights = torch.load(weights_path, weights_only=True)
    assert torch.equal(weights["0.weight"], weights["1.weight"])


def test_optional_state_is_left_out(tmp_path: Path) -> None:
    model, optimizer = make_training()
    _, resume_path = save(model, optimizer, tmp_path)
    resume = torch.load(resume_path, weights_only=True)
    assert "scaler" not in resume and "scheduler" not in resume
    assert resume["wandb_id"] is None


@pytest.mark.parametrize("fail_on_call", [1, 2], ids=["weights-file", "resume-file"])
def test_failed_save_leaves_old_files_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_on_call: int
) -> None:
    model, optimizer = make_training()
    targets = checkpoint_paths(tmp_path, "pretrain", 4)
    old = {target: f"old {target.name}".encode() * 100 for target in targets}
    for target, content in old.items():
        target.write_bytes(content)
    real_save = torch.save
    calls = 0

    def save_then_crash(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls < fail_on_call:
            real_save(obj, handle, *args, **kwargs)
            return
        handle.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", save_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save(model, optimizer, tmp_path)
    monkeypatch.undo()

    failed = targets[fail_on_call - 1]
    assert failed.read_bytes() == old[failed]
    if fail_on_call == 2:  # the weights file was written before the crash, completely
        assert torch.load(targets[0], weights_only=True).keys() == model.state_dict().keys()
    assert sorted(os.listdir(tmp_path)) == sorted(target.name for target in targets)
    for target in targets:
        assert list(tmp_path.glob(temp_name_pattern(target))) == []


@pytest.mark.parametrize("key", ["step", "rng", "scheduler", "model"])
def test_extra_state_may_not_use_a_reserved_key(tmp_path: Path, key: str) -> None:
    model, optimizer = make_training()
    with pytest.raises(CheckpointKeyError, match=f"'{key}'"):
        save(model, optimizer, tmp_path, extra_state={"ok": 1, key: 2})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_extra_state_objects_are_saved_as_state_dicts(tmp_path: Path) -> None:
    model, optimizer = make_training()
    critic = Tiny()
    compiled_critic = torch.compile(critic)
    extra = {
        "critic": nn.DataParallel(critic),  # wrappers unwrapped, as MiniMind does for kwargs
        "ref": compiled_critic,
        "critic_optimizer": torch.optim.SGD(critic.parameters(), lr=0.1),
        "best_loss": 1.5,
        "note": None,
    }
    _, resume_path = save(model, optimizer, tmp_path, extra_state=extra)
    resume = torch.load(resume_path, weights_only=True)
    assert list(resume)[-5:] == list(extra)
    for key in ("critic", "ref"):
        assert resume[key].keys() == critic.state_dict().keys()
        assert torch.equal(resume[key]["linear.bias"], critic.linear.bias.detach())
    assert resume["critic_optimizer"]["param_groups"][0]["lr"] == 0.1
    assert (resume["best_loss"], resume["note"]) == (1.5, None)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_model_wrappers_are_unwrapped_on_save_and_resume(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model, optimizer = make_training()
        for index, wrapped in enumerate(
            [
                torch.compile(model),
                DistributedDataParallel(model),
                DistributedDataParallel(torch.compile(model)),
                torch.compile(DistributedDataParallel(model)),
            ]
        ):
            save_dir = tmp_path / str(index)
            weights_path, _ = save(wrapped, optimizer, save_dir)  # type: ignore[arg-type]
            assert torch.load(weights_path, weights_only=True).keys() == model.state_dict().keys()
            ckpt = load_checkpoint(save_dir, "pretrain", 4)
            assert ckpt is not None and ckpt["world_size"] == 1
            assert resume_training(ckpt, wrapped, optimizer) == (1, 7)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


class FakeBarrier:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_zero_writes_and_every_rank_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    barrier = FakeBarrier()
    monkeypatch.setattr(ckpttool.train, "_distributed", lambda: True)
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda items, src: None)  # rank 0: wrote
    model, optimizer = make_training()
    paths = save(model, optimizer, tmp_path / "ckpts")
    assert paths == checkpoint_paths(tmp_path / "ckpts", "pretrain", 4)
    assert barrier.calls == 1
    assert all(path.exists() for path in paths) == (rank == 0)
    if rank == 0:
        assert torch.load(paths[1], weights_only=True)["world_size"] == 2


TWO_RANKS = """
import sys, time, types, torch, torch.distributed as dist
from ckpttool import load_checkpoint, save_checkpoint
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
model = torch.nn.Linear(2, 2)
optimizer = types.SimpleNamespace(state_dict=dict)  # a real one imports torch._dynamo: seconds
if rank == 0:
    time.sleep(0.5)  # rank 1 gets to save_checkpoint first and must wait for rank 0's files
paths = save_checkpoint(model, optimizer, save_dir=out, weight="w", hidden_size=2, epoch=0, step=rank)
ckpt = load_checkpoint(out, "w", 2)
print(all(path.exists() for path in paths), ckpt["world_size"], ckpt["step"])
dist.barrier()  # both ranks done with gloo before teardown
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_real_ranks_return_only_after_rank_zero_wrote(tmp_path: Path) -> None:
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(rank), str(tmp_path / "store"), str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=scaled(600))[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert outputs == ["True 2 0\n", "True 2 0\n"]  # rank 0's step, seen complete by rank 1


def test_rank_zero_still_reaches_the_barrier_when_its_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    barrier = FakeBarrier()
    monkeypatch.setattr(ckpttool.train, "_distributed", lambda: True)
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "barrier", barrier)
    shared: list[list[bool]] = []
    monkeypatch.setattr(
        dist, "broadcast_object_list", lambda items, src: shared.append(list(items))
    )
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("no space")))
    model, optimizer = make_training()
    with pytest.raises(OSError, match="no space"):
        save(model, optimizer, tmp_path)
    assert barrier.calls == 1  # the other ranks are released, not left hanging
    assert shared == [[False]]  # ... and told that the write failed


def test_other_ranks_raise_when_rank_zero_failed_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rank_zero_says_it_failed(items: list[bool], src: int) -> None:
        assert src == 0
        items[0] = False

    monkeypatch.setattr(ckpttool.train, "_distributed", lambda: True)
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "barrier", FakeBarrier())
    monkeypatch.setattr(dist, "broadcast_object_list", rank_zero_says_it_failed)
    model, optimizer = make_training()
    with pytest.raises(CorruptCheckpointError, match="rank 0 failed to write the checkpoint"):
        save(model, optimizer, tmp_path)
    assert list(tmp_path.iterdir()) == []  # rank 1 wrote nothing either


# --- load_checkpoint -------------------------------------------------------------------------


def test_load_returns_none_without_a_resume_file(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path, "pretrain", 4) is None
    assert load_checkpoint(tmp_path / "missing", "pretrain", 4) is None


def write_resume(save_dir: Path, data: dict[str, Any], use_moe: bool = False) -> Path:
    _, resume_path = checkpoint_paths(save_dir, "pretrain", 4, use_moe)
    save_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, resume_path)
    return resume_path


@pytest.mark.parametrize(
    ("saved", "current", "step", "expected_step"),
    [(8, 1, 1200, 9600), (8, 2, 1200, 4800), (2, 8, 1201, 300), (None, 2, 7, 3)],
)
def test_world_size_change_rescales_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    saved: int | None,
    current: int,
    step: int,
    expected_step: int,
) -> None:
    data: dict[str, Any] = {"model": {}, "optimizer": {}, "epoch": 0, "step": step}
    if saved is not None:  # old MiniMind files have no world_size: it was 1
        data["world_size"] = saved
    write_resume(tmp_path, data)
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: current)
    with caplog.at_level(logging.INFO, logger="ckpttool"):
        ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    assert (ckpt["step"], ckpt["world_size"]) == (expected_step, current)
    repeated = step * (saved or 1) - expected_step * current
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "ckpttool",
            logging.INFO,
            f"world_size changed {saved or 1} -> {current}: step {step} -> {expected_step}",
        )
    ] + [
        (
            "ckpttool",
            logging.WARNING,
            f"step {step} x world_size {saved or 1} = {step * (saved or 1)} global batches is "
            f"not a multiple of {current}: the resumed run trains {repeated} of the saved run's "
            "global batches a second time",
        )
    ] * bool(repeated)


def test_same_world_size_loads_unchanged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_resume(tmp_path, {"epoch": 2, "step": 5, "world_size": 1})
    with caplog.at_level(logging.INFO, logger="ckpttool"):
        assert load_checkpoint(tmp_path, "pretrain", 4) == {"epoch": 2, "step": 5, "world_size": 1}
    assert caplog.records == []


@dataclass
class UserConfig:
    """A training script's own config class: a weights-only load must refuse it."""

    lr: float = 1e-3


def test_unsafe_file_is_refused_never_loaded_unsafely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resume_path = write_resume(tmp_path, {"epoch": 0, "args": UserConfig()})
    real_load = torch.load
    calls: list[Any] = []

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    with pytest.raises(UnsafePickleError) as raised:
        load_checkpoint(tmp_path, "pretrain", 4)
    assert "tests.test_train.UserConfig" in str(raised.value)
    assert f"ckpttool scan {resume_path}" in str(raised.value)
    assert calls == [True]


def test_argparse_namespace_args_load_as_plain_data(tmp_path: Path) -> None:
    # MiniMind-style scripts save their args; ckpttool's reader and scan call Namespace plain
    # data, and load_checkpoint agrees (torch's weights-only load alone would refuse it).
    write_resume(tmp_path, {"epoch": 0, "args": argparse.Namespace(lr=1e-3, batch_size=32)})
    with pytest.raises(pickle.UnpicklingError):
        torch.load(checkpoint_paths(tmp_path, "pretrain", 4)[1], weights_only=True)
    assert load_checkpoint(tmp_path, "pretrain", 4)["args"] == argparse.Namespace(
        lr=1e-3, batch_size=32
    )


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "(EOFError)"),
        (b"not a checkpoint at all", "(Unsupported operand 110)"),
        (b"PK\x03\x04trunc", "(PytorchStreamReader failed reading zip archive: not a ZIP archive)"),
        (b"\x80\x02}q\x00.", "(Invalid magic number; corrupt file?)"),
    ],
)
def test_corrupt_file_raises_a_ckpttool_error(tmp_path: Path, content: bytes, reason: str) -> None:
    _, resume_path = checkpoint_paths(tmp_path, "pretrain", 4)
    resume_path.write_bytes(content)
    with pytest.raises(CorruptCheckpointError) as raised:
        load_checkpoint(tmp_path, "pretrain", 4)
    assert reason in str(raised.value)
    assert str(raised.value).endswith(f"`ckpttool show {resume_path}`")
    assert "weights_only" not in str(raised.value)  # never suggest the unsafe load


def test_a_non_dict_file_is_a_layout_error(tmp_path: Path) -> None:
    write_resume(tmp_path, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="not a resume dict"):
        load_checkpoint(tmp_path, "pretrain", 4)


# --- resume_training -------------------------------------------------------------------------


def minimind_lm_checkpoint(save_dir: Path, model: nn.Module, **kwargs: Any) -> None:
    """How MiniMind's lm_checkpoint writes (plain torch.save, tmp + os.replace, fp16 model)."""
    os.makedirs(save_dir, exist_ok=True)
    resume_path = f"{save_dir}/pretrain_4_resume.pth"
    state_dict = {k: v.half().cpu() for k, v in model.state_dict().items()}
    resume_data = {"model": state_dict, **kwargs}
    torch.save(resume_data, resume_path + ".tmp")
    os.replace(resume_path + ".tmp", resume_path)


@pytest.mark.parametrize("with_world_size", [True, False])
def test_resume_from_a_minimind_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, with_world_size: bool
) -> None:
    model, optimizer = make_training(seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fields: dict[str, Any] = {"optimizer": optimizer.state_dict(), "epoch": 2, "step": 40}
    if with_world_size:
        fields.update(world_size=1, wandb_id="abc")
    minimind_lm_checkpoint(tmp_path, model, **fields, scaler=scaler.state_dict())

    ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    new_model, new_optimizer = make_training(seed=1)
    new_scaler = torch.amp.GradScaler("cpu")
    scheduler = torch.optim.lr_scheduler.StepLR(new_optimizer, 3)
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        start = resume_training(
            ckpt, new_model, new_optimizer, scaler=new_scaler, scheduler=scheduler
        )
    assert start == (2, 40)
    # fp16 weights cast into the fp32 model (MiniMind's resume is lossy by design).
    assert new_model.linear.weight.dtype == torch.float32
    assert torch.equal(new_model.linear.weight, model.linear.weight.detach().half().float())
    assert torch.equal(new_model.state_dict()["position_ids"], torch.arange(5))
    exp_avg = new_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, optimizer.state_dict()["state"][0]["exp_avg"])
    assert new_scaler.get_scale() == 1024.0
    # MiniMind halves every tensor, buffers too: each cast back is one line, in state dict order.
    minimind_hint = (
        ": load_state_dict casts them, so the resume is exact only where the saved run's values "
        "fit both dtypes exactly (MiniMind's resume files store the model in float16; "
        "ckpttool.save_checkpoint keeps the training dtype)"
    )
    assert [r.getMessage() for r in caplog.records] == [
        "model tensors stored as float16 are loaded into int64 (1 tensor)" + minimind_hint,
        "model tensors stored as float16 are loaded into bool (1 tensor)" + minimind_hint,
        "model tensors stored as float16 are loaded into float32 (2 tensors)" + minimind_hint,
        "checkpoint has no scheduler state; the scheduler passed starts fresh",
        "checkpoint has no RNG state (MiniMind's files do not save one): random draws after "
        "the resume (dropout masks...) differ from the uninterrupted run's",
    ]


def test_resuming_minimind_fixture_logs_each_thing_it_cannot_restore(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.support.helpers import FIXTURES
    from tests.support.minimind import MiniMindConfig, MiniMindForCausalLM

    ckpt = load_checkpoint(FIXTURES / "minimind", "pretrain", 32)  # MiniMind's own resume file
    assert ckpt is not None
    model = MiniMindForCausalLM(MiniMindConfig())  # the fixtures' tiny shape
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        assert resume_training(ckpt, model, optimizer, scaler=scaler, scheduler=scheduler) == (
            1,
            9600,  # step 1200 on 8 ranks, resumed on 1
        )
    assert [r.getMessage() for r in caplog.records] == [
        "model tensors stored as float16 are loaded into float32 (21 tensors): load_state_dict "
        "casts them, so the resume is exact only where the saved run's values fit both dtypes "
        "exactly (MiniMind's resume files store the model in float16; ckpttool.save_checkpoint "
        "keeps the training dtype)",
        "checkpoint has no scheduler state; the scheduler passed starts fresh",
        "checkpoint has no RNG state (MiniMind's files do not save one): random draws after "
        "the resume (dropout masks...) differ from the uninterrupted run's",
    ]
    assert scaler.get_scale() == 65536.0


def test_resume_warns_about_missing_parts_of_the_rng_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = make_training()
    save(model, optimizer, tmp_path)
    ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    del ckpt["rng"]["numpy"]
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        resume_training(ckpt, model, optimizer)
    assert [r.getMessage() for r in caplog.records] == [
        "checkpoint's RNG state has no numpy state: those generators go on from this process's "
        "seed, not from the saved run's state"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        resume_training(ckpt, model, optimizer, restore_rng=False)  # the caller's choice
    assert caplog.records == []


def test_disabled_scaler_state_does_not_break_an_enabled_scaler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = make_training()
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # MiniMind with bf16 saves {}
    minimind_lm_checkpoint(
        tmp_path,
        model,
        optimizer=optimizer.state_dict(),
        epoch=0,
        step=3,
        scaler=disabled.state_dict(),
    )
    ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        assert resume_training(ckpt, model, optimizer, scaler=scaler) == (0, 3)
    assert scaler.get_scale() == 8.0
    assert any("empty" in r.getMessage() for r in caplog.records)


def test_round_trip_restores_every_part(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = make_training(seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    save(model, optimizer, tmp_path, scaler=scaler, scheduler=scheduler, epoch=3, step=11)
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))

    new_model, new_optimizer = make_training(seed=5)
    new_scheduler = torch.optim.lr_scheduler.StepLR(new_optimizer, 1, gamma=0.5)
    new_scaler = torch.amp.GradScaler("cpu")
    ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        start = resume_training(
            ckpt, new_model, new_optimizer, scaler=new_scaler, scheduler=new_scheduler
        )
    assert start == (3, 11)
    assert caplog.records == []
    for key, value in model.state_dict().items():
        assert torch.equal(new_model.state_dict()[key], value)
    assert new_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    assert new_scheduler.state_dict() == scheduler.state_dict()
    assert new_scaler.get_scale() == 64.0
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])


def test_restore_rng_false_leaves_rng_alone(tmp_path: Path) -> None:
    model, optimizer = make_training()
    save(model, optimizer, tmp_path)
    ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    torch.manual_seed(123)
    expected = torch.rand(2)
    torch.manual_seed(123)
    resume_training(ckpt, model, optimizer, restore_rng=False)
    assert torch.equal(torch.rand(2), expected)


def test_resume_warns_about_state_it_was_not_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = make_training()
    save(model, optimizer, tmp_path, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))
    ckpt = load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        resume_training(ckpt, model, optimizer)
    assert [r.getMessage() for r in caplog.records] == [
        "checkpoint has scheduler state but no scheduler was passed; not restored"
    ]


@pytest.mark.parametrize("missing", ["model", "optimizer", "epoch"])
def test_resume_needs_model_optimizer_and_epoch(missing: str) -> None:
    model, optimizer = make_training()
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 0}
    del ckpt[missing]
    with pytest.raises(LayoutError, match=f"no '{missing}' key"):
        resume_training(ckpt, model, optimizer)


def test_rng_state_survives_a_weights_only_round_trip() -> None:
    state = capture_rng_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = (random.random(), np.random.randn(), torch.randn(2))  # randn: cached gaussian too
    np.random.randn()
    restore_rng_state(loaded)
    draws = (random.random(), np.random.randn(), torch.randn(2))
    assert draws[:2] == expected[:2] and torch.equal(draws[2], expected[2])
