"""``--map`` beyond ``edit``: ``diff --map`` (A's names mapped into B's, values computed one
tensor at a time), ``convert --map`` and ``convert --use-ema`` (edit's semantics, through the
shared options), and the presets ``minimind-to-hf-llama`` / ``hf-llama-to-minimind`` and
``llama-gguf-to-hf`` (checked against transformers' Llama and against a GGUF written by
llama.cpp's rules, tests/fixtures/gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.convert.run import convert
from ckpttool.commands.diff.run import DIFFER, IDENTICAL, ONLY_A, diff
from ckpttool.commands.edit import edit_file
from ckpttool.errors import InputError
from tests.fixtures.gguf import GGUF_DIR, HF_LLAMA, hf_llama_weights, write_hf_llama_gguf
from tests.support.minimind import MiniMindConfig, MiniMindForCausalLM

GGUF_LLAMA = GGUF_DIR / "llama_hf.gguf"
HEADS, KV_HEADS = HF_LLAMA["num_attention_heads"], HF_LLAMA["num_key_value_heads"]
Q1 = "model.layers.1.self_attn.q_proj.weight"
K1 = "model.layers.1.self_attn.k_proj.weight"


def _hf_model(changed: str | None = None) -> torch.nn.Module:
    """transformers' LlamaForCausalLM holding :func:`hf_llama_weights` (``changed``: that
    tensor's first element plus one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**HF_LLAMA)).eval()
    weights = {k: torch.from_numpy(v) for k, v in hf_llama_weights().items()}
    if changed is not None:
        weights[changed] = weights[changed].clone()
        weights[changed].view(-1)[0] += 1
    model.load_state_dict(weights, strict=True)
    return model


def _hf_dir(tmp_path: Path, changed: str | None = None) -> Path:
    """A model directory written by save_pretrained (config.json gives the map its heads)."""
    target = tmp_path / ("hf_changed" if changed else "hf")
    _hf_model(changed).save_pretrained(target)
    return target


def _hf_file(tmp_path: Path) -> Path:
    """The same weights as a torch.save state dict, its config.json beside it."""
    model = _hf_model()
    folder = tmp_path / "hf_file"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "model.pth")
    model.config.to_json_file(folder / "config.json")
    return folder / "model.pth"


def _statuses(report: object) -> dict[str, str]:
    return {entry.key: entry.status for entry in report.tensors}  # type: ignore[attr-defined]


# diff --map: Meta <-> Hugging Face


def test_diff_map_compares_a_meta_conversion_with_its_hf_original(tmp_path: Path) -> None:
    hf_file = _hf_file(tmp_path)
    meta = tmp_path / "meta.pth"
    edit_file(hf_file, meta, map_name="llama-hf-to-meta")
    # without the map nothing pairs; with it, every tensor is the same bits (q/k permuted back)
    assert not diff(meta, hf_file).equal
    report = diff(meta, hf_file, map_name="llama-meta-to-hf", map_params={"n_heads": HEADS,
                                                                          "n_kv_heads": KV_HEADS})  # fmt: skip
    assert report.equal, report.summary()
    assert set(_statuses(report).values()) == {IDENTICAL}
    assert len(report.tensors) == len(hf_llama_weights())
    assert report.a.map == "llama-meta-to-hf"
    # A's records keep A's own names: the report says where each tensor came from
    rows = {entry.key: entry for entry in report.tensors}
    assert rows["model.embed_tokens.weight"].a.key == "tok_embeddings.weight"


def test_diff_map_finds_a_changed_tensor_under_its_mapped_name(tmp_path: Path) -> None:
    hf_file = _hf_file(tmp_path)
    meta = tmp_path / "meta.pth"
    edit_file(hf_file, meta, map_name="llama-hf-to-meta")
    weights = torch.load(meta, weights_only=True)
    weights["layers.1.attention.wk.weight"][3, 5] += 0.5
    weights["rope.freqs"] = torch.ones(4)  # a tensor no rule maps
    torch.save(weights, meta)
    runner = CliRunner()
    params = ["--map-param", f"n_heads={HEADS}", "--map-param", f"n_kv_heads={KV_HEADS}"]
    result = runner.invoke(
        cli, ["diff", str(meta), str(hf_file), "--map", "llama-meta-to-hf", *params, "--json"]
    )
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    statuses = {row["key"]: row["status"] for row in payload["tensors"]}
    assert statuses[K1] == DIFFER
    assert statuses["rope.freqs"] == ONLY_A  # reported as today: under its own name
    assert [k for k, s in statuses.items() if s == DIFFER] == [K1]
    assert payload["a"]["map"] == "llama-meta-to-hf"
    assert "no rule maps, compared under their own names: rope.freqs" in result.stderr


def test_diff_map_errors_name_the_map(tmp_path: Path) -> None:
    hf_file = _hf_file(tmp_path)
    result = CliRunner().invoke(cli, ["diff", str(hf_file), str(hf_file), "--map", "nope.json"])
    assert result.exit_code == 2
    assert "--map nope.json: no such file, and not a preset" in result.stderr


# diff --map llama-gguf-to-hf (issue 29 item 4)


def test_gguf_written_by_llama_cpps_rules_equals_its_hf_model(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path)
    result = CliRunner().invoke(
        cli, ["diff", str(GGUF_LLAMA), str(hf), "--map", "llama-gguf-to-hf", "--rounded"]
    )
    assert result.exit_code == 0, result.output
    report = diff(GGUF_LLAMA, hf, map_name="llama-gguf-to-hf")  # heads from hf/config.json
    assert report.equal
    assert len(report.tensors) == len(hf_llama_weights())
    for entry in report.tensors:  # F16 and F32 values equal to B's float32 ones exactly
        assert entry.values is not None and entry.values.mismatched == 0, entry.key
        assert entry.values.max_abs_diff == 0, entry.key
    assert {entry.key: entry.a.key for entry in report.tensors}[Q1] == "blk.1.attn_q.weight"


def test_gguf_diff_finds_a_changed_tensor_and_the_permutation_matters(tmp_path: Path) -> None:
    changed = _hf_dir(tmp_path, changed=K1)
    report = diff(GGUF_LLAMA, changed, map_name="llama-gguf-to-hf")
    differ = [entry.key for entry in report.tensors if entry.status == DIFFER]
    assert differ == [K1]
    # names alone (no rope_to_hf) leave q and k in llama.cpp's row order: they differ
    names_only = tmp_path / "names_only.json"
    from ckpttool.model.mapping import PRESETS

    rules = [{"from": r["from"], "to": r["to"]} for r in PRESETS["llama-gguf-to-hf"]["rules"]]
    names_only.write_text(json.dumps({"rules": rules}))
    report = diff(GGUF_LLAMA, _hf_dir(tmp_path), map_name=str(names_only))
    differ = {entry.key for entry in report.tensors if entry.status == DIFFER}
    assert differ == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qk"}


def test_a_quantized_gguf_is_mapped_through_its_decoded_values(tmp_path: Path) -> None:
    """Q8_0 q/k rows are decoded, then put back in Hugging Face's order: within Q8_0's error of
    the model's values (and far from them without the permutation)."""
    q8 = tmp_path / "llama_q8_0.gguf"
    write_hf_llama_gguf(q8, quantized="Q8_0")
    hf = _hf_dir(tmp_path)
    report = diff(q8, hf, map_name="llama-gguf-to-hf", atol=1 / 127, rtol=0)
    assert report.equal, report.summary()
    rows = {entry.key: entry for entry in report.tensors}
    assert rows[Q1].a.dtype == "float32" and rows[Q1].a.key == "blk.1.attn_q.weight"
    assert 0 < rows[Q1].values.max_abs_diff <= 1 / 127  # quantized: not exact, but close
    out = tmp_path / "q8.safetensors"
    with pytest.raises(InputError, match="quantized in blocks"):  # convert asks for it
        convert(q8, out, map_name="llama-gguf-to-hf")
    convert(q8, out, map_name="llama-gguf-to-hf", dequantize=True)
    assert diff(out, hf, atol=1 / 127, rtol=0).equal


def test_the_gguf_preset_names_what_gguf_py_names() -> None:
    """The preset's names are gguf-py's TensorNameMap's for MODEL_ARCH.LLAMA."""
    gguf = pytest.importorskip("gguf")
    from ckpttool.model.mapping import PRESETS

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 4)
    for rule in PRESETS["llama-gguf-to-hf"]["rules"]:
        hf = rule["to"].replace("{L}", "3")
        assert names.get_name(hf, try_suffixes=(".weight",)) == rule["from"].replace("{L}", "3")


def test_convert_maps_a_gguf_to_hf_safetensors(tmp_path: Path) -> None:
    """The heads come from the GGUF's own llama.attention.head_count(_kv)."""
    out = tmp_path / "from_gguf.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(GGUF_LLAMA), str(out), "--map",
                                      "llama-gguf-to-hf", "--dtype", "fp32"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = diff(out, _hf_dir(tmp_path))
    assert report.equal and set(_statuses(report).values()) == {IDENTICAL}


# convert --map / --use-ema: edit's semantics


def test_convert_map_writes_what_edit_map_writes(tmp_path: Path) -> None:
    hf_file = _hf_file(tmp_path)
    edited, converted = tmp_path / "edited.pth", tmp_path / "converted.safetensors"
    edit_file(hf_file, edited, map_name="llama-hf-to-meta")
    result = CliRunner().invoke(
        cli, ["convert", str(hf_file), str(converted), "--map", "llama-hf-to-meta"]
    )
    assert result.exit_code == 0, result.output
    assert "--map llama-hf-to-meta: 17 renamed, 4 rope_to_meta" in result.stderr
    report = diff(edited, converted)
    assert report.equal and set(_statuses(report).values()) == {IDENTICAL}
    assert len(report.tensors) == len(hf_llama_weights())


def test_convert_map_after_drop_and_rename_as_edit(tmp_path: Path) -> None:
    hf_file = _hf_file(tmp_path)
    options = {"drop": ["lm_head.weight"], "rename": [r"^model\.norm=model.final_norm"]}
    keep_map = tmp_path / "map.json"
    keep_map.write_text(json.dumps({"unmatched": "keep", "rules": [
        {"from": "model.final_norm.weight", "to": "norm.weight"}]}))  # fmt: skip
    edited, converted = tmp_path / "edited.pth", tmp_path / "converted.safetensors"
    edit_file(hf_file, edited, map_name=str(keep_map), **options)
    convert(hf_file, converted, map_name=str(keep_map), **options)
    report = diff(edited, converted)
    assert report.equal and "norm.weight" in _statuses(report)
    assert "lm_head.weight" not in _statuses(report)


def test_convert_map_refuses_a_map_that_leaves_tensors_unmapped(tmp_path: Path) -> None:
    hf_file = _hf_file(tmp_path)
    out = tmp_path / "out.safetensors"
    with pytest.raises(InputError, match="no rule maps"):
        convert(hf_file, out, map_name="llama-gguf-to-hf")
    assert not out.exists()


def _timm_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """timm's train.py checkpoint: ``state_dict`` and ``state_dict_ema`` (plus a counter)."""
    torch.manual_seed(0)
    model = {"conv.weight": torch.randn(4, 3, 3, 3), "bn.running_mean": torch.randn(4)}
    ema = {k: v + 1 for k, v in model.items() if k != "bn.running_mean"}
    path = tmp_path / "timm.pth.tar"
    torch.save({"epoch": 3, "arch": "tiny", "state_dict": model, "state_dict_ema": ema}, path)
    return path, model, ema


def test_convert_use_ema_swaps_the_ema_in_as_edit_does(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path, model, ema = _timm_file(tmp_path)
    out = tmp_path / "ema.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--use-ema"])
    assert result.exit_code == 0, result.output
    written = load_file(out)
    assert set(written) == set(model)
    assert torch.equal(written["conv.weight"], ema["conv.weight"])
    assert torch.equal(written["bn.running_mean"], model["bn.running_mean"])  # EMA lacks it
    assert "state_dict_ema" in result.stderr
    edited = tmp_path / "edited.pth"
    edit_file(path, edited, use_ema="")
    assert diff(edited, out).equal


def test_convert_use_ema_without_an_ema_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "plain.pth"
    torch.save({"model": {"w": torch.ones(2)}, "step": 1}, path)
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out), "--use-ema"])
    assert result.exit_code == 2
    assert "no EMA weights found" in result.stderr and not out.exists()


# MiniMind <-> Hugging Face Llama


def _minimind(tmp_path: Path, **shape: object) -> tuple[Path, MiniMindForCausalLM]:
    torch.manual_seed(1)
    model = MiniMindForCausalLM(MiniMindConfig(**shape)).eval()  # type: ignore[arg-type]
    path = tmp_path / "minimind.pth"
    torch.save(model.state_dict(), path)
    return path, model


def test_minimind_mapped_to_hf_llama_gives_miniminds_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MiniMind's weights, through the preset, load into transformers' LlamaForCausalLM
    (strict) and give MiniMind's logits. The test MiniMind has no rotary embedding (a real
    one rotates halves as transformers does), so Llama's is switched off for the comparison."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import LlamaConfig, LlamaForCausalLM

    path, minimind = _minimind(tmp_path)
    out = tmp_path / "hf_llama.pth"
    edit_file(path, out, map_name="minimind-to-hf-llama")
    c = minimind.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True, hidden_act="silu",
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(torch.load(out, weights_only=True), strict=True)
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda q, k, *args, **kwargs: (q, k))
    ids = torch.randint(0, c.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, minimind(ids), rtol=1e-4, atol=1e-5)
    back = tmp_path / "back.pth"
    edit_file(out, back, map_name="hf-llama-to-minimind")
    assert diff(back, path).equal


def test_minimind_moe_has_no_llama_counterpart(tmp_path: Path) -> None:
    path, _ = _minimind(tmp_path, use_moe=True)
    with pytest.raises(InputError, match=r"no rule maps .*mlp\.experts\.0"):
        edit_file(path, tmp_path / "out.pth", map_name="minimind-to-hf-llama")


def test_the_cli_lists_every_preset() -> None:
    from ckpttool.cli.options import MAP_PRESETS
    from ckpttool.model.mapping import PRESETS

    assert set(MAP_PRESETS) == set(PRESETS)


def test_miniminds_rotary_is_transformers_llama_rotary() -> None:
    """Why the MiniMind preset permutes nothing: MiniMind's rotary embedding (its
    ``precompute_freqs_cis``: cos/sin of each frequency repeated over both halves; its
    ``apply_rotary_pos_emb``: ``x*cos + rotate_half(x)*sin``, theta 1e6) is transformers'
    Llama rotary for the same theta, on the same rows."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from ckpttool.model.mapping import PRESETS

    for name in ("minimind-to-hf-llama", "hf-llama-to-minimind"):
        assert {rule.get("op", "rename") for rule in PRESETS[name]["rules"]} == {"rename"}
    head_dim, seq, theta = 8, 6, 1e6
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    cos_mm = torch.cat([torch.cos(angles), torch.cos(angles)], dim=-1)
    sin_mm = torch.cat([torch.sin(angles), torch.sin(angles)], dim=-1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)

    x = torch.randn(1, seq, 2, head_dim, generator=torch.Generator().manual_seed(3))
    minimind = x * cos_mm.unsqueeze(1) + rotate_half(x) * sin_mm.unsqueeze(1)
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, rope_theta=theta)
    assert config.rope_parameters["rope_theta"] == theta
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(seq).unsqueeze(0))
    hf, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(hf.transpose(1, 2), minimind, rtol=1e-5, atol=1e-6)
