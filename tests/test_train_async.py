"""save_checkpoint(..., async_save=True): the state copied on the caller's thread, the files
written and fsynced on a background thread, byte for byte a synchronous save's; the next save,
load_checkpoint or wait_for_save waits for them and raises what went wrong. (Killed mid-write:
tests/test_crash.py's kill loop, operation "async_save".)"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import ckpttool.train as train  # noqa: E402
from ckpttool.errors import CorruptCheckpointError  # noqa: E402
from ckpttool.train import (  # noqa: E402
    checkpoint_paths,
    load_checkpoint,
    save_checkpoint,
    wait_for_save,
)
from tests.support.timeouts import scaled  # noqa: E402


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # one storage under two keys
        self.register_buffer("positions", torch.arange(4))


def make_training() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def save(directory: Path, model: nn.Module, optimizer: Any, scheduler: Any, **kw: Any) -> Any:
    return save_checkpoint(
        model, optimizer, save_dir=directory, weight="pretrain", hidden_size=8, epoch=0, step=3,
        scheduler=scheduler, **kw,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def no_save_left_behind() -> Any:
    yield
    try:
        wait_for_save()
    except Exception:
        pass


def test_the_bytes_are_a_synchronous_save_s(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_training()
    state = torch.get_rng_state()
    synchronous = save(tmp_path / "sync", model, optimizer, scheduler)
    torch.set_rng_state(state)  # (nothing drew from it: the same state is recorded)
    background = save(tmp_path / "async", model, optimizer, scheduler, async_save=True)
    wait_for_save()
    for mine, theirs in zip(background, synchronous):
        assert mine.read_bytes() == theirs.read_bytes(), mine.name
    loaded = torch.load(background[1], weights_only=True)["model"]
    assert loaded["embed.weight"].untyped_storage().data_ptr() == (
        loaded["head.weight"].untyped_storage().data_ptr()
    )  # still one storage


def test_training_may_change_the_state_as_soon_as_it_returns(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_training()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    save(tmp_path, model, optimizer, scheduler, async_save=True)
    with torch.no_grad():  # the next steps, while the files are written
        for parameter in model.parameters():
            parameter.mul_(0.0)
        for value in optimizer.state[model.embed.weight].values():
            value.add_(100.0)
    ckpt = load_checkpoint(tmp_path, "pretrain", 8)  # waits for the save first
    assert ckpt is not None
    for key, value in before.items():
        assert torch.equal(ckpt["model"][key], value), key
    for key, value in moments.items():
        assert torch.equal(ckpt["optimizer"]["state"][0][key], value), key


def test_an_error_in_the_background_surfaces_at_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, scheduler = make_training()
    real_save = torch.save

    def full_disk(obj: Any, handle: Any) -> None:
        if "optimizer" in obj and obj["step"] == 3:  # the async saves' resume files
            raise OSError(28, "No space left on device")
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", full_disk)
    save(tmp_path, model, optimizer, scheduler, async_save=True)  # returns: the write is later
    with pytest.raises(OSError, match="No space left"):
        wait_for_save()
    wait_for_save()  # raised once
    save(tmp_path, model, optimizer, scheduler, async_save=True)
    with pytest.raises(OSError, match="No space left"):  # the next save raises it, first
        save_checkpoint(
            model,
            optimizer,
            save_dir=tmp_path,
            weight="pretrain",
            hidden_size=8,
            epoch=0,
            step=4,
            scheduler=scheduler,
        )
    assert not checkpoint_paths(tmp_path, "pretrain", 8)[1].exists()
    save(tmp_path, model, optimizer, scheduler, async_save=True)
    with pytest.raises(OSError, match="No space left"):
        load_checkpoint(tmp_path, "pretrain", 8)  # and load_checkpoint


def test_the_next_save_waits_until_the_previous_one_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, scheduler = make_training()
    real_save = torch.save
    release = threading.Event()
    order: list[str] = []

    def held_save(obj: Any, handle: Any) -> None:
        if "optimizer" in obj and obj["step"] == 3:
            release.wait()  # the first save's resume file waits to be let go
        real_save(obj, handle)
        if "optimizer" in obj:
            order.append(f"resume step {obj['step']} written")

    monkeypatch.setattr(torch, "save", held_save)
    save(tmp_path, model, optimizer, scheduler, async_save=True)
    assert order == []  # returned while the write is held
    threading.Timer(0.05, release.set).start()  # not a timing assertion: only lets it go
    save_checkpoint(
        model, optimizer, save_dir=tmp_path, weight="pretrain", hidden_size=8, epoch=0, step=4,
        scheduler=scheduler,
    )  # fmt: skip
    assert order == ["resume step 3 written", "resume step 4 written"]


class FakeCollectives:
    """torch.distributed's barrier and broadcast as one rank sees them; ``rank_zero_wrote``
    is what rank 0 broadcasts (on rank 0 itself, what it sends is recorded)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int, rank_zero_wrote: bool) -> None:
        self.barriers = 0
        self.sent: list[bool] = []
        self.rank_zero_wrote = rank_zero_wrote
        monkeypatch.setattr(train, "_distributed", lambda: True)
        monkeypatch.setattr(train, "_current_world_size", lambda: 2)
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(dist, "barrier", self.barrier)
        monkeypatch.setattr(dist, "broadcast_object_list", self.broadcast)
        self.rank = rank

    def barrier(self) -> None:
        self.barriers += 1

    def broadcast(self, items: list[bool], src: int) -> None:
        assert src == 0
        if self.rank == 0:
            self.sent.append(items[0])
        else:
            items[0] = self.rank_zero_wrote


def test_under_torch_distributed_rank_zero_returns_before_its_write_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = FakeCollectives(monkeypatch, rank=0, rank_zero_wrote=True)
    model, optimizer, scheduler = make_training()
    real_save = torch.save
    release = threading.Event()

    def held_save(obj: Any, handle: Any) -> None:
        if "optimizer" in obj:
            assert release.wait(timeout=scaled(120))
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", held_save)
    resume = save(tmp_path, model, optimizer, scheduler, async_save=True)[1]
    # the ranks agreed that rank 0 took its copy; the file is not there yet
    assert (ranks.barriers, ranks.sent, resume.exists()) == (1, [True], False)
    release.set()
    wait_for_save()  # collective: the ranks agree again, on durability
    assert (ranks.barriers, ranks.sent, resume.exists()) == (2, [True, True], True)
    wait_for_save()  # nothing under way: no collective call that other ranks would not make
    assert ranks.barriers == 2


def test_under_torch_distributed_a_failed_background_write_is_every_rank_s_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = FakeCollectives(monkeypatch, rank=0, rank_zero_wrote=True)
    model, optimizer, scheduler = make_training()
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("no space")))
    save(tmp_path, model, optimizer, scheduler, async_save=True, weights_dtype=None)
    with pytest.raises(OSError, match="no space"):
        wait_for_save()
    assert ranks.sent == [True, False]  # the other ranks are told, at their wait_for_save


def test_under_torch_distributed_other_ranks_raise_when_rank_zero_s_write_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = FakeCollectives(monkeypatch, rank=1, rank_zero_wrote=True)
    model, optimizer, scheduler = make_training()
    resume = save(tmp_path, model, optimizer, scheduler, async_save=True)[1]
    assert ranks.barriers == 1 and not resume.exists()  # rank 1 writes nothing
    ranks.rank_zero_wrote = False  # rank 0's background write fails
    with pytest.raises(CorruptCheckpointError, match="rank 0 failed to write"):
        load_checkpoint(tmp_path, "pretrain", 8)  # waits first, as save_checkpoint does
    assert ranks.barriers == 2
    assert load_checkpoint(tmp_path, "pretrain", 8) is None  # raised once; nothing pending


TWO_RANKS_ASYNC = """
import sys, time, types, torch, torch.distributed as dist
from ckpttool import load_checkpoint, save_checkpoint
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
real_save = torch.save
def slow_save(obj, handle):  # rank 0's background write takes a while
    time.sleep(0.5)
    real_save(obj, handle)
torch.save = slow_save
torch.manual_seed(0)  # the same weights on both ranks, as DDP keeps them
model = torch.nn.Linear(2, 2)
optimizer = types.SimpleNamespace(state_dict=dict)  # a real one imports torch._dynamo: seconds
paths = save_checkpoint(model, optimizer, save_dir=out, weight="w", hidden_size=2, epoch=0,
                        step=5, async_save=True)
with torch.no_grad():
    model.weight.add_(1.0)  # training goes on at once; the file has the values saved
ckpt = load_checkpoint(out, "w", 2)  # every rank: waits until rank 0's files are durable
print(all(path.exists() for path in paths), ckpt["step"],
      torch.equal(ckpt["model"]["weight"] + 1.0, model.weight))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_real_ranks_save_asynchronously_and_load_the_durable_files(tmp_path: Path) -> None:
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TWO_RANKS_ASYNC,
                str(rank),
                str(tmp_path / "store"),
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=scaled(600))[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert outputs == ["True 5 True\n", "True 5 True\n"]


def test_the_staging_buffer_is_reused_and_the_bytes_stay_a_synchronous_save_s(
    tmp_path: Path,
) -> None:
    """The CPU state is copied into one buffer, allocated at the first asynchronous save and
    written into again by the next ones (its pages faulted once); each save's files are still
    a synchronous save's bytes, the buffer growing when the state does."""
    train.release_staging_buffer()
    model, optimizer, scheduler = make_training()
    staged: list[torch.Tensor] = []
    for step in range(3):
        if step == 2:  # a larger state: one more tensor in the optimizer
            optimizer.state[model.embed.weight]["extra"] = torch.randn(64, 64)
        state = torch.get_rng_state()
        synchronous = save(tmp_path / f"sync{step}", model, optimizer, scheduler)
        torch.set_rng_state(state)
        background = save(tmp_path / f"async{step}", model, optimizer, scheduler, async_save=True)
        wait_for_save()
        for mine, theirs in zip(background, synchronous):
            assert mine.read_bytes() == theirs.read_bytes(), (step, mine.name)
        buffer = train._staging.buffer
        assert buffer is not None
        staged.append(buffer)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
    assert staged[0] is staged[1]  # reused, not allocated again
    assert staged[2].numel() > staged[1].numel()  # grown for the larger state
    train.release_staging_buffer()
    assert train._staging.buffer is None


def test_the_buffer_is_not_reused_before_the_previous_save_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second asynchronous save copies into the buffer the first one is writing from: it
    waits for the first to be durable, so the first file holds the first state."""
    model, optimizer, scheduler = make_training()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    real_save = torch.save
    release = threading.Event()

    def held_save(obj: Any, handle: Any) -> None:
        if "optimizer" in obj and obj["step"] == 3:
            release.wait()
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", held_save)
    save(tmp_path, model, optimizer, scheduler, async_save=True, keep_last=2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-2.0)
    threading.Timer(0.05, release.set).start()  # not a timing assertion: only lets it go
    save_checkpoint(
        model, optimizer, save_dir=tmp_path, weight="pretrain", hidden_size=8, epoch=0, step=4,
        scheduler=scheduler, async_save=True, keep_last=2,
    )  # fmt: skip
    wait_for_save()
    resume = checkpoint_paths(tmp_path, "pretrain", 8)[1]
    earlier = train.earlier_resume_paths(resume)
    assert len(earlier) == 1
    older = torch.load(earlier[0], weights_only=True)
    newer = torch.load(resume, weights_only=True)
    assert older["step"] == 3 and newer["step"] == 4
    for key, value in first.items():
        assert torch.equal(older["model"][key], value), key
        assert torch.equal(newer["model"][key], model.state_dict()[key]), key
