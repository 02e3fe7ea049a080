"""save_checkpoint(keep_last=N) and load_checkpoint's fallback to the newest resume checkpoint
that verifies (a save cut short, a torn or bit-flipped file never resumes a run)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from ckpttool.checkpoint import open_checkpoint  # noqa: E402
from ckpttool.errors import (  # noqa: E402
    CorruptCheckpointError,
    InputError,
    LayoutError,
    UnsafePickleError,
)
from ckpttool.train import (  # noqa: E402
    checkpoint_paths,
    earlier_resume_paths,
    load_checkpoint,
    save_checkpoint,
)


def make_training() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(save_dir: Path, step: int, **kw: Any) -> Path:
    model, optimizer = make_training()
    _, resume = save_checkpoint(
        model, optimizer, save_dir=save_dir, weight="pretrain", hidden_size=4, epoch=0,
        step=step, **kw,
    )  # fmt: skip
    return resume


def load(save_dir: Path, **kw: Any) -> Any:
    return load_checkpoint(save_dir, "pretrain", 4, **kw)


def steps(paths: list[Path]) -> list[int]:
    return [torch.load(p, weights_only=True)["step"] for p in paths]


def flip_a_weight_byte(path: Path) -> None:
    """One byte of a tensor's record changed: the zip's CRC-32 no longer matches it (torch.load
    reads such a file without a word)."""
    with open_checkpoint(path) as ckpt:
        record = next(r for r in ckpt.tensors() if r.key == "model.weight")
        assert record.storage is not None
        offset, _ = ckpt.storage_span(record.storage)
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))


# --- keep_last -------------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_n_resume_checkpoints(tmp_path: Path) -> None:
    for step in range(1, 6):
        resume = save(tmp_path, step, keep_last=3)
    earlier = earlier_resume_paths(resume)
    assert [p.name for p in earlier] == ["pretrain_4_resume.4.pth", "pretrain_4_resume.3.pth"]
    assert steps([resume, *earlier]) == [5, 4, 3]
    weights, _ = checkpoint_paths(tmp_path, "pretrain", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [weights.name, resume.name, *(p.name for p in earlier)]
    )  # one weights file, no temp file
    save(tmp_path, 6)  # keep_last=1, MiniMind's one file: the earlier ones go
    assert earlier_resume_paths(resume) == [] and steps([resume]) == [6]


def test_the_default_writes_minimind_s_one_resume_file(tmp_path: Path) -> None:
    for step in (1, 2):
        resume = save(tmp_path, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_4.pth", resume.name]


def test_earlier_ones_are_deleted_only_after_the_new_one_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2):
        resume = save(tmp_path, step, keep_last=2)
    assert steps(earlier_resume_paths(resume)) == [1]
    real_save = torch.save

    def failing_save(obj: Any, handle: Any) -> None:
        if "optimizer" in obj:  # the resume file's write fails (a full disk, a kill)
            raise OSError(28, "No space left on device")
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        save(tmp_path, 3, keep_last=2)
    monkeypatch.undo()
    assert steps([resume]) == [2]
    assert steps(earlier_resume_paths(resume)) == [2, 1]  # step 1 still there
    save(tmp_path, 4, keep_last=2)
    assert steps([resume, *earlier_resume_paths(resume)]) == [4, 2]


def test_a_save_stopped_after_keeping_the_old_file_keeps_it_once(tmp_path: Path) -> None:
    resume = save(tmp_path, 1, keep_last=3)
    os.link(resume, resume.with_name("pretrain_4_resume.1.pth"))  # kept, then the save died
    save(tmp_path, 2, keep_last=3)
    assert steps([resume, *earlier_resume_paths(resume)]) == [2, 1]


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_keep_last_must_be_one_or_more(tmp_path: Path, keep_last: Any) -> None:
    with pytest.raises(InputError, match="keep_last"):
        save(tmp_path, 1, keep_last=keep_last)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# --- load_checkpoint's fallback ----------------------------------------------------------------


def two_saves(tmp_path: Path) -> Path:
    save(tmp_path, 1, keep_last=2)
    return save(tmp_path, 2, keep_last=2)


def test_a_newest_file_with_a_bad_crc_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resume = two_saves(tmp_path)
    flip_a_weight_byte(resume)
    assert torch.load(resume, weights_only=True)["step"] == 2  # torch does not notice
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        ckpt = load(tmp_path)
    assert ckpt["step"] == 1
    (message,) = [r.getMessage() for r in caplog.records]
    assert "resume.1.pth (epoch 0, step 1)" in message
    assert f"{resume} fails verification" in message and "CRC" in message
    with pytest.raises(CorruptCheckpointError, match=r"fails verification.*CRC"):
        load(tmp_path, fallback=False)


def test_a_truncated_newest_file_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resume = two_saves(tmp_path)
    data = resume.read_bytes()
    resume.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        assert load(tmp_path)["step"] == 1
    assert f"{resume} is truncated or corrupt" in caplog.records[0].getMessage()
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load(tmp_path, fallback=False)


def test_a_newest_file_without_its_training_state_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resume = two_saves(tmp_path)
    state = torch.load(resume, weights_only=True)
    del state["optimizer"]
    torch.save(state, resume)
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        assert load(tmp_path)["step"] == 1
    assert f"{resume} has no 'optimizer'" in caplog.records[0].getMessage()
    assert "optimizer" not in load(tmp_path, fallback=False)  # as it is: resume_training says


def test_when_none_verifies_the_newest_s_problem_is_raised(tmp_path: Path) -> None:
    resume = two_saves(tmp_path)
    for path in (resume, *earlier_resume_paths(resume)):
        flip_a_weight_byte(path)
    with pytest.raises(CorruptCheckpointError, match=f"{resume} fails verification"):
        load(tmp_path)


def test_a_missing_resume_file_with_earlier_ones_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resume = two_saves(tmp_path)
    resume.unlink()
    with caplog.at_level(logging.WARNING, logger="ckpttool"):
        assert load(tmp_path)["step"] == 1
    assert f"skipped: {resume} is missing" in caplog.records[0].getMessage()
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        load(tmp_path, fallback=False)


def test_an_unsafe_newest_file_is_refused_not_skipped(tmp_path: Path) -> None:
    resume = two_saves(tmp_path)
    state = torch.load(resume, weights_only=True)
    state["args"] = UnsafeConfig()
    resume.unlink()
    torch.save(state, resume)
    with pytest.raises(UnsafePickleError):
        load(tmp_path)


def test_a_file_that_is_not_a_dict_falls_back(tmp_path: Path) -> None:
    resume = two_saves(tmp_path)
    resume.unlink()
    torch.save([1, 2], resume)
    assert load(tmp_path)["step"] == 1
    with pytest.raises(LayoutError, match="not a resume dict"):
        load(tmp_path, fallback=False)


class UnsafeConfig:
    lr: float = 1e-3
