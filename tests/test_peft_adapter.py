"""PEFT adapter directories (ckpttool/frameworks/peft/) on the adapters PEFT 0.21 wrote
(tests/fixtures/frameworks/peft/): one checkpoint in show, verify, diff and scan; what show
reports of the config; what verify checks of the factors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpttool import open_checkpoint
from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

PEFT = FIXTURES / "frameworks" / "peft"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def run(*args: Any, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result


def adapter_of(path: Path) -> dict[str, Any]:
    data = json.loads(run("show", path, "--json").stdout)
    assert data["layout"] == "peft_adapter"
    summary: dict[str, Any] = data["details"]["adapter"]
    return summary


def test_an_adapter_directory_is_one_checkpoint() -> None:
    with open_checkpoint(PEFT / "lora") as ckpt:
        assert ckpt.details["layout"] == "peft_adapter"
        assert ckpt.details["complete"] is True
        keys = [record.key for record in ckpt.tensors()]
    assert len(keys) == 13 and f"model.{LORA_B}" in keys


def test_show_gives_rank_alpha_scaling_patterns_targets_and_saved_modules() -> None:
    summary = adapter_of(PEFT / "lora")
    assert (summary["peft_type"], summary["r"], summary["lora_alpha"]) == ("LORA", 4, 8)
    assert summary["scaling"] == 2.0  # alpha / r
    assert summary["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert summary["modules_to_save"] == ["lm_head"]
    assert summary["base_model"] == "base"
    assert summary["rank_pattern"] == {"down_proj": 2}
    by_module = {m["module"]: m for m in summary["modules"]}
    assert len(by_module) == 6
    down = by_module["model.layers.0.mlp.down_proj"]
    assert (down["rank"], down["alpha"], down["scaling"]) == (2, 8.0, 4.0)  # from the patterns
    assert (down["in_features"], down["out_features"]) == (64, 32)
    v = by_module["model.layers.1.self_attn.v_proj"]
    assert (v["rank"], v["scaling"], v["in_features"], v["out_features"]) == (4, 2.0, 32, 16)
    assert summary["saved"] == [
        {"module": "lm_head.weight", "key": "base_model.model.lm_head.weight", "shape": [64, 32]}
    ]
    text = run("show", PEFT / "lora").stdout
    assert "adapter:    LORA, r 4, lora_alpha 8, scaling 2 (alpha/r), 6 adapted modules" in text
    assert "  r 2, alpha 8, scaling 4: 2 modules (model.layers.0.mlp.down_proj, " in text
    assert "saved:      lm_head.weight" in text
    assert "base model: base" in text


def test_rslora_scales_by_the_square_root_of_the_rank() -> None:
    summary = adapter_of(PEFT / "rslora")
    assert summary["use_rslora"] is True and summary["scaling"] == 4.0  # 8 / sqrt(4)
    assert {m["scaling"] for m in summary["modules"]} == {4.0}
    assert "scaling 4 (alpha/sqrt(r), rsLoRA)" in run("show", PEFT / "rslora").stdout


def test_dora_magnitudes_and_fan_in_fan_out_are_shown() -> None:
    dora = adapter_of(PEFT / "dora")
    assert dora["use_dora"] is True
    assert all(m["magnitude"].endswith(".lora_magnitude_vector") for m in dora["modules"])
    assert "DoRA:       magnitude vectors of 4 modules" in run("show", PEFT / "dora").stdout
    gpt2 = adapter_of(PEFT / "gpt2_lora")
    assert gpt2["fan_in_fan_out"] is True
    assert "fan_in_fan_out: base weights stored [in, out]" in run("show", PEFT / "gpt2_lora").stdout


def test_a_bin_adapter_reads_as_the_safetensors_one() -> None:
    assert adapter_of(PEFT / "lora_bin")["modules"] == adapter_of(PEFT / "lora")["modules"]


def test_an_adapter_in_a_trainer_checkpoint_is_the_adapter_with_the_trainer_files() -> None:
    data = json.loads(run("show", PEFT / "trainer/checkpoint-2", "--json").stdout)
    assert data["layout"] == "peft_adapter"  # not a Trainer checkpoint missing its weights
    details = data["details"]
    assert details["global_step"] == 2
    roles = {m["name"]: m["role"] for m in details["members"]}
    assert roles["adapter_model.safetensors"] == "weights"
    assert roles["optimizer.pt"] == "optimizer" and roles["trainer_state.json"] == "trainer_state"
    assert len(details["adapter"]["modules"]) == 4


def test_a_trainer_output_dir_counts_a_checkpoint_holding_an_adapter_as_complete() -> None:
    data = json.loads(run("show", PEFT / "trainer", "--json").stdout)
    assert [(c["name"], c["complete"], c["missing"]) for c in data["checkpoints"]] == [
        ("checkpoint-2", True, [])
    ]


def test_rescale_step_still_rescales_the_trainer_checkpoint_around_an_adapter() -> None:
    """The adapter's plug-in comes first in detection but rescales nothing: the Trainer's files
    are rescaled as the Hugging Face plug-in plans it."""
    result = run("rescale-step", PEFT / "trainer/checkpoint-2", "--world-size", "2", "--dry-run")
    assert "trainer_state.json: global_step 2 -> 1" in result.stdout


def test_verify_scan_and_diff_take_an_adapter_as_one_checkpoint() -> None:
    assert "OK (directory)" in run("verify", PEFT / "lora").stdout
    run("scan", PEFT / "lora")
    run("diff", PEFT / "lora", PEFT / "lora_bin")  # the same tensors, .bin and safetensors


def broken_copy(tmp_path: Path, edit: Any) -> Path:
    """The ``lora`` adapter with its safetensors rewritten by ``edit`` (a dict of tensors)."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "adapter"
    shutil.copytree(PEFT / "lora", copy)
    tensors = load_file(copy / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, copy / "adapter_model.safetensors", metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda t: t.__setitem__(LORA_B, t[LORA_B][:, :3].contiguous()),
            "model.layers.0.self_attn.q_proj: rank mismatch: lora_A [4, 32] has rank 4, "
            "lora_B [32, 3] has rank 3",
        ),
        (lambda t: t.pop(LORA_B), "model.layers.0.self_attn.q_proj: has lora_A but no lora_B"),
        (
            lambda t: t.update(
                {k: t[k][:1].contiguous() for k in list(t) if "down_proj.lora_A" in k}
                | {k: t[k][:, :1].contiguous() for k in list(t) if "down_proj.lora_B" in k}
            ),
            "model.layers.0.mlp.down_proj: the config gives rank 2, the factors have 1",
        ),
    ],
    ids=["rank-mismatch", "no-lora-B", "rank-not-the-configs"],
)
def test_verify_finds_factors_that_do_not_fit(tmp_path: Path, edit: Any, problem: str) -> None:
    adapter = broken_copy(tmp_path, edit)
    result = run("verify", adapter, exit_code=1)
    assert f"problem: {problem}" in result.stdout
    result = run("show", adapter, exit_code=2)  # show refuses an inconsistent directory
    assert result.stderr.startswith(f"Error: {adapter}: ") and result.stderr.count("\n") == 1


def test_an_unreadable_adapter_config_is_one_line(tmp_path: Path) -> None:
    copy = tmp_path / "adapter"
    shutil.copytree(PEFT / "lora", copy)
    (copy / "adapter_config.json").write_text("{broken")
    result = run("show", copy, exit_code=2)
    assert result.stderr.startswith(f"Error: {copy / 'adapter_config.json'}: not valid JSON")
    assert "not valid JSON" in run("verify", copy, exit_code=1).stdout


def test_another_peft_type_is_shown_by_type_and_not_merged(tmp_path: Path) -> None:
    """An IA3 adapter (written here by PEFT): its scaling vectors are not LoRA modules or saved
    copies, and lora merge refuses it."""
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(PEFT / "base")
    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    get_peft_model(model, config).save_pretrained(tmp_path / "ia3")
    summary = adapter_of(tmp_path / "ia3")
    assert (summary["peft_type"], summary["modules"], summary["saved"]) == ("IA3", [], [])
    assert run("show", tmp_path / "ia3").stdout.count("adapter:    IA3\n") == 1
    result = run(
        "lora", "merge", PEFT / "base", tmp_path / "ia3", "-o", tmp_path / "m", exit_code=2
    )
    assert "peft_type is IA3; only LoRA merges" in result.stderr


@pytest.mark.parametrize("source", ["lora_bin", "trainer/checkpoint-2"])
def test_convert_of_an_adapter_directory_is_an_adapter_directory_peft_loads(
    tmp_path: Path, source: str
) -> None:
    # convert ADAPTER_DIR/ OUT/ used to stop ("cannot tell the output format"): it writes
    # adapter_model.safetensors and the config copied, which PeftModel loads, tensors equal
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    run("convert", PEFT / source, out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]  # fmt: skip
    config = (PEFT / source / "adapter_config.json").read_bytes()
    assert (out / "adapter_config.json").read_bytes() == config
    written = load_file(out / "adapter_model.safetensors")
    weights = PEFT / source / "adapter_model.bin"
    stored = (torch.load(weights, weights_only=True) if weights.exists()
              else load_file(weights.with_suffix(".safetensors")))  # fmt: skip
    assert sorted(written) == sorted(stored)
    assert all(torch.equal(written[k], stored[k]) for k in stored)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(PEFT / "base"), out)
    original = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(PEFT / "base"), PEFT / source
    )
    want = original.merge_and_unload().state_dict()
    for key, value in loaded.merge_and_unload().state_dict().items():
        assert torch.equal(value, want[key]), key
    result = run("convert", PEFT / source, tmp_path / "sharded", "--max-shard-size", "4KB",
                 exit_code=2)  # fmt: skip
    assert "not shards: drop --max-shard-size" in result.stderr
    assert not (tmp_path / "sharded").exists()
