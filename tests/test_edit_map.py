"""``ckpttool edit --map``: declarative key maps and the Llama presets (Meta <-> Hugging Face),
checked against transformers' own Llama (its rotary embedding decides what the q/k row
permutation must be) and by round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpttool.commands.edit import edit_file
from ckpttool.errors import InputError

HEADS, KV_HEADS, HIDDEN = 4, 2, 32


def _llama(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / "hf" / "model.pth"
    path.parent.mkdir()
    torch.save(model.state_dict(), path)
    config.to_json_file(path.parent / "config.json")  # the heads come from here
    return path, model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_hf_to_meta_and_back_is_the_identity_and_the_model_still_runs(tmp_path: Path) -> None:
    hf, model = _llama(tmp_path)
    meta = tmp_path / "meta.pth"
    report = edit_file(hf, meta, map_name="llama-hf-to-meta")
    assert {op for op, _, _ in report.mapped} == {"rename", "rope_to_meta"}
    meta_sd = torch.load(meta, weights_only=True)
    assert "layers.0.attention.wq.weight" in meta_sd and "tok_embeddings.weight" in meta_sd
    back = tmp_path / "back.pth"
    edit_file(
        meta,
        back,
        map_name="llama-meta-to-hf",
        map_params={"n_heads": HEADS, "n_kv_heads": KV_HEADS},
    )
    original, returned = model.state_dict(), torch.load(back, weights_only=True)
    assert set(returned) == set(original) - {k for k in original if "rotary" in k}
    for key, value in returned.items():
        assert torch.equal(_bits(value), _bits(original[key])), key
    model.load_state_dict(returned, strict=False)  # the round-tripped weights load and run
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 10, 64)


def _meta_rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Meta's reference rotary: consecutive pairs (2i, 2i+1) as complex numbers."""
    head_dim = x.shape[-1]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(positions.to(torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).reshape(x.shape)


def test_the_permutation_makes_metas_rotary_agree_with_transformers(tmp_path: Path) -> None:
    """q = W x, rotated the Hugging Face way with HF's rows, equals q rotated Meta's way with
    the rows --map gave Meta, once Meta's interleaved pairs are put back in HF's order."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf, model = _llama(tmp_path)
    meta = tmp_path / "meta.pth"
    edit_file(hf, meta, map_name="llama-hf-to-meta")
    meta_sd = torch.load(meta, weights_only=True)
    head_dim = HIDDEN // HEADS
    x = torch.randn(7, HIDDEN, dtype=torch.float64)
    positions = torch.arange(7)
    rotary = LlamaRotaryEmbedding(model.config)
    cos, sin = rotary(x.to(torch.float32), positions.unsqueeze(0))
    for name, meta_name, heads in [("q_proj", "wq", HEADS), ("k_proj", "wk", KV_HEADS)]:
        w_hf = model.state_dict()[f"model.layers.1.self_attn.{name}.weight"].to(torch.float64)
        w_meta = meta_sd[f"layers.1.attention.{meta_name}.weight"].to(torch.float64)
        q_hf = (x @ w_hf.T).reshape(7, heads, head_dim).transpose(0, 1)  # heads, seq, dim
        rotated_hf, _ = apply_rotary_pos_emb(
            q_hf, q_hf, cos.to(torch.float64), sin.to(torch.float64), unsqueeze_dim=0
        )
        q_meta = (x @ w_meta.T).reshape(7, heads, head_dim).transpose(0, 1)
        rotated_meta = _meta_rotary(q_meta, positions, model.config.rope_parameters["rope_theta"])
        # Meta's (2i, 2i+1) pair is HF's (i, i + head_dim/2)
        back_to_hf = torch.cat([rotated_meta[..., 0::2], rotated_meta[..., 1::2]], dim=-1)
        torch.testing.assert_close(
            back_to_hf,
            rotated_hf.squeeze(0) if rotated_hf.dim() > 3 else rotated_hf,
            rtol=1e-5,  # transformers computes cos/sin in float32
            atol=1e-6,
        )


def test_a_map_file_concat_split_transpose(tmp_path: Path) -> None:
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    source = tmp_path / "sd.pth"
    torch.save(
        {"l.0.q": q, "l.0.k": k, "l.0.v": v, "w": torch.randn(3, 5), "b": torch.ones(2)}, source
    )
    fused_map = tmp_path / "fuse.json"
    fused_map.write_text(json.dumps({"unmatched": "keep", "rules": [
        {"from": ["l.{L}.q", "l.{L}.k", "l.{L}.v"], "to": "l.{L}.qkv", "op": "concat", "dim": 0},
        {"from": "w", "to": "w_t", "op": "transpose"}]}))  # fmt: skip
    fused = tmp_path / "fused.pth"
    edit_file(source, fused, map_name=str(fused_map))
    sd = torch.load(fused, weights_only=True)
    assert set(sd) == {"l.0.qkv", "w_t", "b"}
    assert torch.equal(sd["l.0.qkv"], torch.cat([q, k, v])) and torch.equal(
        sd["w_t"], torch.load(source)["w"].T
    )
    split_map = tmp_path / "split.json"
    split_map.write_text(json.dumps({"params": {"kv": 2}, "unmatched": "keep", "rules": [
        {"from": "l.{L}.qkv", "to": ["l.{L}.q", "l.{L}.k", "l.{L}.v"], "op": "split", "dim": 0,
         "sizes": [4, "kv", "kv"]}]}))  # fmt: skip
    split = tmp_path / "split.pth"
    edit_file(fused, split, map_name=str(split_map))
    sd = torch.load(split, weights_only=True)
    assert (
        torch.equal(sd["l.0.q"], q) and torch.equal(sd["l.0.k"], k) and torch.equal(sd["l.0.v"], v)
    )


def test_bad_maps_are_one_line_errors_and_write_nothing(tmp_path: Path) -> None:
    source = tmp_path / "sd.pth"
    torch.save({"a": torch.ones(4, 2), "b": torch.ones(3)}, source)
    cases = [
        ({"rules": [{"from": "a", "to": "x"}]}, "no rule maps 1 tensor"),
        ({"rules": [{"from": "a", "to": "x"}, {"from": "b", "to": "x"}]}, "both map to"),
        (
            {
                "rules": [{"from": "a", "to": ["x", "y"], "op": "split", "sizes": [3, 3]}],
                "unmatched": "keep",
            },
            "does not split",
        ),
        (
            {"rules": [{"from": ["a", "missing"], "to": "x", "op": "concat"}], "unmatched": "keep"},
            "also needs",
        ),
        ({"rules": [{"from": "a", "to": "x", "op": "explode"}]}, "is not one of"),
        (
            {
                "rules": [{"from": "a", "to": "x", "op": "rope_to_hf", "heads": "n"}],
                "unmatched": "keep",
            },
            "needs n",
        ),
    ]
    for number, (data, message) in enumerate(cases):
        path = tmp_path / f"map{number}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(InputError, match=message):
            edit_file(source, tmp_path / "out.pth", map_name=str(path))
    with pytest.raises(InputError, match="not a preset"):
        edit_file(source, tmp_path / "out.pth", map_name="no-such-map")
    assert not (tmp_path / "out.pth").exists()
