"""rescale-step as a library: the pure dict -> dict repair, the pickle splice, the file rewrite."""

from __future__ import annotations

import logging
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import ckpttool.train
from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.rescale.run import InexactRescaleError, rescale_fields, rescale_step
from ckpttool.errors import InputError, LayoutError, OutputExistsError
from ckpttool.formats.torch_zip.rewrite import RewriteCheckError, verify_rewrite
from ckpttool.formats.torch_zip.zip_writer import TorchZipWriter
from ckpttool.io.atomic import temp_name_pattern
from ckpttool.model.lr_schedule import rescale_scheduler
from ckpttool.model.records import walk
from tests.support.helpers import FIXTURES, copy_fixture, digest

# fixture -> (step, world_size in the file); the legacy one has none (rescaled --from-world-size 4)
RESUMES = {
    "minimind/pretrain_32_resume.pth": (1200, 8),
    "minimind/pretrain_32_moe_resume.pth": (300, 2),
    "ckpttool/pretrain_32_resume.pth": (40, 1),
    "legacy/resume_bigkeys.pth": (1500, None),
}


# -- the pure function ----------------------------------------------------------------------


def test_divisible_rescale_updates_in_place_and_appends_history() -> None:
    fields = {"model": "weights", "epoch": 1, "step": 1200, "world_size": 8, "wandb_id": "x"}
    new, plan = rescale_fields(fields, 2)
    assert new == {
        "model": "weights", "epoch": 1, "step": 4800, "world_size": 2, "wandb_id": "x",
        "rescaled_from": [{"step": 1200, "world_size": 8}],
    }  # fmt: skip
    assert list(new) == ["model", "epoch", "step", "world_size", "wandb_id", "rescaled_from"]
    assert fields["step"] == 1200 and "rescaled_from" not in fields  # input untouched
    assert (plan.old_step, plan.new_step, plan.from_world_size, plan.world_size) == (
        1200, 4800, 8, 2,
    )  # fmt: skip
    assert plan.exact and plan.repeated_batches == 0 and plan.changed


def test_non_divisible_rescale_states_the_repeat_exactly() -> None:
    new, plan = rescale_fields({"step": 1201, "world_size": 8}, 3)
    assert new["step"] == 3202  # floor(9608 / 3)
    assert plan.global_batches == 9608
    assert plan.repeated_batches == 2  # 9608 - 3 * 3202
    assert str(plan.repeated_per_rank) == "2/3"
    assert plan.repeated_samples(16) == 32
    assert plan.max_repeated_samples_per_rank(16) == 11  # ceil(32 / 3)
    assert not plan.exact


def test_strict_refuses_only_an_inexact_rescale() -> None:
    with pytest.raises(InexactRescaleError, match=r"9608 global batches is not a multiple of 3"):
        rescale_fields({"step": 1201, "world_size": 8}, 3, strict=True)
    new, _ = rescale_fields({"step": 1200, "world_size": 8}, 3, strict=True)
    assert new["step"] == 3200


def test_missing_world_size_needs_from_world_size() -> None:
    with pytest.raises(InputError, match=r"has no world_size.*--from-world-size M"):
        rescale_fields({"epoch": 0, "step": 1500}, 2)
    new, plan = rescale_fields({"epoch": 0, "step": 1500}, 2, from_world_size=4)
    assert new == {
        "epoch": 0, "step": 3000, "world_size": 2,
        "rescaled_from": [{"step": 1500, "world_size": 4}],
    }  # fmt: skip
    assert plan.file_world_size is None and plan.world_size_from_option


def test_from_world_size_overrides_a_wrong_one() -> None:
    new, plan = rescale_fields({"step": 100, "world_size": 1}, 2, from_world_size=8)
    assert new["step"] == 400 and new["rescaled_from"] == [{"step": 100, "world_size": 8}]
    assert plan.file_world_size == 1 and plan.from_world_size == 8


def test_repeated_rescale_appends_to_the_history() -> None:
    first, _ = rescale_fields({"step": 1200, "world_size": 8}, 2)
    second, _ = rescale_fields(first, 3)
    assert second == {
        "step": 3200, "world_size": 3,
        "rescaled_from": [{"step": 1200, "world_size": 8}, {"step": 4800, "world_size": 2}],
    }  # fmt: skip


def test_same_world_size_changes_nothing() -> None:
    fields = {"step": 1200, "world_size": 8}
    new, plan = rescale_fields(fields, 8)
    assert new == fields and not plan.changed


def test_custom_step_key_is_recorded_under_its_name() -> None:
    new, _ = rescale_fields({"global_step": 40}, 2, from_world_size=4, step_key="global_step")
    assert new == {
        "global_step": 80, "world_size": 2,
        "rescaled_from": [{"global_step": 40, "world_size": 4}],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"epoch": 1}, "no 'step' field"),
        ({"step": True, "world_size": 2}, "not a count of batches"),
        ({"step": -1, "world_size": 2}, "not a count of batches"),
        ({"step": 1.5, "world_size": 2}, "not a count of batches"),
        ({"step": 4, "world_size": 2, "rescaled_from": "yesterday"}, "not ckpttool's history"),
        ({"step": 4, "world_size": 2, "rescaled_from": [1]}, "not ckpttool's history"),
    ],
)
def test_bad_fields_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        rescale_fields(fields, 1)


@pytest.mark.parametrize("world_size", [0, -2, True])
def test_bad_world_sizes_are_refused(world_size: int) -> None:
    with pytest.raises(InputError, match="positive integer"):
        rescale_fields({"step": 4, "world_size": 2}, world_size)
    with pytest.raises(InputError, match="positive integer"):
        rescale_fields({"step": 4}, 2, from_world_size=world_size)


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(0, 10**9), saved=st.integers(1, 4096), current=st.integers(1, 4096)
)  # fmt: skip
def test_floor_bound_holds(step: int, saved: int, current: int) -> None:
    new, plan = rescale_fields({"step": step, "world_size": saved}, current)
    consumed = step * saved
    # the resumed ranks skip no more than was trained, and fall short by under one global round
    assert new["step"] * current <= consumed < (new["step"] + 1) * current
    assert plan.repeated_batches == consumed % current
    assert plan.repeated_per_rank < 1


@pytest.mark.parametrize(("step", "saved", "current", "batch"), [(7, 4, 3, 5), (5, 3, 4, 2)])
def test_repeats_match_distributed_sampler(step: int, saved: int, current: int, batch: int) -> None:
    """With DistributedSampler, exactly repeated_samples samples are trained twice, none lost."""
    size = 840  # a multiple of every world size used: no padding samples
    _, plan = rescale_fields({"step": step, "world_size": saved}, current)

    def rank_batches(world: int, rank: int) -> list[list[int]]:
        sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, seed=3)
        order = list(sampler)
        return [order[i : i + batch] for i in range(0, len(order), batch)]

    before = [i for r in range(saved) for b in rank_batches(saved, r)[:step] for i in b]
    after_by_rank = [
        [i for b in rank_batches(current, r)[plan.new_step :] for i in b] for r in range(current)
    ]
    seen_before = set(before)
    repeats = [sum(i in seen_before for i in indices) for indices in after_by_rank]
    assert sum(repeats) == plan.repeated_samples(batch) > 0
    assert max(repeats) <= plan.max_repeated_samples_per_rank(batch) <= batch
    assert seen_before | {i for indices in after_by_rank for i in indices} == set(range(size))


# -- the file operation ---------------------------------------------------------------------


def assert_same_loaded(old: Any, new: Any, where: str = "") -> None:
    """torch.load trees equal: tensors torch.equal (dtype, shape, stride too), order equal."""
    assert type(old) is type(new), where
    if isinstance(old, torch.Tensor):
        assert (old.dtype, old.shape, old.stride(), old.requires_grad) == (
            new.dtype, new.shape, new.stride(), new.requires_grad,
        ), where  # fmt: skip
        assert torch.equal(old, new), where
    elif isinstance(old, dict):
        assert list(old) == list(new), where
        for key in old:
            assert_same_loaded(old[key], new[key], f"{where}.{key}")
    elif isinstance(old, (list, tuple)):
        assert len(old) == len(new), where
        for index, (a, b) in enumerate(zip(old, new)):
            assert_same_loaded(a, b, f"{where}.{index}")
    elif isinstance(old, float) and math.isnan(old):
        assert math.isnan(new), where
    else:
        assert old == new, where


def storage_groups(tree: Any) -> list[list[str]]:
    """Keys grouped by the storage they view: tied weights must stay tied."""
    groups: dict[int, list[str]] = {}

    def visit(node: Any, key: str) -> None:
        if isinstance(node, torch.Tensor):
            groups.setdefault(node.untyped_storage().data_ptr(), []).append(key)
        elif isinstance(node, dict):
            for name, child in node.items():
                visit(child, f"{key}.{name}")
        elif isinstance(node, (list, tuple)):
            for index, child in enumerate(node):
                visit(child, f"{key}.{index}")

    visit(tree, "")
    return sorted(g for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize("name", list(RESUMES))
def test_rescale_preserves_everything_else(name: str, tmp_path: Path) -> None:
    source = copy_fixture(name, tmp_path)
    step, file_world_size = RESUMES[name]
    from_world_size = None if file_world_size else 4
    saved = file_world_size or 4
    out = tmp_path / "out.pth"
    report = rescale_step(source, 3, from_world_size=from_world_size, output=out)
    assert report.written and report.plan.new_step == step * saved // 3

    with open_checkpoint(source) as old, open_checkpoint(out) as new:
        assert new.format == old.format
        expected_keys = list(old.root) + [
            k for k in ("world_size", "rescaled_from") if k not in old.root
        ]
        assert list(new.root) == expected_keys
        assert new.root["step"] == step * saved // 3 and new.root["world_size"] == 3
        assert new.root["rescaled_from"] == [{"step": step, "world_size": saved}]
        assert new.tensors() == old.tensors()  # records: dtype, shape, stride, storage...
        for key in old.root:
            if key not in ("step", "world_size", "scheduler"):
                assert list(walk(new.root[key])) == list(walk(old.root[key])), key
        if "scheduler" in old.root:  # counts optimizer steps: moved like step (its own tests)
            moved = rescale_scheduler(old.root["scheduler"], saved, 3).state
            assert moved is not None and new.root["scheduler"] == moved
        for record in old.tensors():
            assert new.read_bytes(record) == old.read_bytes(record), record.key

    before = torch.load(source, map_location="cpu", weights_only=False)
    after = torch.load(out, map_location="cpu", weights_only=False)
    assert after.pop("rescaled_from") == [{"step": step, "world_size": saved}]
    assert after.pop("step") == step * saved // 3 and before.pop("step") == step
    assert after.pop("world_size") == 3
    before.pop("world_size", None)
    if "scheduler" in before:
        assert after["scheduler"]["last_epoch"] == before["scheduler"]["last_epoch"] * saved // 3
        after["scheduler"] = before["scheduler"]
    assert_same_loaded(before, after)
    assert storage_groups(after) == storage_groups(before)
    if new.format == "torch-zip":  # records stay 64-byte aligned
        mmapped = torch.load(out, map_location="cpu", weights_only=True, mmap=True)
        assert mmapped["world_size"] == 3


def test_in_place_rewrite_keeps_mode_and_leaves_no_temp(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    os.chmod(path, 0o600)
    report = rescale_step(path, 2)
    assert report.output == path and report.written and report.backup is None
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_32_resume.pth"]
    with open_checkpoint(path) as ckpt:
        assert (ckpt.root["step"], ckpt.root["world_size"]) == (4800, 2)


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    before = digest(path)
    report = rescale_step(path, 3, dry_run=True, backup=True)
    assert report.dry_run and not report.written and report.plan.new_step == 3200
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_32_resume.pth"]


def test_backup_keeps_the_original_and_is_never_overwritten(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    before = digest(path)
    report = rescale_step(path, 2, backup=True)
    backup = tmp_path / "pretrain_32_resume.pth.bak"
    assert report.backup == backup and digest(backup) == before and digest(path) != before
    rescaled = digest(path)
    with pytest.raises(OutputExistsError, match=r"pretrain_32_resume.pth.bak already exists"):
        rescale_step(path, 4, backup=True)
    assert digest(path) == rescaled and digest(backup) == before


def test_output_must_not_exist_unless_overwrite(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    out = tmp_path / "out.pth"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError, match="already exists"):
        rescale_step(path, 2, output=out)
    assert out.read_bytes() == b"keep me"
    rescale_step(path, 2, output=out, overwrite=True)
    with open_checkpoint(out) as ckpt:
        assert ckpt.root["step"] == 4800
    with pytest.raises(InputError, match="--backup applies to in-place"):
        rescale_step(path, 2, output=tmp_path / "other.pth", backup=True)


def test_rescaling_twice_keeps_the_whole_history(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    rescale_step(path, 2)
    report = rescale_step(path, 3)
    assert report.plan.new_step == 3200
    loaded = torch.load(path, weights_only=True)
    assert loaded["rescaled_from"] == [
        {"step": 1200, "world_size": 8}, {"step": 4800, "world_size": 2},
    ]  # fmt: skip
    assert list(loaded)[-1] == "rescaled_from" and loaded["world_size"] == 3


def test_nothing_to_do_writes_nothing(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    before = digest(path)
    report = rescale_step(path, 8)
    assert not report.plan.changed and not report.written
    assert digest(path) == before


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("minimind/pretrain_32.pth", "a plain state dict, not a resume checkpoint"),
        ("safetensors/model.safetensors", "holds weights only"),
        ("lightning/epoch=1-step=40.ckpt", "--step-key global_step"),
        ("special/nested_generic.pth", "not a resume checkpoint"),
    ],
)
def test_non_resume_files_are_refused(name: str, message: str, tmp_path: Path) -> None:
    path = copy_fixture(name, tmp_path)
    before = digest(path)
    with pytest.raises(LayoutError, match=message):
        rescale_step(path, 2, from_world_size=4)
    assert digest(path) == before


def test_lightning_with_step_key_rescales_that_field(tmp_path: Path) -> None:
    path = copy_fixture("lightning/epoch=1-step=40.ckpt", tmp_path)
    report = rescale_step(path, 2, from_world_size=4, step_key="global_step")
    assert report.plan.new_step == 80
    before = torch.load(FIXTURES / "lightning/epoch=1-step=40.ckpt", weights_only=False)
    after = torch.load(path, weights_only=False)
    assert after.pop("global_step") == 80 and before.pop("global_step") == 40
    assert after.pop("world_size") == 2
    assert after.pop("rescaled_from") == [{"global_step": 40, "world_size": 4}]
    assert_same_loaded(before, after)


def test_bare_pickle_is_spliced_too(tmp_path: Path) -> None:
    path = tmp_path / "resume.pkl"
    state = {"model": {}, "optimizer": {}, "epoch": 2, "step": 9, "world_size": 3, "z": [1.5]}
    path.write_bytes(pickle.dumps(state, protocol=2))
    rescale_step(path, 2)
    assert pickle.loads(path.read_bytes()) == {
        **state, "step": 13, "world_size": 2, "rescaled_from": [{"step": 9, "world_size": 3}],
    }  # fmt: skip


def test_framed_pickle_file_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "resume.pkl"
    path.write_bytes(pickle.dumps({"model": {}, "optimizer": {}, "epoch": 0, "step": 4}, 4))
    with pytest.raises(LayoutError, match="FRAME"):
        rescale_step(path, 2, from_world_size=1)


def fail_halfway(original: Any, calls_before_failure: int) -> Any:
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > calls_before_failure:
            raise OSError(28, "No space left on device (injected)")
        return original(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("backup", [False, True])
def test_failure_while_writing_zip_leaves_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backup: bool
) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    before = digest(path)
    monkeypatch.setattr(TorchZipWriter, "write_copy", fail_halfway(TorchZipWriter.write_copy, 40))
    with pytest.raises(InputError, match=r"cannot write .* \(No space left on device \(injected"):
        rescale_step(path, 2, backup=backup)
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_32_resume.pth"]
    assert not list(tmp_path.glob(temp_name_pattern(path)))


def test_failure_while_writing_legacy_leaves_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = copy_fixture("legacy/resume_bigkeys.pth", tmp_path)
    before = digest(path)
    import ckpttool.formats.torch_zip.rewrite

    monkeypatch.setattr(
        ckpttool.formats.torch_zip.rewrite,
        "copy_range",
        fail_halfway(ckpttool.formats.torch_zip.rewrite.copy_range, 1),
    )
    with pytest.raises(InputError, match="injected"):
        rescale_step(path, 2, from_world_size=4)
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resume_bigkeys.pth"]


def test_failed_read_back_replaces_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    before = digest(path)
    import ckpttool.commands.rescale.run

    def wrong_expectation(old: Any, new_path: Path, changes: dict[str, Any]) -> None:
        verify_rewrite(old, new_path, {**changes, "step": 1})

    monkeypatch.setattr(ckpttool.commands.rescale.run, "verify_rewrite", wrong_expectation)
    with pytest.raises(RewriteCheckError, match=r"'step' is 4800 instead of 1") as error:
        rescale_step(path, 2, backup=True)
    assert error.value.exit_code == 1
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_32_resume.pth"]


def test_rescale_never_imports_torch(tmp_path: Path) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    code = (
        "import sys; from ckpttool.commands.rescale.run import rescale_step; "
        f"rescale_step({str(path)!r}, 2); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- end to end with the training API -------------------------------------------------------


def test_save_at_4_rescale_to_2_resume_skips_the_same_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 37
    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 4)
    _, resume_path = ckpttool.train.save_checkpoint(
        model, optimizer, save_dir=tmp_path, weight="pretrain", hidden_size=4, epoch=0, step=step
    )
    report = rescale_step(resume_path, 2)
    assert report.plan.new_step == step * 4 // 2

    monkeypatch.setattr(ckpttool.train, "_current_world_size", lambda: 2)
    with caplog.at_level(logging.INFO, logger="ckpttool"):
        ckpt = ckpttool.train.load_checkpoint(tmp_path, "pretrain", 4)
    assert ckpt is not None
    assert not [r for r in caplog.records if "world_size changed" in r.getMessage()]
    _, start_step = ckpttool.train.resume_training(ckpt, model, optimizer, restore_rng=False)
    assert start_step == step * 4 // 2 == 74
    batch_size = 3
    batches = list(ckpttool.train.SkipBatchSampler(range(300), batch_size, skip_batches=start_step))
    assert batches[0] == [222, 223, 224]  # 74 batches of 3 skipped
    assert len(batches) == 100 - 74


def test_in_place_through_a_symlink_rewrites_the_file_it_points_to(tmp_path: Path) -> None:
    real = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    link = tmp_path / "latest.pth"
    link.symlink_to(real.name)
    rescale_step(link, 2, backup=True)
    assert link.is_symlink() and link.resolve() == real
    assert torch.load(real, weights_only=True)["step"] == 4800
    assert torch.load(tmp_path / "latest.pth.bak", weights_only=True)["step"] == 1200


def test_backup_is_a_copy_where_hard_links_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    before = digest(path)

    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    report = rescale_step(path, 2, backup=True)
    assert report.backup is not None and digest(report.backup) == before
    assert digest(path) != before


def test_copy_falls_back_to_read_write_where_the_kernel_cannot_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_kernel_copy(*args: Any) -> int:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy)
    for name in ("minimind/pretrain_32_resume.pth", "legacy/resume_bigkeys.pth"):
        source = copy_fixture(name, tmp_path)
        out = tmp_path / f"out_{source.name}"
        rescale_step(source, 2, from_world_size=8, output=out)
        before = torch.load(source, weights_only=True)
        after = torch.load(out, weights_only=True)
        for key in ("step", "world_size", "rescaled_from"):
            before.pop(key, None)
            after.pop(key)
        assert_same_loaded(before, after)
