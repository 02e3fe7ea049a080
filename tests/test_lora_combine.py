"""``average``/``merge`` of PEFT LoRA adapters: one adapter of summed rank whose delta is the
combination of theirs (PEFT's ``add_weighted_adapter(..., combination_type="cat")``), loaded by
``PeftModel.from_pretrained``; the methods no adapter can hold refused in one line.

The adapters are written by PEFT (``get_peft_model`` over the tiny Llama of
tests/fixtures/frameworks/peft/base, ``init_lora_weights=False`` so that ``lora_B`` is not 0),
and PEFT is the oracle: each adapter merged into the base by ``merge_and_unload()``, the models
combined in float64 here, against the output adapter merged by PEFT. Float32 factors, so
``rtol=1e-5, atol=1e-6`` (the deltas are about 0.01).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from ckpttool.cli import cli
from ckpttool.commands.average import PROVENANCE_KEY, average
from ckpttool.commands.merge import merge
from tests.support.helpers import FIXTURES
from tests.test_json_schemas import assert_valid

PEFT = FIXTURES / "frameworks" / "peft"
RTOL, ATOL = 1e-5, 1e-6


def base_model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(PEFT / "base")


def write_adapter(path: Path, seed: int, **config: Any) -> Path:
    """An adapter saved by PEFT's ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base_model(), LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(path)
    return path


def merged(adapter: Path) -> dict[str, torch.Tensor]:
    """The base with ``adapter`` merged by PEFT, in float64."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model(), adapter).merge_and_unload()
    return {k: v.double() for k, v in model.state_dict().items()}


def assert_combination(out: Path, adapters: list[Path], coefficients: list[float]) -> None:
    """``out`` merged by PEFT is ``sum_i c_i (base + delta_i)`` (the c_i sum to 1)."""
    models = [merged(a) for a in adapters]
    got = merged(out)
    for key, value in got.items():
        want = sum(c * m[key] for c, m in zip(coefficients, models))
        torch.testing.assert_close(value, want, rtol=RTOL, atol=ATOL, msg=key)


def test_the_mean_of_two_adapters_is_their_deltas_mean_as_peft_cat_makes_it(
    tmp_path: Path,
) -> None:
    # the same targets and rank: the old average took mean(B) @ mean(A), far from the mean
    from peft import PeftModel

    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    a = write_adapter(tmp_path / "a", 0, **config)
    b = write_adapter(tmp_path / "b", 1, **config)
    out = tmp_path / "avg"
    report = average([a, b], out, weights=[3, 1])
    assert report.format == "adapter" and report.output == out
    assert_combination(out, [a, b], [0.75, 0.25])
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["r"] == written["lora_alpha"] == 8 and written["use_rslora"] is False
    with safe_open(out / "adapter_model.safetensors", "pt") as opened:
        facts = json.loads(opened.metadata()[PROVENANCE_KEY])
    assert [i["weight"] for i in facts["inputs"]] == [0.75, 0.25]
    # PEFT's own cat of the two, merged, is the same model
    model = PeftModel.from_pretrained(base_model(), a, adapter_name="a")
    model.load_adapter(b, adapter_name="b")
    model.add_weighted_adapter(["a", "b"], [0.75, 0.25], "cat", combination_type="cat")
    model.set_adapter("cat")
    peft_cat = {k: v.double() for k, v in model.merge_and_unload().state_dict().items()}
    for key, value in merged(out).items():
        torch.testing.assert_close(value, peft_cat[key], rtol=RTOL, atol=ATOL, msg=key)


def test_adapters_of_other_ranks_targets_scales_and_a_saved_module(tmp_path: Path) -> None:
    # per-module ranks (rank_pattern), rsLoRA's alpha/sqrt(r), a module only one adapts, and
    # lm_head saved whole by both (averaged as the weights it replaces)
    a = write_adapter(tmp_path / "a", 2, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["lm_head"], task_type="CAUSAL_LM")  # fmt: skip
    b = write_adapter(tmp_path / "b", 3, r=4, lora_alpha=8, use_rslora=True,
                      target_modules=["q_proj", "down_proj"], modules_to_save=["lm_head"],
                      task_type="CAUSAL_LM")  # fmt: skip
    c = write_adapter(tmp_path / "c", 4, r=3, lora_alpha=3, target_modules=["v_proj"],
                      modules_to_save=["lm_head"], task_type="CAUSAL_LM")  # fmt: skip
    out = tmp_path / "avg"
    result = CliRunner().invoke(cli, ["average", str(a), str(b), str(c), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert_valid("average", data)
    assert data["format"] == "adapter"
    assert_combination(out, [a, b, c], [1 / 3] * 3)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["modules_to_save"] == ["lm_head"]
    ranks = {m: config["rank_pattern"].get(m.replace(".", "\\."), config["r"])
             for m in config["target_modules"]}  # fmt: skip
    assert ranks["model.layers.0.self_attn.q_proj"] == 6  # 2 + 4
    assert ranks["model.layers.0.self_attn.v_proj"] == 5  # 2 + 3
    assert ranks["model.layers.0.mlp.down_proj"] == 4


def test_merge_linear_and_task_arithmetic_of_adapters(tmp_path: Path) -> None:
    config = {"r": 2, "lora_alpha": 2, "target_modules": ["k_proj", "up_proj"]}
    base, m1, m2 = (write_adapter(tmp_path / n, s, **config) for s, n in enumerate("xyz"))
    out = tmp_path / "ta"
    report = merge(base, [m1, m2], out, method="task-arithmetic", lam=0.5, weights=[1, 2])
    assert report.format == "adapter"
    # base + 0.5 (1 (m1 - base) + 2 (m2 - base)) = -0.5 base + 0.5 m1 + 1 m2
    assert_combination(out, [base, m1, m2], [-0.5, 0.5, 1.0])
    merge(base, [m1, m2], tmp_path / "lin", method="linear", weights=[1, 1, 2])
    assert_combination(tmp_path / "lin", [base, m1, m2], [0.25, 0.25, 0.5])


def one_line_error(args: list[Any], fragment: str, out: Path) -> None:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert fragment in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        (["merge", "{a}", "{b}", "--method", "ties"], "--method ties of LoRA adapters would act on lora_A and lora_B"),
        (["merge", "{a}", "{b}", "--method", "slerp", "--t", "0.5"], "ckpttool lora merge BASE ADAPTER"),
        (["average", "{a}", str(PEFT / "dora")], "DoRA adapter rescales the merged weight"),
        (["average", "{a}", str(PEFT / "base")], "is a LoRA adapter and"),
        (["average", "{a}", "{b}", "--like-input"], "--like-input is not for LoRA adapters"),
        (["average", "{a}", str(PEFT / "lora")], "saves the modules"),
        (["average", str(PEFT / "embedding"), str(PEFT / "embedding")], "is adapted and saved whole"),
    ],
)  # fmt: skip
def test_what_no_adapter_holds_is_refused_in_one_line(
    tmp_path: Path, command: list[str], fragment: str
) -> None:
    # these used to be done on lora_A and lora_B separately (or refused for the output's name)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    a = write_adapter(tmp_path / "a", 0, **config)
    b = write_adapter(tmp_path / "b", 1, **config)
    out = tmp_path / "out"
    args = [part.format(a=a, b=b) for part in command]
    one_line_error([*args, "-o", out], fragment, out)
    one_line_error(["average", a, b, "-o", tmp_path / "o.safetensors"], "name OUT as a directory",
                   tmp_path / "o.safetensors")  # fmt: skip
