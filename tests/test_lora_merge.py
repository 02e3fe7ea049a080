"""``ckpttool lora merge`` against PEFT's own ``merge_and_unload()`` (the oracle, written beside
each adapter in tests/fixtures/frameworks/peft/ by tests/fixtures/frameworks/write_peft.py).

Comparisons go through ckpttool's diff. float32 merges are compared with a tight tolerance
(``rtol=1e-6, atol=1e-7``), not bit for bit: ckpttool's product (NumPy) and PEFT's (torch) may
accumulate in another order and differ in the last bit. (The fixtures' dyadic values happen to
make every product exact, so today they are identical.) A bfloat16 base is compared with PEFT's
bfloat16 merge within one bfloat16 rounding (PEFT rounds the update to bfloat16 before adding
it, ckpttool rounds once), and with PEFT's float32 merge of the same weights after rounding.
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
from ckpttool.commands.lora.merge import merge_adapter
from tests.support.helpers import FIXTURES

PEFT = FIXTURES / "frameworks" / "peft"
RTOL, ATOL = 1e-6, 1e-7
#: One bfloat16 rounding: half a unit in the last of its 8 significant bits, relative.
BF16_RTOL = 2.0**-8


def run(*args: Any, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result


def assert_close(a: Path, b: Path, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    report = diff(a, b, rtol=rtol, atol=atol)
    assert report.equal, report.summary() + "".join(
        f"\n{t.key}: {t.status}" for t in report.tensors if t.status != "identical"
    )


@pytest.mark.parametrize(
    ("base", "adapter", "changed"),
    [
        ("base", "lora", 7),  # rank/alpha patterns, modules_to_save lm_head
        ("base", "lora_bin", 7),  # the same adapter as adapter_model.bin
        ("base", "rslora", 8),  # alpha / sqrt(r)
        ("gpt2_base", "gpt2_lora", 6),  # fan_in_fan_out: Conv1D weights [in, out]
        ("base", "dora", 4),  # magnitude vectors
        ("base", "embedding", 3),  # lora_embedding_A/B, on the saved embed_tokens.base_layer
    ],
)
def test_the_merge_is_what_merge_and_unload_gives(
    tmp_path: Path, base: str, adapter: str, changed: int
) -> None:
    out = tmp_path / "merged"
    report = merge_adapter(PEFT / base, PEFT / adapter, out)
    assert len(report.merged) == changed and report.verified and report.directory
    oracle = PEFT / f"{adapter.removesuffix('_bin')}_merged"
    assert_close(out, oracle)
    assert not diff(out, PEFT / base).equal  # the merge changed something
    assert (out / "config.json").read_bytes() == (PEFT / base / "config.json").read_bytes()


def test_modules_to_save_replace_and_patterns_scale(tmp_path: Path) -> None:
    report = merge_adapter(PEFT / "base", PEFT / "lora", tmp_path / "merged")
    how = {m.name: (m.how, m.rank, m.scaling) for m in report.merged}
    assert how["lm_head.weight"] == ("replaced", None, None)
    assert how["model.layers.0.mlp.down_proj.weight"] == ("lora", 2, 4.0)
    assert how["model.layers.1.self_attn.q_proj.weight"] == ("lora", 4, 2.0)


def test_a_bfloat16_base_stays_bfloat16_within_one_rounding(tmp_path: Path) -> None:
    out = tmp_path / "merged"
    report = merge_adapter(PEFT / "bf16_base", PEFT / "lora", out)
    assert {m.dtype for m in report.merged} == {"bfloat16"}
    assert_close(out, PEFT / "bf16_merged", rtol=BF16_RTOL, atol=0)
    # every tensor is PEFT's float32 merge rounded to bfloat16 (config.json's dtype differs)
    rounded = diff(out, PEFT / "bf16_merged_fp32", rounded=True)
    assert {t.status for t in rounded.tensors} == {"equal_after_rounding"}, rounded.summary()


def test_transformers_loads_the_merged_directory(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    merge_adapter(PEFT / "base", PEFT / "lora", out)
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    theirs = AutoModelForCausalLM.from_pretrained(PEFT / "lora_merged").eval()
    ids = torch.tensor([[1, 5, 9, 33, 60, 2]])
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-6)


def test_an_embedding_lora_is_applied_to_the_saved_base_layer(tmp_path: Path) -> None:
    report = merge_adapter(PEFT / "base", PEFT / "embedding", tmp_path / "merged")
    how = {m.name: m.how for m in report.merged}
    assert how["model.embed_tokens.weight"] == "replaced+lora"


def test_a_tied_tensor_in_a_pth_is_refused(tmp_path: Path) -> None:
    """lm_head.weight and model.embed_tokens.weight as one storage (``torch.save`` of a tied
    model's state dict): replacing lm_head would change the embedding too."""
    from safetensors.torch import load_file

    weights = load_file(PEFT / "base/model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    base = tmp_path / "tied.pth"
    torch.save(weights, base)
    result = run("lora", "merge", base, PEFT / "lora", "-o", tmp_path / "out.pth", exit_code=2)
    assert result.stderr.startswith(f"Error: {base}: lm_head.weight is tied to ")
    assert "model.embed_tokens.weight" in result.stderr and "untie them first" in result.stderr
    assert not (tmp_path / "out.pth").exists()


def test_max_shard_size_writes_a_sharded_model_directory(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    run("lora", "merge", PEFT / "base", PEFT / "lora", "-o", out, "--max-shard-size", "40000")
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "model-00001-of-00003.safetensors" in names
    assert_close(out, PEFT / "lora_merged")
    AutoModelForCausalLM.from_pretrained(out)  # loads the shards through the index


def test_an_adapter_in_a_trainer_checkpoint_merges(tmp_path: Path) -> None:
    report = merge_adapter(PEFT / "base", PEFT / "trainer/checkpoint-2", tmp_path / "merged")
    assert len(report.merged) == 4  # q_proj and v_proj of 2 layers


def state_dict_without_prefix(tmp_path: Path) -> Path:
    """The base as a bare ``torch.save`` state dict of ``model.model`` (no ``model.`` prefix)."""
    from safetensors.torch import load_file

    weights = load_file(PEFT / "base/model.safetensors")
    path = tmp_path / "base.pth"
    torch.save({k.removeprefix("model."): v for k, v in weights.items()}, path)
    return path


def test_a_file_base_gives_a_file_of_its_format(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    safetensors = tmp_path / "base.safetensors"
    shutil.copy(PEFT / "base/model.safetensors", safetensors)
    out = tmp_path / "merged.safetensors"
    report = merge_adapter(safetensors, PEFT / "rslora", out)
    assert (report.format, report.directory, report.outputs) == ("safetensors", False, [out])
    assert_close(out, PEFT / "rslora_merged/model.safetensors")

    pth = state_dict_without_prefix(tmp_path)  # names matched across the missing "model."
    out = tmp_path / "merged.pth"
    report = merge_adapter(pth, PEFT / "rslora", out)
    assert report.format == "pth"
    assert "layers.0.mlp.up_proj.weight" in {m.name for m in report.merged}
    merged = torch.load(out, weights_only=True)
    expected = load_file(PEFT / "rslora_merged/model.safetensors")
    assert sorted(merged) == sorted(k.removeprefix("model.") for k in expected)
    for key, value in expected.items():
        assert torch.allclose(merged[key.removeprefix("model.")], value, rtol=RTOL, atol=ATOL)


def test_a_file_keeps_its_format(tmp_path: Path) -> None:
    safetensors = tmp_path / "base.safetensors"
    shutil.copy(PEFT / "base/model.safetensors", safetensors)
    result = run("lora", "merge", safetensors, PEFT / "lora", "-o", tmp_path / "m.pth", exit_code=2)
    assert "the base is a .safetensors file and the merged output keeps its format" in result.stderr
    assert not (tmp_path / "m.pth").exists()


def test_the_cli_prints_what_changed_and_json(tmp_path: Path) -> None:
    text = run("lora", "merge", PEFT / "base", PEFT / "lora", "-o", tmp_path / "a").stdout
    assert "wrote model directory" in text and "lora: model.layers.0.mlp.down_proj.weight" in text
    data = json.loads(run("lora", "merge", PEFT / "base", PEFT / "lora", "-o", tmp_path / "b",
                          "--json").stdout)  # fmt: skip
    assert data["directory"] is True and data["copied"] == ["config.json", "generation_config.json"]
    assert len(data["merged"]) == 7
    result = run("lora", "merge", PEFT / "base", PEFT / "lora", "-o", tmp_path / "b", exit_code=2)
    assert "pass --force" in result.stderr
    run("lora", "merge", PEFT / "base", PEFT / "lora", "-o", tmp_path / "b", "--force")


# --- refused: one line, exit 2, nothing written -----------------------------------------------


def broken_adapter(tmp_path: Path) -> Path:
    """The ``lora`` adapter with q_proj's lora_B of layer 0 cut to rank 3."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "adapter"
    shutil.copytree(PEFT / "lora", copy)
    tensors = load_file(copy / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[key] = tensors[key][:, :3].contiguous()
    save_file(tensors, copy / "adapter_model.safetensors", metadata={"format": "pt"})
    return copy


def unreadable_config(tmp_path: Path) -> Path:
    copy = tmp_path / "adapter"
    shutil.copytree(PEFT / "lora", copy)
    (copy / "adapter_config.json").write_text("{not json")
    return copy


@pytest.mark.parametrize(
    ("make", "where", "message"),
    [
        (lambda t: (PEFT / "gpt2_base", PEFT / "rslora"), "base",
         "the adapter's target model.layers.0.mlp.gate_proj.weight is not in the base"),
        (lambda t: (PEFT / "base", broken_adapter(t)), "adapter",
         "model.layers.0.self_attn.q_proj: rank mismatch: lora_A [4, 32] has rank 4, lora_B [32, 3]"),
        (lambda t: (PEFT / "base", unreadable_config(t)), "config", "not valid JSON"),
        (lambda t: (PEFT / "lora", PEFT / "lora"), "base", "is an adapter, not a base model"),
        (lambda t: (PEFT / "tied_base", PEFT / "tied_lm_head"), "base",
         "tied to the input embedding (tie_word_embeddings), so merging would change both"),
        (lambda t: (PEFT / "tied_base", PEFT / "embedding"), "base",
         "the adapter changes model.embed_tokens.weight, the input embedding, which the model "
         "directory ties lm_head.weight to"),
        (lambda t: (PEFT / "base", PEFT / "base"), "adapter", "not an adapter directory"),
    ],
    ids=["target-not-in-base", "rank-mismatch", "unreadable-config", "adapter-as-base", "tied",
         "tied-input-embedding", "base-as-adapter"],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path: Path, make: Any, where: str, message: str
) -> None:
    base, adapter = make(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = run("lora", "merge", base, adapter, "-o", out_dir / "merged", exit_code=2)
    path = {"base": base, "adapter": adapter, "config": adapter / "adapter_config.json"}[where]
    assert result.stderr.startswith(f"Error: {path}: ")
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert list(out_dir.iterdir()) == []  # no output, no temp files


def test_a_merged_tensor_that_does_not_read_back_removes_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-back compares each merged tensor with the CRC-32 of the bytes computed: a
    mismatch (simulated: every digest after the 7 taken while writing is wrong) is exit 1 and
    leaves no output."""
    from ckpttool.commands.convert import run as convert_run

    real = convert_run._digest
    calls = {"n": 0}

    def digest(data: Any) -> bytes:
        calls["n"] += 1
        return real(data) if calls["n"] <= 7 else b"\0\0\0\0"

    monkeypatch.setattr(convert_run, "_digest", digest)
    out = tmp_path / "merged"
    result = run("lora", "merge", PEFT / "base", PEFT / "lora", "-o", out, exit_code=1)
    assert "does not read back bit-for-bit equal" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
