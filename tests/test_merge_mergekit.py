"""ckpttool merge against mergekit itself (the pinned mergekit==0.1.5, its own ``run_merge``):
tiny Hugging Face Llama folders written by transformers (a base and two fine-tunes), merged by
mergekit on CPU with its defaults and by ``ckpttool merge`` with the same parameters; every
tensor of the two outputs must agree within a few units of rounding (docs/merge.md).

The inputs are on a grid so that nothing but rounding can separate the two: every base value
is a multiple of 2^-12 and every task vector a distinct multiple of 2^-14 (a permutation of
1..n, random signs), so ``x - b`` is exact in float32 as in float64 and no two entries of a
task vector have the same magnitude: TIES' cut by magnitude keeps the same entries in both
(mergekit's ``torch.argsort`` is not stable; ckpttool's is).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from ckpttool.cli import cli

SEED = 44
BASE_STEP = 2.0**-12  # the grid of the base's values
DELTA_STEP = 2.0**-14  # the grid of the task vectors: n distinct magnitudes, n <= 1024 here
# mergekit computes in float32 (in bfloat16 for task vectors of bfloat16 inputs), ckpttool in
# float64 rounded once: the outputs may differ by the rounding of a few float32 operations on
# values of the inputs' magnitude. A formula defect (a weight, a sign, the cut, the divisor)
# moves entries by a fraction of a task vector (~2^-14 .. 2^-4), thousands of these units.
ULPS = 4


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def on_grid(value: torch.Tensor, step: float) -> torch.Tensor:
    return torch.round(value / step) * step


def task_vector(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Distinct magnitudes 1..n (x DELTA_STEP) in random places with random signs."""
    n = shape.numel()
    magnitudes = (torch.randperm(n, generator=generator) + 1).to(torch.float64) * DELTA_STEP
    signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
    return (magnitudes * signs).reshape(shape)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``base``, ``chat`` and ``code``: LlamaForCausalLM's own initialisation (the base) moved
    onto the grid, and two fine-tunes (base + a task vector per tensor), written in float32 by
    ``save_pretrained``; ``*_bf16`` the same three in bfloat16."""
    root = tmp_path_factory.mktemp("llamas")
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    model = LlamaForCausalLM(llama_config())
    base = {name: on_grid(p.detach().double(), BASE_STEP) for name, p in model.named_parameters()}
    states = {
        "base": base,
        "chat": {k: v + task_vector(v.shape, generator) for k, v in base.items()},
        "code": {k: v + task_vector(v.shape, generator) for k, v in base.items()},
    }
    paths = {}
    for name, state in states.items():
        for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
            with torch.no_grad():
                for key, param in model.named_parameters():
                    param.copy_(state[key].to(torch.float32))
            model.to(dtype).save_pretrained(root / f"{name}{suffix}")
            model.to(torch.float32)
            paths[f"{name}{suffix}"] = root / f"{name}{suffix}"
    return paths


def run_mergekit(config: dict, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """mergekit's own merge, as ``mergekit-yaml`` runs it: its defaults (CPU, no lazy
    unpickling, safetensors out) but no tokenizer or model card, and no network."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    options = MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True)
    run_merge(MergeConfiguration.model_validate(config), str(out), options)
    shards = sorted(out.glob("*.safetensors"))
    assert shards, f"mergekit wrote no safetensors in {out}"
    merged: dict = {}
    for shard in shards:
        merged.update(load_file(shard))
    return merged


def run_ckpttool(args: list[object], out: Path) -> dict:
    result = CliRunner().invoke(cli, ["merge", *(str(a) for a in args), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return load_file(out)


def assert_within_rounding(
    ours: dict, theirs: dict, inputs: list[Path], dtype: torch.dtype, ulps: int = ULPS
) -> None:
    """Same keys, dtypes and shapes; each entry within ``ulps`` units of ``dtype``'s rounding
    of the largest magnitude among the inputs' entries there."""
    assert sorted(ours) == sorted(theirs)
    states = [load_file(next(p.glob("*.safetensors"))) for p in inputs]
    eps = torch.finfo(dtype).eps
    for key in ours:
        a, b = ours[key], theirs[key]
        assert (a.dtype, a.shape) == (b.dtype, b.shape) == (dtype, states[0][key].shape), key
        scale = torch.stack([s[key].double().abs() for s in states]).amax(dim=0)
        limit = ulps * eps * torch.maximum(scale, a.double().abs())
        gap = (a.double() - b.double()).abs()
        worst = float((gap / limit.clamp_min(1e-30)).max())
        assert bool((gap <= limit).all()), f"{key}: off by {worst:.1f}x the tolerance"


def mk_model(path: Path, **parameters: float) -> dict:
    return {"model": str(path), "parameters": parameters} if parameters else {"model": str(path)}


def test_linear(llamas: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, chat, code = llamas["base"], llamas["chat"], llamas["code"]
    theirs = run_mergekit(
        {
            "merge_method": "linear",
            "dtype": "float32",
            "models": [mk_model(base, weight=0.2), mk_model(chat, weight=0.5),
                       mk_model(code, weight=0.3)],
        },
        tmp_path / "mergekit",
        monkeypatch,
    )  # fmt: skip
    ours = run_ckpttool(
        [base, chat, code, "--method", "linear", "--weights", "0.2,0.5,0.3"],
        tmp_path / "ours.safetensors",
    )
    assert_within_rounding(ours, theirs, [base, chat, code], torch.float32)


@pytest.mark.parametrize("lam", [1.0, 0.7])
def test_task_arithmetic(
    llamas: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lam: float
) -> None:
    base, chat, code = llamas["base"], llamas["chat"], llamas["code"]
    theirs = run_mergekit(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(base),
            "dtype": "float32",
            "parameters": {"lambda": lam},
            "models": [mk_model(chat, weight=1.0), mk_model(code, weight=0.5)],
        },
        tmp_path / "mergekit",
        monkeypatch,
    )
    ours = run_ckpttool(
        [base, chat, code, "--method", "task-arithmetic", "--weights", "1,0.5", "--lambda", lam],
        tmp_path / "ours.safetensors",
    )
    assert_within_rounding(ours, theirs, [base, chat, code], torch.float32)


@pytest.mark.parametrize(
    ("density", "weights", "lam"),
    # 0.05: int(0.05 x 16) = 0 for the 16-entry norms, where mergekit keeps one entry
    [(0.3, (1.0, 0.5), 1.0), (0.7, (0.6, 1.2), 0.8), (1.0, (1, 1), 1), (0.05, (1.0, 1.0), 1.0)],
)
def test_ties(
    llamas: dict,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    density: float,
    weights: tuple[float, float],
    lam: float,
) -> None:
    base, chat, code = llamas["base"], llamas["chat"], llamas["code"]
    theirs = run_mergekit(
        {
            "merge_method": "ties",
            "base_model": str(base),
            "dtype": "float32",
            "parameters": {"lambda": lam},
            "models": [
                mk_model(chat, weight=weights[0], density=density),
                mk_model(code, weight=weights[1], density=density),
            ],
        },
        tmp_path / "mergekit",
        monkeypatch,
    )
    ours = run_ckpttool(
        [base, chat, code, "--method", "ties", "--density", density, "--lambda", lam,
         "--weights", ",".join(str(w) for w in weights)],
        tmp_path / "ours.safetensors",
    )  # fmt: skip
    assert_within_rounding(ours, theirs, [base, chat, code], torch.float32)


@pytest.mark.parametrize("t", [0.3, 0.5])
def test_slerp(llamas: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, t: float) -> None:
    base, chat = llamas["base"], llamas["chat"]
    theirs = run_mergekit(
        {
            "merge_method": "slerp",
            "base_model": str(base),
            "dtype": "float32",
            "parameters": {"t": t},
            "models": [mk_model(base), mk_model(chat)],
        },
        tmp_path / "mergekit",
        monkeypatch,
    )
    ours = run_ckpttool([base, chat, "--method", "slerp", "--t", t], tmp_path / "ours.safetensors")
    assert_within_rounding(ours, theirs, [base, chat], torch.float32)


def test_slerp_inputs_take_both_branches(llamas: dict) -> None:
    """The SLERP comparison covers the spherical branch and the nearly-colinear lerp."""
    v0 = load_file(llamas["base"] / "model.safetensors")
    v1 = load_file(llamas["chat"] / "model.safetensors")
    cosines = [
        float(torch.nn.functional.cosine_similarity(v0[k].double().flatten(),
                                                    v1[k].double().flatten(), dim=0))
        for k in v0
    ]  # fmt: skip
    assert any(abs(c) > 0.9995 for c in cosines)
    assert any(abs(c) <= 0.9995 for c in cosines)


@pytest.mark.parametrize("method", ["linear", "slerp"])
def test_bfloat16(
    llamas: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """bfloat16 inputs and output: mergekit computes these two in float32 and rounds once, as
    ckpttool does from float64: the outputs are within one bfloat16 rounding."""
    base, chat = llamas["base_bf16"], llamas["chat_bf16"]
    if method == "linear":
        config = {"models": [mk_model(base, weight=0.25), mk_model(chat, weight=0.75)]}
        args = ["--weights", "0.25,0.75"]
    else:
        config = {"base_model": str(base), "parameters": {"t": 0.4},
                  "models": [mk_model(base), mk_model(chat)]}  # fmt: skip
        args = ["--t", "0.4"]
    theirs = run_mergekit(
        {"merge_method": method, "dtype": "bfloat16", **config}, tmp_path / "mergekit", monkeypatch
    )
    ours = run_ckpttool([base, chat, "--method", method, *args], tmp_path / "ours.safetensors")
    assert_within_rounding(ours, theirs, [base, chat], torch.bfloat16, ulps=1)


def test_a_wrong_parameter_is_caught(
    llamas: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison can fail: TIES at density 0.3 against mergekit at 0.31 differs."""
    base, chat, code = llamas["base"], llamas["chat"], llamas["code"]
    theirs = run_mergekit(
        {
            "merge_method": "ties",
            "base_model": str(base),
            "dtype": "float32",
            "models": [mk_model(chat, weight=1.0, density=0.31),
                       mk_model(code, weight=1.0, density=0.31)],
        },
        tmp_path / "mergekit",
        monkeypatch,
    )  # fmt: skip
    ours = run_ckpttool(
        [base, chat, code, "--method", "ties", "--density", 0.3], tmp_path / "ours.safetensors"
    )
    with pytest.raises(AssertionError, match="off by"):
        assert_within_rounding(ours, theirs, [base, chat, code], torch.float32)
