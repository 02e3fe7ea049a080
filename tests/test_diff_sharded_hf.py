"""``diff`` of each sharded training layout against a Hugging Face model directory of the same
weights (issue 28, item 5): a per-rank FSDP2 set against ``save_pretrained`` of its oracle, a
Lightning sharded directory and a torchtitan ``step-N/`` against a model directory written from
what torch's own DCP loader reads of them (torchtitan's Meta-style Llama names mapped with
``--map llama-meta-to-hf``, its ``wq`` permuted here by Meta's conversion rule).

Identical weights: exit 0; one tensor changed in B: that tensor differs, under its name, exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpttool.cli import cli
from tests.test_framework_reading import FRAMEWORKS

RANK_SETS = FRAMEWORKS / "rank_sets"
LIGHTNING = FRAMEWORKS / "lightning_sharded/checkpoints/epoch=2-step=4"
TORCHTITAN = FRAMEWORKS / "torchtitan/checkpoint/step-3"


def _diff(a: Path, b: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["diff", str(a), str(b), "--json", *extra])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _statuses(report: dict[str, Any]) -> dict[str, str]:
    return {entry["key"]: entry["status"] for entry in report["tensors"]}


def _change_one(directory: Path, key: str) -> None:
    """``directory/model.safetensors`` with ``key``'s first element changed."""
    path = directory / "model.safetensors"
    weights = load_file(path)
    changed = weights[key].clone()
    changed.view(-1)[0] += 1.0
    weights[key] = changed
    save_file(weights, path, metadata={"format": "pt"})


def _dcp_tree(directory: Path, tmp_path: Path) -> dict[str, Any]:
    """What torch's own loader reads of a DCP directory (``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "dcp_tree.pt"
    dcp_to_torch_save(directory, out)
    tree: dict[str, Any] = torch.load(out, weights_only=False)
    return tree


def _model_directory(path: Path, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    path.mkdir()
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_verl_set_against_save_pretrained_of_its_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(RANK_SETS / "verl/huggingface")
    model = transformers.AutoModelForCausalLM.from_config(config)
    oracle = torch.load(RANK_SETS / "verl_full_state_dict.pt", weights_only=True)
    model.load_state_dict(oracle)
    hf = tmp_path / "huggingface"
    model.save_pretrained(hf)
    code, report = _diff(RANK_SETS / "verl", hf)
    assert code == 0, report["summary"]
    statuses = _statuses(report)
    assert set(statuses.values()) == {"identical"}
    assert "model.layers.1.mlp.up_proj.weight" in statuses
    _change_one(hf, "model.layers.1.mlp.up_proj.weight")
    code, report = _diff(RANK_SETS / "verl", hf)
    assert code == 1
    statuses = _statuses(report)
    assert statuses.pop("model.layers.1.mlp.up_proj.weight") == "differ"
    assert set(statuses.values()) == {"identical"}


def test_fsdp2_set_against_a_model_directory_of_its_oracle(tmp_path: Path) -> None:
    oracle = torch.load(RANK_SETS / "fsdp2_full_state_dict.pt", weights_only=True)
    hf = _model_directory(tmp_path / "hf", oracle, {"model_type": "tiny"})
    code, report = _diff(RANK_SETS / "fsdp2", hf)
    assert code == 0, report["summary"]
    assert report["summary"]["identical"] == len(oracle)
    _change_one(hf, "proj.weight")
    code, report = _diff(RANK_SETS / "fsdp2", hf)
    assert code == 1
    assert _statuses(report)["proj.weight"] == "differ"
    assert report["summary"]["identical"] == len(oracle) - 1


@pytest.mark.parametrize("as_directory", [True, False])
def test_lightning_sharded_against_the_same_weights(tmp_path: Path, as_directory: bool) -> None:
    model = _dcp_tree(LIGHTNING, tmp_path)["model"]
    if as_directory:
        b = _model_directory(tmp_path / "hf", model, {"model_type": "tiny"})
        target = b / "model.safetensors"
    else:
        b = target = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in model.items()}, target)
    code, report = _diff(LIGHTNING, b)
    assert code == 0, report["summary"]
    assert report["summary"]["identical"] == len(model)
    weights = load_file(target)
    weights["net.fc1.weight"] = weights["net.fc1.weight"] * 2
    save_file(weights, target)
    code, report = _diff(LIGHTNING, b)
    assert code == 1
    assert _statuses(report)["net.fc1.weight"] == "differ"
    assert report["summary"]["identical"] == len(model) - 1


def _meta_to_hf(model: dict[str, torch.Tensor], n_heads: int) -> dict[str, torch.Tensor]:
    """Meta's Llama names and q layout as Hugging Face's (transformers'
    ``convert_llama_weights_to_hf.py``: ``permute``)."""
    wq = model["layers.0.attention.wq.weight"]
    rows, columns = wq.shape
    q = wq.view(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)
    return {
        "model.embed_tokens.weight": model["tok_embeddings.weight"],
        "model.layers.0.self_attn.q_proj.weight": q,
        "lm_head.weight": model["output.weight"],
    }


def test_torchtitan_step_against_an_hf_directory_with_the_llama_map(tmp_path: Path) -> None:
    tree = _dcp_tree(TORCHTITAN, tmp_path)
    model = {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
    assert sorted(model) == [
        "layers.0.attention.wq.weight",
        "output.weight",
        "tok_embeddings.weight",
    ]
    config = {
        "model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }  # fmt: skip
    hf = _model_directory(tmp_path / "hf", _meta_to_hf(model, 2), config)
    code, report = _diff(TORCHTITAN, hf, "--map", "llama-meta-to-hf")
    assert code == 0, report["summary"]
    assert report["summary"]["identical"] == 3
    assert report["summary"]["only_a"] == report["summary"]["only_b"] == 0
    _change_one(hf, "model.layers.0.self_attn.q_proj.weight")
    code, report = _diff(TORCHTITAN, hf, "--map", "llama-meta-to-hf")
    assert code == 1
    assert _statuses(report)["model.layers.0.self_attn.q_proj.weight"] == "differ"
    assert report["summary"]["identical"] == 2
