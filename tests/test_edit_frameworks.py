"""``ckpttool edit`` of framework run directories (issue 30): a Trainer ``checkpoint-N/`` and an
accelerate ``save_state`` folder made for inference, loaded by the frameworks that wrote them
(``from_pretrained``, ``Accelerator.load_state``); a DeepSpeed save and a Trainer
``output_dir`` refused with their reason, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpttool.cli import cli
from ckpttool.commands.edit_directory import edit
from tests.support.helpers import FIXTURES

TRAINER_OUTPUT = FIXTURES / "frameworks" / "trainer_2proc" / "output"
TRAINER = TRAINER_OUTPUT / "checkpoint-8"
ACCELERATE = FIXTURES / "frameworks" / "accelerate_2proc" / "state"
DEEPSPEED = FIXTURES / "deepspeed" / "stage1_fp32_1proc" / "checkpoints"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_trainer_checkpoint_for_inference_is_a_model_directory_from_pretrained_loads(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "inference"
    report = edit(TRAINER, out, for_inference=True)
    assert report.layout == "hf_trainer" and report.written
    assert set(report.files_dropped) == {
        "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
        "trainer_state.json", "training_args.bin",
    }  # fmt: skip
    assert {p.name for p in out.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors",
    }  # fmt: skip
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (TRAINER / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)
    weights = load_file(TRAINER / "model.safetensors")
    state = model.state_dict()
    assert all(_same(state[k], v) for k, v in weights.items())


def test_a_trainer_checkpoint_renamed_and_cast_keeps_its_training_files(tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    report = edit(TRAINER, out, dtype="bf16", keep_dtype=["*norm*"])
    assert report.files_dropped == () and report.cast
    assert {p.name for p in out.iterdir()} == {p.name for p in TRAINER.iterdir()}
    assert (out / "optimizer.pt").read_bytes() == (TRAINER / "optimizer.pt").read_bytes()
    edited = load_file(out / "model.safetensors")
    for key, value in load_file(TRAINER / "model.safetensors").items():
        expected = value if "norm" in key else value.to(torch.bfloat16)
        assert _same(edited[key], expected)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_an_accelerate_folder_for_inference_loads_with_load_state(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from accelerate import Accelerator

    from tests.fixtures.frameworks.models import Progress, llama_model

    out = tmp_path / "inference"
    report = edit(ACCELERATE, out, for_inference=True)
    assert set(report.files_dropped) == {
        "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl",
    }  # fmt: skip
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "custom_checkpoint_0.pkl"}
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(llama_model())
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.load_state(str(out))  # a model and the registered object: nothing else to load
    weights = load_file(ACCELERATE / "model.safetensors")
    state = model.state_dict()
    assert all(_same(state[k], v) for k, v in weights.items())
    assert progress.samples_seen > 0


def test_dry_run_lists_the_files_left_out_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["edit", str(ACCELERATE), "--for-inference", "--dry-run", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert "optimizer.bin" in data["files_dropped"] and data["written"] is False
    assert not out.exists()


@pytest.mark.parametrize(
    ("source", "options", "message"),
    [
        (DEEPSPEED, ["--for-inference"], "zero_to_fp32 reads the fp32 weights from the optimizer"),
        (DEEPSPEED / "global_step4", ["--drop", "*"], "edit does not rewrite a DeepSpeed"),
        (TRAINER_OUTPUT, ["--for-inference"], "with 2 checkpoints"),
        (TRAINER, ["--rename", r"^model\.norm\.weight$=model.embed_tokens.weight"],
         "would both be named"),
    ],
    ids=["deepspeed-save", "deepspeed-tag", "trainer-output", "rename-collides"],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, source: Path, options: list[str], message: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["edit", str(source), *options, "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {source}") and message in lines[0]
    assert list(tmp_path.iterdir()) == []


#: Map rules that cannot apply to the Trainer fixture's model (hidden size 16).
BAD_MAPS = {
    "missing-key": (
        {"from": ["model.norm.weight", "model.no_such.weight"], "to": "model.both.weight",
         "op": "concat", "dim": 0},
        "also needs ['model.no_such.weight']",
    ),
    "split-sizes": (
        {"from": "model.norm.weight", "to": ["model.a.weight", "model.b.weight"], "op": "split",
         "dim": 0, "sizes": [3, 3]},
        "does not split into [3, 3] on dim 0",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_MAPS)
def test_a_bad_map_on_a_trainer_checkpoint_is_exit_2_and_writes_nothing(
    tmp_path: Path, case: str
) -> None:
    rule, message = BAD_MAPS[case]
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps({"unmatched": "keep", "rules": [rule]}))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["edit", str(TRAINER), "--for-inference", "--map", str(map_file), "-o", str(out)]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {TRAINER}") and message in lines[0]
    assert [p.name for p in tmp_path.iterdir()] == ["map.json"]


def test_in_place_replaces_the_trainer_checkpoint_whole(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint-8"
    shutil.copytree(TRAINER, target)
    result = CliRunner().invoke(cli, ["edit", str(target), "--for-inference", "--in-place"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in target.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors",
    }  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-8"]


def test_cast_optimizer_casts_a_trainer_checkpoints_optimizer_file_as_a_files(
    tmp_path: Path,
) -> None:
    """Issue 49 item 3: one option, one meaning on a file and on a folder. ``--dtype`` leaves
    ``optimizer.pt`` as saved (above); ``--cast-optimizer`` casts its moments as it casts a
    resume file's, never its ``step`` counters."""
    out = tmp_path / "bf16"
    report = edit(TRAINER, out, dtype="bf16", cast_optimizer=True)
    original = torch.load(TRAINER / "optimizer.pt", weights_only=True)
    edited = torch.load(out / "optimizer.pt", weights_only=True)
    assert edited["param_groups"] == original["param_groups"]
    for index, state in original["state"].items():
        for name, value in state.items():
            expected = value if name == "step" else value.to(torch.bfloat16)
            assert _same(edited["state"][index][name], expected), (index, name)
    steps = {f"state.{i}.step" for i in original["state"]}
    assert set(report.not_cast) == steps
    assert {k for k in report.cast if k.startswith("state.")} == {
        f"state.{i}.{n}" for i, s in original["state"].items() for n in s if n != "step"
    }
    assert _same(
        load_file(out / "model.safetensors")["model.embed_tokens.weight"],
        load_file(TRAINER / "model.safetensors")["model.embed_tokens.weight"].to(torch.bfloat16),
    )
    for name in ("scheduler.pt", "trainer_state.json"):
        assert (out / name).read_bytes() == (TRAINER / name).read_bytes()


def test_dtype_on_a_folder_reports_the_optimizer_state_it_keeps(tmp_path: Path) -> None:
    """``--dtype`` keeps ``optimizer.pt`` as saved (copied) and says so as for a file: its
    floating tensors (torch.load's of Trainer's own file) are the report's ``not_cast``."""
    report = edit(TRAINER, tmp_path / "bf16", dtype="bf16")
    saved = torch.load(TRAINER / "optimizer.pt", weights_only=True)["state"]
    floating = {f"state.{i}.{n}" for i, s in saved.items() for n, v in s.items() if v.is_floating_point()}  # fmt: skip
    assert floating and set(report.not_cast) == floating
    assert (tmp_path / "bf16" / "optimizer.pt").read_bytes() == (
        TRAINER / "optimizer.pt"
    ).read_bytes()
