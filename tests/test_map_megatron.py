"""The presets ``megatron-gpt-to-hf-llama`` and ``hf-llama-to-megatron-gpt`` (issue 30), and the
map operations they need: ``split_qkv`` / ``concat_qkv`` (Megatron-Core's fused QKV rows,
grouped by query group) and ``split`` into equal parts.

The oracle is the two libraries' own forwards: a tiny Llama-shaped megatron-core 0.16.1
``GPTModel`` (RMSNorm, SwiGLU, rotary, 4 query heads in 2 query groups, no biases, untied
output layer) runs on CPU in a process of its own (tests/support/megatron_gpt.py); its state
dict mapped by ckpttool loads strictly into transformers' ``LlamaForCausalLM``, whose logits on
the same input must match megatron-core's. The reverse: a transformers model's weights mapped
to Megatron's names load into megatron-core, whose logits must match transformers'."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.convert.run import convert
from ckpttool.commands.diff.run import diff
from ckpttool.commands.edit import edit_file
from ckpttool.errors import InputError
from ckpttool.model.mapping import load_map
from tests.support.megatron_gpt import GROUPS, HEADS, HF_CONFIG, IDS

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "frameworks" / "megatron"
PARAMS = {"n_heads": HEADS, "n_kv_heads": GROUPS}
TO_HF, TO_MEGATRON = "megatron-gpt-to-hf-llama", "hf-llama-to-megatron-gpt"
QKV0 = "decoder.layers.0.self_attention.linear_qkv.weight"


def _megatron(out: Path, state: Path | None = None) -> torch.Tensor:
    """Runs tests/support/megatron_gpt.py into ``out``; megatron-core's logits."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": str(port)}
    command = [sys.executable, "-m", "tests.support.megatron_gpt", str(out)]
    result = subprocess.run(
        command + ([str(state)] if state else []), env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "logits.pt", weights_only=True)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """The megatron-core model's folder (state.pt, legacy/) and its logits."""
    out = tmp_path_factory.mktemp("megatron_gpt")
    return out, _megatron(out)


def _llama(weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG, attn_implementation="eager")).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_megatron_gpt_maps_to_a_llama_that_computes_the_same_logits(
    megatron: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, expected = megatron
    out = tmp_path / "llama.safetensors"
    report = convert(folder / "state.pt", out, map_name=TO_HF, map_params=PARAMS)
    assert report is not None
    weights = _load(out)
    model = _llama(weights)  # strict: every Llama tensor, nothing else
    assert torch.allclose(_logits(model), expected, atol=1e-4, rtol=1e-4)
    # the split is megatron-core's own (get_query_key_value_tensors): rows [ng, np/ng + 2, hn],
    # q the first np/ng heads of each group, then k, then v; moved bit for bit
    source = torch.load(folder / "state.pt", weights_only=True)
    fused = source[QKV0]
    head = fused.shape[0] // (GROUPS * (HEADS // GROUPS + 2))
    grouped = fused.view(GROUPS, HEADS // GROUPS + 2, head, -1)
    q, k, v = torch.split(grouped, [HEADS // GROUPS, 1, 1], dim=1)
    layer = "model.layers.0."
    assert torch.equal(weights[layer + "self_attn.q_proj.weight"], q.reshape(-1, fused.shape[1]))
    assert torch.equal(weights[layer + "self_attn.k_proj.weight"], k.reshape(-1, fused.shape[1]))
    assert torch.equal(weights[layer + "self_attn.v_proj.weight"], v.reshape(-1, fused.shape[1]))
    gate, up = torch.chunk(source["decoder.layers.0.mlp.linear_fc1.weight"], 2, dim=0)
    assert torch.equal(weights[layer + "mlp.gate_proj.weight"], gate)
    assert torch.equal(weights[layer + "mlp.up_proj.weight"], up)


@pytest.mark.parametrize("layout", ["legacy", "dist/iter_0000001"])
def test_a_megatron_checkpoint_gives_the_map_its_heads_from_args(
    megatron: tuple[Path, torch.Tensor], tmp_path: Path, layout: str
) -> None:
    """Megatron-LM's legacy shards (local spec names) and a torch_dist directory (layers
    stacked, Transformer Engine's norm names) of the same model."""
    folder, expected = megatron
    out = tmp_path / "llama.safetensors"
    # no --map-param: num_attention_heads and num_query_groups come from the checkpoint's args
    result = CliRunner().invoke(cli, ["convert", str(folder / layout), str(out), "--map", TO_HF])
    assert result.exit_code == 0, result.output
    assert "2 split_qkv" in result.output
    assert torch.allclose(_logits(_llama(_load(out))), expected, atol=1e-4, rtol=1e-4)
    # diff --map pairs the Megatron checkpoint with its Llama conversion: every tensor the same
    report = diff(folder / layout, out, map_name=TO_HF)
    assert report.equal, report.summary()
    assert len(report.tensors) == len(_load(out))


def test_transformer_engine_norm_names_and_megatron_lms_prefix_map_too(
    megatron: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, _ = megatron
    plain = tmp_path / "plain.safetensors"
    convert(folder / "state.pt", plain, map_name=TO_HF, map_params=PARAMS)
    te_names = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    state = torch.load(folder / "state.pt", weights_only=True)
    renamed = {}
    for key, value in state.items():
        for local, te in te_names.items():
            key = key.replace(local, te)
        renamed["model." + key] = value
    te_file = tmp_path / "te.pt"
    torch.save(renamed, te_file)
    mapped = tmp_path / "te.safetensors"
    convert(te_file, mapped, map_name=TO_HF, map_params=PARAMS)
    a, b = _load(plain), _load(mapped)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hf_llama_maps_to_megatron_gpt_that_computes_the_same_logits(tmp_path: Path) -> None:
    model = _llama()
    hf = tmp_path / "hf"
    model.save_pretrained(hf)  # config.json beside: num_attention_heads, num_key_value_heads
    out = tmp_path / "megatron.safetensors"
    convert(hf, out, map_name=TO_MEGATRON)
    logits = _megatron(tmp_path, out)
    assert torch.allclose(logits, _logits(model), atol=1e-4, rtol=1e-4)


def test_megatron_to_hf_and_back_is_bit_exact(
    megatron: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, _ = megatron
    hf = tmp_path / "hf.pth"
    edit_file(folder / "state.pt", hf, map_name=TO_HF, map_params=PARAMS)
    back = tmp_path / "back.pth"
    edit_file(hf, back, map_name=TO_MEGATRON, map_params=PARAMS)
    original = torch.load(folder / "state.pt", weights_only=True)
    again = torch.load(back, weights_only=True)
    assert list(again) == [k for k in original if k in again] and again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_the_committed_megatron_fixtures_are_refused_naming_what_llama_lacks() -> None:
    # those GPTs have LayerNorm biases and learned position embeddings: no Llama place for them
    with pytest.raises(InputError, match=r"no rule maps .*position_embeddings"):
        convert(FIXTURES / "legacy_glu_tp2", None, map_name=TO_HF, to="safetensors")


def test_split_qkv_checks_the_rows_against_heads_and_groups(
    megatron: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, _ = megatron
    # 4 heads in 3 groups do not divide; 4 heads in 4 groups make 4 x 6 rows, not the 64 held
    for heads, groups, message in ((4, 3, "does not split into 3 query groups"),
                                   (4, 4, "does not split into 4 query groups")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            convert(folder / "state.pt", tmp_path / "x.safetensors", map_name=TO_HF,
                    map_params={"n_heads": heads, "n_kv_heads": groups})  # fmt: skip
    assert not (tmp_path / "x.safetensors").exists()


def test_qkv_rules_need_heads_and_groups() -> None:
    rule = {"from": "qkv", "to": ["q", "k", "v"], "op": "split_qkv", "heads": "h"}
    with pytest.raises(InputError, match="split_qkv needs groups"):
        load_map_data({"rules": [rule]})
    with pytest.raises(InputError, match="takes three sources"):
        load_map_data(
            {
                "params": {"h": 2, "g": 1},
                "rules": [
                    {
                        "from": ["q", "k"],
                        "to": "qkv",
                        "op": "concat_qkv",
                        "heads": "h",
                        "groups": "g",
                    }
                ],
            }
        )


def load_map_data(data: dict[str, object]) -> object:
    from ckpttool.model.mapping import _spec

    return _spec("test.json", data, {}, None)


def test_the_presets_ask_for_their_heads() -> None:
    with pytest.raises(InputError, match="needs n_heads"):
        load_map(TO_HF, {})
    spec = load_map(TO_MEGATRON, {}, facts=[{"num_attention_heads": 4, "num_query_groups": 2}])
    assert spec.params == PARAMS


def test_a_split_without_sizes_makes_equal_parts_or_refuses(tmp_path: Path) -> None:
    import json

    src = tmp_path / "w.pth"
    torch.save({"even": torch.arange(12.0).view(6, 2), "odd": torch.arange(10.0).view(5, 2)}, src)
    rules = [{"from": "even", "to": ["a", "b"], "op": "split"}, {"from": "odd", "to": "odd"}]
    spec = tmp_path / "map.json"
    spec.write_text(json.dumps({"rules": rules}))
    edit_file(src, tmp_path / "out.pth", map_name=str(spec))
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert torch.equal(out["a"], torch.arange(6.0).view(3, 2))
    assert torch.equal(out["b"], torch.arange(6.0, 12.0).view(3, 2))
    rules[0]["from"], rules[1]["from"] = "odd", "even"
    spec.write_text(json.dumps({"rules": rules}))
    with pytest.raises(InputError, match=r"odd \[5, 2\] does not split into"):
        edit_file(src, tmp_path / "out2.pth", map_name=str(spec))
