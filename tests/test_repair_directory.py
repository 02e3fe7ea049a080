"""``repair`` of directories (issue 27): a Hugging Face model directory's index rebuilt from its
shards, a run directory's pointer and incomplete checkpoints, leftover temp files. Each case
starts from a directory the framework wrote (tests/fixtures/frameworks, tests/fixtures/deepspeed),
copied and damaged; where it matters, the framework's own loader proves the repair:
``from_pretrained``, ``Trainer.train(resume_from_checkpoint=True)``, DeepSpeed's
``load_checkpoint``."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpttool.commands.repair import repair
from ckpttool.commands.repair_directory import repair_directory
from ckpttool.errors import CorruptCheckpointError, InputError, NotADirectoryCheckpointError

FIXTURES = Path(__file__).parent / "fixtures"
FRAMEWORKS = FIXTURES / "frameworks"
DEEPSPEED = FIXTURES / "deepspeed"
SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
SHARDED = {"hf_sharded": SAFE_INDEX, "hf_bin_sharded": BIN_INDEX}


def _copy(source: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _weights(directory: Path, *, info: bool = False) -> Any:
    """What transformers loads from ``directory``: the model's state dict (and the loading
    info: missing keys...)."""
    from transformers import AutoModelForCausalLM

    model, loading = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return (state, loading) if info else state


def _assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


# ------------------------------------------------------------------ Hugging Face model directory


@pytest.mark.parametrize("case", sorted(SHARDED))
def test_a_deleted_index_is_rebuilt_and_the_model_loads(case: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    index_name = SHARDED[case]
    model = _copy(FRAMEWORKS / case, tmp_path)
    (model / index_name).unlink()
    report = repair(model)
    assert report.kind == "directory" and report.written
    assert report.damage == (
        f"no {index_name}: 3 weight shards and no index saying what each holds",
    )
    (action,) = report.actions
    assert action.action == "rewrite index" and action.path == str(model / index_name)
    assert action.detail.startswith("written from the headers of 3 shards")
    original = json.loads((FRAMEWORKS / case / index_name).read_text())
    rebuilt = json.loads((model / index_name).read_text())
    assert rebuilt["weight_map"] == original["weight_map"]
    # total_size as huggingface_hub computes it: every distinct storage's bytes
    assert rebuilt["metadata"] == {"total_size": original["metadata"]["total_size"]}
    _assert_same_weights(_weights(model), _weights(FRAMEWORKS / case))


def test_a_stale_index_after_a_shard_was_renamed_is_rebuilt(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    (model / "model-00002-of-00003.safetensors").rename(model / "model-00002-of-00004.safetensors")
    original = json.loads((model / SAFE_INDEX).read_text())
    moved = sorted(k for k, v in original["weight_map"].items() if "00002" in v)
    report = repair(model)
    assert f"model-00002-of-00004.safetensors: a weight shard that {SAFE_INDEX} does not list" in (
        report.damage
    )
    assert any(f"{len(moved)} tensors named in the wrong shard" in d for d in report.damage)
    assert not any("lost" in d for d in report.damage)
    (action,) = report.actions
    assert f"{len(moved)} moved to the shard that holds them, 0 added, 0 removed" in action.detail
    rebuilt = json.loads((model / SAFE_INDEX).read_text())
    assert rebuilt["metadata"] == original["metadata"]  # total_parameters kept, total_size equal
    assert {k for k, v in rebuilt["weight_map"].items() if "00004" in v} == set(moved)
    _assert_same_weights(_weights(model), _weights(FRAMEWORKS / "hf_sharded"))


def test_a_shard_that_is_gone_stays_lost_and_the_model_does_not_load_random_weights(
    tmp_path: Path,
) -> None:
    """Issue 49: the index is the only record of what a deleted shard held. repair keeps it,
    exits 1 naming the lost tensors, verify still reports the shard, and from_pretrained fails
    on it instead of filling the weights with random values."""
    pytest.importorskip("transformers")
    from ckpttool.commands.verify import verify_file

    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    (model / "model-00002-of-00003.safetensors").unlink()
    original = json.loads((model / SAFE_INDEX).read_text())
    lost = sorted(k for k, v in original["weight_map"].items() if "00002" in v)
    report = repair(model)
    (line,) = [d for d in report.damage if "lost" in d]
    assert line.startswith(
        f"model-00002-of-00003.safetensors: listed in {SAFE_INDEX} but missing: "
        f"{len(lost)} tensors lost ({', '.join(lost[:3])} and {len(lost) - 3} more)"
    )
    assert "the directory stays incomplete" in line
    assert report.unrepaired == (line,) and report.exit_code == 1
    assert json.loads((model / SAFE_INDEX).read_text()) == original  # the record is kept
    assert "model-00002-of-00003.safetensors: listed in" in " ".join(verify_file(model).problems)
    with pytest.raises(OSError, match=re.escape("model-00002-of-00003.safetensors")):
        _weights(model)


def test_a_lost_shard_stays_named_when_the_index_is_rebuilt_for_another_reason(
    tmp_path: Path,
) -> None:
    """A shard renamed (mended: its tensors are found) and another deleted (not: lost): the
    rewritten index names the lost tensors where the old one did, total_size stays the whole
    model's, and repair exits 1."""
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    (model / "model-00001-of-00003.safetensors").rename(model / "model-00001-of-00004.safetensors")
    (model / "model-00002-of-00003.safetensors").unlink()
    original = json.loads((model / SAFE_INDEX).read_text())
    lost = sorted(k for k, v in original["weight_map"].items() if "00002" in v)
    report = repair(model)
    (action,) = report.actions
    assert action.detail.endswith(f"; {len(lost)} lost, kept where the old index named them")
    rebuilt = json.loads((model / SAFE_INDEX).read_text())
    assert {k: v for k, v in rebuilt["weight_map"].items() if k in lost} == {
        k: original["weight_map"][k] for k in lost
    }
    assert rebuilt["weight_map"].keys() == original["weight_map"].keys()
    assert rebuilt["metadata"] == original["metadata"]
    assert report.written and report.exit_code == 1
    assert [d for d in report.unrepaired if "lost" in d] and not any(
        "wrong shard" in d for d in report.unrepaired
    )
    again = repair(model)
    assert again.actions == () and again.exit_code == 1 and again.unrepaired


@pytest.mark.parametrize("case", sorted(SHARDED))
def test_a_numbered_shard_gone_with_the_index_writes_no_index(case: str, tmp_path: Path) -> None:
    """Issue 49: with the index gone too, nothing says what the shard held; an index of the
    other shards would make from_pretrained fill those weights at random. The names' numbering
    shows it is gone: no index is written, and repair exits 1."""
    index_name = SHARDED[case]
    model = _copy(FRAMEWORKS / case, tmp_path)
    shards = sorted(p.name for p in model.iterdir() if "-of-" in p.name)
    (model / shards[1]).unlink()
    (model / index_name).unlink()
    before = _snapshot(model)
    report = repair(model)
    assert report.damage[1].startswith(f"{shards[1]}: missing (the shards are numbered 1 to 3)")
    assert report.actions == () and report.exit_code == 1 and report.unrepaired == report.damage
    assert _snapshot(model) == before


def test_an_index_listing_a_key_in_the_wrong_shard_and_missing_one_is_rebuilt(
    tmp_path: Path,
) -> None:
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    original = json.loads((model / SAFE_INDEX).read_text())
    edited = json.loads(json.dumps(original))
    weight_map = edited["weight_map"]
    wrong = next(k for k, v in weight_map.items() if v == "model-00001-of-00003.safetensors")
    weight_map[wrong] = "model-00003-of-00003.safetensors"
    dropped = next(k for k, v in weight_map.items() if v == "model-00002-of-00003.safetensors")
    del weight_map[dropped]
    (model / SAFE_INDEX).write_text(json.dumps(edited))
    report = repair(model)
    assert report.damage == (
        f"{SAFE_INDEX}: 1 tensor named in the wrong shard (e.g. {wrong}: it says "
        "model-00003-of-00003.safetensors, stored in model-00001-of-00003.safetensors)",
        f"{SAFE_INDEX}: 1 tensor stored but not listed ({dropped})",
    )
    assert "1 moved to the shard that holds them, 1 added, 0 removed" in report.actions[0].detail
    assert json.loads((model / SAFE_INDEX).read_text()) == original


def test_an_unreadable_shard_leaves_the_index_as_it_is(tmp_path: Path) -> None:
    """Its tensors may still be salvaged (``repair FILE``): an index without them would lose
    them for good."""
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    shard = model / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    (model / SAFE_INDEX).unlink()
    before = _snapshot(model)
    report = repair(model)
    assert len(report.damage) == 2 and report.damage[1].startswith(
        "model-00002-of-00003.safetensors: unreadable ("
    )
    assert "the index is not rebuilt until it is repaired" in report.damage[1]
    assert report.actions == () and _snapshot(model) == before


def _duplicate(model: Path, key: str, *, change: bool = False) -> None:
    """A fourth shard holding ``key`` again (the index does not list it)."""
    from safetensors.torch import load_file, save_file

    source = json.loads((model / SAFE_INDEX).read_text())["weight_map"][key]
    tensor = load_file(model / source)[key].clone()
    if change:
        tensor += 1
    save_file({key: tensor}, model / "model-00004-of-00004.safetensors", metadata={"format": "pt"})


def test_a_tensor_in_two_shards_keeps_the_shard_the_index_named(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    key = "model.norm.weight"
    named = json.loads((model / SAFE_INDEX).read_text())["weight_map"][key]
    _duplicate(model, key)
    index_before = (model / SAFE_INDEX).read_bytes()
    report = repair(model)
    assert report.damage == (
        f"model-00004-of-00004.safetensors: a weight shard that {SAFE_INDEX} does not list",
        f"1 tensor stored in {named} and model-00004-of-00004.safetensors, byte-identical "
        f"({key}): the index names {named} (as the old index did)",
    )
    # the index already named the right shard for every tensor: nothing to rewrite
    assert report.actions == () and not report.written
    assert (model / SAFE_INDEX).read_bytes() == index_before
    _assert_same_weights(_weights(model), _weights(FRAMEWORKS / "hf_sharded"))


def test_a_tensor_in_two_shards_without_an_index_takes_the_first_by_name(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    key = "model.norm.weight"
    named = json.loads((model / SAFE_INDEX).read_text())["weight_map"][key]
    _duplicate(model, key)
    (model / SAFE_INDEX).unlink()
    report = repair(model)
    assert (
        f"1 tensor stored in {named} and model-00004-of-00004.safetensors, byte-identical "
        f"({key}): the index names {named} (the first by name)"
    ) in report.damage
    assert json.loads((model / SAFE_INDEX).read_text())["weight_map"][key] == named
    _assert_same_weights(_weights(model), _weights(FRAMEWORKS / "hf_sharded"))


def test_a_tensor_in_two_shards_with_different_values_is_refused(tmp_path: Path) -> None:
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    key = "model.norm.weight"
    named = json.loads((model / SAFE_INDEX).read_text())["weight_map"][key]
    _duplicate(model, key, change=True)
    (model / SAFE_INDEX).unlink()
    before = _snapshot(model)
    with pytest.raises(CorruptCheckpointError) as refused:
        repair(model)
    message = str(refused.value)
    assert "\n" not in message and refused.value.exit_code == 2
    assert message.startswith(f"{model}: {key}: stored in {named} and model-00004-of-00004")
    assert _snapshot(model) == before


def test_a_dry_run_says_what_it_would_write_and_writes_nothing(tmp_path: Path) -> None:
    model = _copy(FRAMEWORKS / "hf_sharded", tmp_path)
    (model / "model-00002-of-00003.safetensors").rename(model / "model-00002-of-00004.safetensors")
    before = _snapshot(model)
    report = repair(model, dry_run=True)
    assert [a.action for a in report.actions] == ["rewrite index"]
    assert not report.written and report.output is None
    assert _snapshot(model) == before


# ------------------------------------------------------------------------------ run directories


def test_a_trainer_run_resumes_from_the_complete_checkpoint_after_quarantine(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, default_data_collator
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    from tests.fixtures.frameworks.models import TokenDataset, llama_model
    from tests.fixtures.frameworks.write_hf import training_arguments

    run = _copy(FRAMEWORKS / "trainer_1proc" / "output", tmp_path, "run")
    (run / "checkpoint-8" / "optimizer.pt").unlink()
    report = repair(run, quarantine=True)
    assert [(Path(c.path).name, c.complete) for c in report.checkpoints] == [
        ("checkpoint-4", True),
        ("checkpoint-8", False),
    ]
    assert report.checkpoints[1].missing == (
        "incomplete: optimizer.pt is missing (written by the framework; its resume needs it)",
    )
    assert report.newest_complete == str(run / "checkpoint-4")
    assert report.damage == (
        "checkpoint-8: incomplete: optimizer.pt is missing (written by the framework; its resume "
        "needs it)",
    )
    (action,) = report.actions
    assert (action.action, action.path) == ("quarantine", str(run / "checkpoint-8"))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "incomplete-checkpoint-8"]
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-4")
    # rotation (save_total_limit) globs checkpoint-*: the moved-aside folder is not counted
    assert sort_checkpoints(str(run)) == [str(run / "checkpoint-4")]

    steps_run: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps_run.append(state.global_step)

    args = training_arguments(str(run))
    args.save_strategy = "no"
    trainer = Trainer(
        model=llama_model().train(), args=args, train_dataset=TokenDataset(),
        data_collator=default_data_collator, callbacks=[Steps()],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=True)  # get_last_checkpoint(output_dir)
    assert steps_run == [5, 6, 7, 8]  # resumed after checkpoint-4's step 4


def test_a_trainer_run_without_quarantine_names_the_complete_checkpoint_and_moves_nothing(
    tmp_path: Path,
) -> None:
    run = _copy(FRAMEWORKS / "trainer_1proc" / "half_written", tmp_path, "run")
    before = _snapshot(run)
    report = repair(run)
    assert report.newest_complete == str(run / "checkpoint-4")
    assert report.damage == (
        "checkpoint-8: incomplete: trainer_state.json is missing (written by the framework; its "
        "resume needs it)",
    )
    assert report.actions == () and not report.written
    assert _snapshot(run) == before


def _tag_broken(save_dir: Path, tag: str) -> None:
    """The tag's model-states file cut in half (an interrupted save)."""
    (path,) = (save_dir / tag).glob("*model_states.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_latest_naming_an_incomplete_tag_is_rewritten(tmp_path: Path) -> None:
    save_dir = _copy(DEEPSPEED / "damaged" / "optim_missing" / "checkpoints", tmp_path)
    assert (save_dir / "latest").read_text() == "global_step4"
    report = repair(save_dir)
    assert [(Path(c.path).name, c.complete) for c in report.checkpoints] == [
        ("global_step2", True),
        ("global_step4", False),
    ]
    assert report.damage == (
        "global_step4: incomplete: zero_pp_rank_1_mp_rank_00_optim_states.pt is missing "
        "(written by the framework; its resume needs it)",
        "latest: names 'global_step4', which is incomplete",
    )
    (action,) = report.actions
    assert (action.action, action.path) == ("rewrite pointer", str(save_dir / "latest"))
    assert "now names 'global_step2'" in action.detail
    assert (save_dir / "latest").read_bytes() == b"global_step2"  # as DeepSpeed writes it


def test_a_missing_latest_is_written(tmp_path: Path) -> None:
    save_dir = _copy(DEEPSPEED / "damaged" / "latest_missing" / "checkpoints", tmp_path)
    report = repair(save_dir)
    assert report.damage == ("latest: missing",)
    assert (save_dir / "latest").read_bytes() == b"global_step4"


def test_quarantine_moves_no_deepspeed_tag(tmp_path: Path) -> None:
    """``load_checkpoint`` loads what ``latest`` names and nothing else: the pointer is the
    repair, the incomplete tag stays where it is."""
    save_dir = _copy(DEEPSPEED / "damaged" / "optim_missing" / "checkpoints", tmp_path)
    report = repair(save_dir, quarantine=True)
    assert [a.action for a in report.actions] == ["rewrite pointer"]
    assert (save_dir / "global_step4").is_dir()


@pytest.mark.slow
def test_deepspeed_loads_the_complete_tag_after_a_dangling_latest_is_repaired(
    tmp_path: Path,
) -> None:
    """``latest`` names a tag that does not exist and the newest tag was cut short: DeepSpeed's
    ``load_checkpoint(dir)`` fails on it; repaired, it loads global_step2."""
    pytest.importorskip("deepspeed")
    save_dir = _copy(DEEPSPEED / "stage0_fp32_1proc" / "checkpoints", tmp_path)
    (save_dir / "latest").write_text("global_step9")
    _tag_broken(save_dir, "global_step4")
    report = repair(save_dir)
    assert report.newest_complete == str(save_dir / "global_step2")
    assert "latest: names 'global_step9', which does not exist" in report.damage
    loaded = _deepspeed_load(save_dir, tmp_path)
    assert loaded["global_steps"] == 2
    assert loaded["load_path"] == str(save_dir / "global_step2" / "mp_rank_00_model_states.pt")


def _deepspeed_load(save_dir: Path, tmp_path: Path) -> dict[str, Any]:
    from tests.support import timeouts
    from tests.test_distributed import clean_env, free_port

    root = Path(__file__).resolve().parents[1]
    env = clean_env()
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(root))
    env.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "ckpttool-torch-extensions")
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(root / "tests" / "workers" / "deepspeed_load_worker.py"),
               str(save_dir), "0", "fp32"]  # fmt: skip
    result = timeouts.run(command, 900, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _resume_files(tmp_path: Path, names: list[str]) -> Path:
    run = tmp_path / "out"
    run.mkdir()
    for name in names:
        shutil.copyfile(FIXTURES / "minimind" / "pretrain_32_resume.pth", run / name)
    return run


def test_a_directory_of_resume_files_names_the_newest_complete_by_step(tmp_path: Path) -> None:
    run = _resume_files(tmp_path, ["step_900.pth", "step_1000.pth", "step_1100.pth"])
    data = (run / "step_1100.pth").read_bytes()
    (run / "step_1100.pth").write_bytes(data[: len(data) * 6 // 10])  # cut at 60%
    report = repair(run, quarantine=True)
    assert [Path(c.path).name for c in report.checkpoints] == [
        "step_900.pth",
        "step_1000.pth",
        "step_1100.pth",
    ]
    assert [c.complete for c in report.checkpoints] == [True, True, False]
    assert report.newest_complete == str(run / "step_1000.pth")
    assert report.damage[0].startswith("step_1100.pth: incomplete: ")
    (action,) = report.actions
    assert (action.action, action.path) == ("quarantine", str(run / "step_1100.pth"))
    assert sorted(p.name for p in run.iterdir()) == [
        "step_1000.pth",
        "step_1100.pth.incomplete",
        "step_900.pth",
    ]
    assert (run / "step_1100.pth.incomplete").read_bytes() == data[: len(data) * 6 // 10]


def test_resume_files_without_steps_are_ordered_by_time(tmp_path: Path) -> None:
    run = _resume_files(tmp_path, ["pretrain_resume.pth", "full_sft_resume.pth"])
    (run / "pretrain_resume.pth").write_bytes(b"")  # an empty file: a save that died at once
    os.utime(run / "full_sft_resume.pth", ns=(1_000_000_000, 1_000_000_000))
    os.utime(run / "pretrain_resume.pth", ns=(2_000_000_000, 2_000_000_000))
    report = repair(run, dry_run=True, quarantine=True)
    assert [Path(c.path).name for c in report.checkpoints] == [
        "full_sft_resume.pth",
        "pretrain_resume.pth",
    ]
    assert report.newest_complete == str(run / "full_sft_resume.pth")
    assert [a.action for a in report.actions] == ["quarantine"] and not report.written
    assert (run / "pretrain_resume.pth").exists()


# ---------------------------------------------------------------------------- leftover temp files


LEFTOVERS = {
    ".pretrain_32_resume.pth.k2j3l4.ckpttool-tmp": "an interrupted ckpttool write",
    "pretrain_32_resume.pth.tmp": "a save interrupted before it renamed its temp file",
    ".cache/huggingface/download/model.safetensors.Xz1.7c4e.incomplete": (
        "an interrupted huggingface_hub download"
    ),
}


def _with_leftovers(tmp_path: Path) -> Path:
    run = _resume_files(tmp_path, ["pretrain_32_resume.pth"])
    for name in LEFTOVERS:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(b"PK\x03\x04partial")
    staged = run / ".out.a8b9.ckpttool-tmp"  # an interrupted staged directory
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"partial")
    (run / "logs.tmp").mkdir()  # a directory named like a temp file is the user's: kept
    (run / "logs.tmp" / "events").write_bytes(b"")
    return run


def test_leftover_temp_files_are_listed_and_kept_without_clean(tmp_path: Path) -> None:
    run = _with_leftovers(tmp_path)
    before = _snapshot(run)
    report = repair(run)
    expected = {f"{name}: leftover temp file of {what}" for name, what in LEFTOVERS.items()}
    expected.add(".out.a8b9.ckpttool-tmp: leftover temp file of an interrupted ckpttool write")
    assert set(report.damage) == expected
    assert report.actions == () and _snapshot(run) == before
    assert report.newest_complete == str(run / "pretrain_32_resume.pth")


def test_clean_removes_the_leftover_temp_files(tmp_path: Path) -> None:
    run = _with_leftovers(tmp_path)
    report = repair(run, clean=True)
    assert sorted(Path(a.path).relative_to(run).as_posix() for a in report.actions) == sorted(
        [*LEFTOVERS, ".out.a8b9.ckpttool-tmp"]
    )
    assert {a.action for a in report.actions} == {"remove"} and report.written
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == [
        "logs.tmp/events",
        "pretrain_32_resume.pth",
    ]


# ---------------------------------------------------------------------- intact and bad input


INTACT = [
    FRAMEWORKS / "hf_sharded",
    FRAMEWORKS / "hf_bin_sharded",
    FRAMEWORKS / "hf_model",
    FRAMEWORKS / "trainer_1proc" / "output",
    FRAMEWORKS / "accelerate_1proc" / "state",
    DEEPSPEED / "stage2_fp32_2proc" / "checkpoints",
    FRAMEWORKS / "lightning" / "checkpoints",
]


@pytest.mark.parametrize("source", INTACT, ids=lambda p: p.relative_to(FIXTURES).as_posix())
def test_an_intact_directory_has_no_damage_and_nothing_is_written(
    source: Path, tmp_path: Path
) -> None:
    directory = _copy(source, tmp_path)
    before = _snapshot(directory)
    report = repair(directory, quarantine=True, clean=True)
    assert report.damage == () and report.actions == () and not report.written
    assert _snapshot(directory) == before


@pytest.mark.parametrize("content", [None, "README.md"])
def test_a_directory_ckpttool_does_not_know_is_a_one_line_error(
    content: str | None, tmp_path: Path
) -> None:
    directory = tmp_path / "notes"
    directory.mkdir()
    if content:
        (directory / content).write_text("# notes\n")
    with pytest.raises(NotADirectoryCheckpointError) as refused:
        repair_directory(directory, quarantine=True, clean=True)
    assert str(refused.value).startswith(f"{directory}: not a directory ckpttool repairs")
    assert "\n" not in str(refused.value) and refused.value.exit_code == 2
    assert sorted(p.name for p in directory.iterdir()) == ([content] if content else [])


def test_a_missing_directory_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(InputError) as refused:
        repair_directory(tmp_path / "gone")
    assert str(refused.value) == f"{tmp_path / 'gone'}: no such directory"
