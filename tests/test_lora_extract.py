"""``ckpttool lora extract``: a fine-tune whose difference from its base has a known rank (PEFT's
``merge_and_unload()`` of a rank-4 adapter, tests/fixtures/frameworks/peft/) extracted at that
rank, loaded by PEFT and merged back.

The SVD is exact only up to float32 rounding, so merged-back weights are compared with
``rtol=1e-5, atol=1e-6`` (the fixture's weights are about 0.06, their differences about 0.01).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.diff.run import diff
from ckpttool.commands.lora.extract import extract_adapter
from ckpttool.commands.lora.merge import merge_adapter
from tests.support.helpers import FIXTURES

PEFT = FIXTURES / "frameworks" / "peft"
RTOL, ATOL = 1e-5, 1e-6


def run(*args: Any, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result


def test_a_rank_4_difference_extracted_at_4_merges_back(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    report = extract_adapter(PEFT / "base", PEFT / "rslora_merged", adapter, rank=4)
    assert len(report.extracted) == 8 and report.modules_to_save == []
    assert all(e.rank == 4 and e.energy > 1 - 1e-6 for e in report.extracted)
    merge_adapter(PEFT / "base", adapter, tmp_path / "merged")
    back = diff(tmp_path / "merged", PEFT / "rslora_merged", rtol=RTOL, atol=ATOL)
    assert back.equal, back.summary()


def test_peft_loads_the_extracted_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    extract_adapter(PEFT / "base", PEFT / "rslora_merged", adapter, rank=4)
    base = AutoModelForCausalLM.from_pretrained(PEFT / "base")
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(PEFT / "rslora_merged").state_dict()
    for key, value in tuned.items():
        assert torch.allclose(merged[key], value, rtol=RTOL, atol=ATOL), key


def test_a_lower_rank_keeps_less_and_says_how_much(tmp_path: Path) -> None:
    report = extract_adapter(PEFT / "base", PEFT / "rslora_merged", tmp_path / "a", rank=2)
    energies = [e.energy for e in report.extracted]
    assert all(0 < e < 0.999 for e in energies)
    # lm_head was replaced by a full-rank copy: rank 4 keeps only part of it
    report = extract_adapter(PEFT / "base", PEFT / "lora_merged", tmp_path / "b", rank=4)
    by_name = {e.name: e for e in report.extracted}
    assert by_name["lm_head.weight"].energy < 0.5
    assert by_name["model.layers.0.mlp.down_proj.weight"].energy > 1 - 1e-6  # rank 2 in it


def test_an_embedding_difference_is_an_embedding_lora(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    extract_adapter(PEFT / "base", PEFT / "embedding_merged", adapter, rank=32)  # full rank
    keys = json.loads(run("show", adapter, "--json").stdout)["details"]["adapter"]["modules"]
    kinds = {m["module"]: m["kind"] for m in keys}
    assert kinds["model.embed_tokens"] == "embedding"
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(PEFT / "base"), adapter)
    weights = merged.merge_and_unload().state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(PEFT / "embedding_merged").state_dict()
    for key, value in tuned.items():
        assert torch.allclose(weights[key], value, rtol=RTOL, atol=ATOL), key


def tuned_with_a_norm(tmp_path: Path) -> Path:
    """The rslora fine-tune with one RMSNorm scale changed too (no LoRA can hold it)."""
    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "tuned"
    shutil.copytree(PEFT / "rslora_merged", tuned)
    weights = load_file(tuned / "model.safetensors")
    weights["model.layers.1.input_layernorm.weight"] += 0.25
    save_file(weights, tuned / "model.safetensors", metadata={"format": "pt"})
    return tuned


def test_a_differing_norm_is_saved_whole_or_refused_with_strict(tmp_path: Path) -> None:
    tuned = tuned_with_a_norm(tmp_path)
    report = extract_adapter(PEFT / "base", tuned, tmp_path / "adapter", rank=4)
    assert report.modules_to_save == ["model.layers.1.input_layernorm"]
    merge_adapter(PEFT / "base", tmp_path / "adapter", tmp_path / "merged")
    back = diff(tmp_path / "merged", tuned, rtol=RTOL, atol=ATOL)
    assert back.equal, back.summary()
    result = run("lora", "extract", PEFT / "base", tuned, "--rank", "4", "-o",
                 tmp_path / "strict", "--strict", exit_code=2)  # fmt: skip
    assert result.stderr.startswith(f"Error: {tuned}: model.layers.1.input_layernorm.weight ")
    assert not (tmp_path / "strict").exists()


def test_the_cli_reports_each_tensor_and_refuses_an_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    text = run("lora", "extract", PEFT / "base", PEFT / "rslora_merged", "--rank", "4", "-o", out)
    assert "rank 4 keeps 100.00% of the difference" in text.stdout
    result = run("lora", "extract", PEFT / "base", PEFT / "rslora_merged", "--rank", "4",
                 "-o", out, exit_code=2)  # fmt: skip
    assert "pass --force" in result.stderr
    run("lora", "extract", PEFT / "base", PEFT / "rslora_merged", "--rank", "2", "-o", out,
        "--force")  # fmt: skip
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2


@pytest.mark.parametrize(
    ("base", "tuned", "rank", "message"),
    [
        (PEFT / "base", PEFT / "gpt2_base", "4", "which the other does not"),
        (PEFT / "base", PEFT / "base", "4", "holds the same weights as"),
        (PEFT / "base", PEFT / "rslora_merged", "0", "--rank must be at least 1"),
    ],
    ids=["other-names", "no-difference", "rank-0"],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path: Path, base: Path, tuned: Path, rank: str, message: str
) -> None:
    out = tmp_path / "adapter"
    result = run("lora", "extract", base, tuned, "--rank", rank, "-o", out, exit_code=2)
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_auto_peft_model_loads_the_adapter_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # task_type from the base's architectures (LlamaForCausalLM: CAUSAL_LM) and the base as an
    # absolute path: AutoPeftModelForCausalLM finds both from any cwd (task_type used to be
    # null and the base path relative as typed)
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(FIXTURES.parent.parent)  # the repository root: BASE typed relative
    base = PEFT.relative_to(Path.cwd()) / "base"
    adapter = tmp_path / "adapter"
    report = extract_adapter(base, PEFT / "rslora_merged", adapter, rank=4)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    merged = AutoPeftModelForCausalLM.from_pretrained(adapter).merge_and_unload().state_dict()
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(PEFT / "rslora_merged").state_dict()
    for key, value in tuned.items():
        assert torch.allclose(merged[key], value, rtol=RTOL, atol=ATOL), key
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert report.task_type == config["task_type"] == "CAUSAL_LM" and report.notes == []
    assert config["base_model_name_or_path"] == str((PEFT / "base").resolve())


def test_task_type_is_an_option_and_a_base_without_config_gets_a_note(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "adapter"
    result = run("lora", "extract", PEFT / "base", PEFT / "rslora_merged", "--rank", "4",
                 "-o", adapter, "--task-type", "SEQ_CLS", "--json")  # fmt: skip
    assert json.loads(result.stdout)["task_type"] == "SEQ_CLS"
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    save_file(load_file(PEFT / "base" / "model.safetensors"), tmp_path / "base.safetensors")
    result = run("lora", "extract", tmp_path / "base.safetensors", PEFT / "rslora_merged",
                 "--rank", "4", "-o", tmp_path / "bare", "--json")  # fmt: skip
    data = json.loads(result.stdout)
    assert data["task_type"] is None and "pass --task-type" in data["notes"][0]
    assert "note: task_type not set" in result.stderr
    result = run("lora", "extract", PEFT / "base", PEFT / "rslora_merged", "--rank", "4",
                 "-o", tmp_path / "x", "--task-type", "LM", exit_code=2)  # fmt: skip
    assert "--task-type must be one of CAUSAL_LM" in result.stderr
    assert not (tmp_path / "x").exists()
