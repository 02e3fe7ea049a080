"""``ckpttool edit`` (issue 30, first part): drop, keep, rename and --for-inference on single
files, in their own format, checked with the loaders that read them (torch.load, Lightning's
load_from_checkpoint, ckpttool's own resume_training)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpttool import load_checkpoint, resume_training
from ckpttool.cli import cli
from ckpttool.commands.edit import edit_file
from ckpttool.errors import CorruptCheckpointError, InputError, LayoutError, OutputExistsError
from tests.support.helpers import FIXTURES

RESUME = FIXTURES / "ckpttool" / "pretrain_32_resume.pth"
MINIMIND = FIXTURES / "minimind" / "pretrain_32_resume.pth"
WEIGHTS = FIXTURES / "ckpttool" / "pretrain_32.pth"
LIGHTNING = FIXTURES / "frameworks" / "lightning" / "checkpoints" / "epoch=1-step=6.ckpt"
SAFETENSORS = FIXTURES / "safetensors" / "model.safetensors"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.view(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("source", [RESUME, MINIMIND], ids=["ckpttool", "minimind"])
def test_for_inference_keeps_the_model_and_counters_of_a_resume_file(
    tmp_path: Path, source: Path
) -> None:
    out = tmp_path / "inference.pth"
    report = edit_file(source, out, for_inference=True)
    original = torch.load(source, weights_only=True)
    edited = torch.load(out, weights_only=True)
    assert "optimizer" in report.dropped and "optimizer" not in edited
    assert set(edited) == set(original) - set(report.dropped)
    assert edited["step"] == original["step"] and edited["epoch"] == original["epoch"]
    assert all(_same(edited["model"][k], v) for k, v in original["model"].items())
    assert report.bytes_after < report.bytes_before and out.stat().st_size < source.stat().st_size


def test_a_resume_made_for_inference_is_refused_by_resume_training_for_its_optimizer(
    tmp_path: Path,
) -> None:
    out = tmp_path / "pretrain_32_resume.pth"
    edit_file(RESUME, out, for_inference=True)
    ckpt = load_checkpoint(tmp_path, "pretrain", 32)
    assert ckpt is not None
    model = torch.nn.Linear(1, 1)
    with pytest.raises(LayoutError, match="no 'optimizer' key: it was made for inference"):
        resume_training(ckpt, model, torch.optim.AdamW(model.parameters()))


def test_a_lightning_checkpoint_for_inference_still_loads_in_lightning(tmp_path: Path) -> None:
    from tests.fixtures.frameworks.lit import TinyLitModule

    out = tmp_path / "inference.ckpt"
    report = edit_file(LIGHTNING, out, for_inference=True)
    assert set(report.dropped) == {"optimizer_states", "lr_schedulers"}
    module = TinyLitModule.load_from_checkpoint(out, map_location="cpu")
    original = TinyLitModule.load_from_checkpoint(LIGHTNING, map_location="cpu")
    for (name, a), (_, b) in zip(module.state_dict().items(), original.state_dict().items()):
        assert _same(a, b), name
    assert "optimizer_states" not in torch.load(out, weights_only=False)


def test_drop_keep_and_rename_on_a_state_dict(tmp_path: Path) -> None:
    out = tmp_path / "edited.pth"
    report = edit_file(
        WEIGHTS, out, drop=["model.layers.1.*"], keep=["model.*"],
        rename=[r"^model\.layers\.(\d+)=model.blocks.\1", r"^model\.="],
    )  # fmt: skip
    original = torch.load(WEIGHTS, weights_only=True)
    edited = torch.load(out, weights_only=True)
    expected = {}
    for key, value in original.items():
        if key.startswith("model.layers.1.") or not key.startswith("model."):
            continue
        new = key.replace("model.layers.", "model.blocks.", 1).removeprefix("model.")
        expected[new] = value
    assert list(edited) == list(expected)
    assert all(_same(edited[k], v) for k, v in expected.items())
    layers = [k for k in original if k.startswith("model.layers.") and ".layers.1." not in k]
    assert [count for _, count in report.rules] == [len(layers), len(expected)]


def test_views_survive_an_edit(tmp_path: Path) -> None:
    base = torch.arange(24.0)
    source = tmp_path / "views.pth"
    torch.save(
        {
            "base": base,
            "window": base[4:9],
            "t": torch.arange(6).reshape(2, 3).t(),
            "x": torch.ones(2),
        },
        source,
    )
    out = tmp_path / "out.pth"
    edit_file(source, out, drop=["x"])
    edited = torch.load(out, weights_only=True)
    assert set(edited) == {"base", "window", "t"}
    assert edited["window"].equal(base[4:9]) and edited["t"].stride() == (1, 3)
    assert (
        edited["window"].untyped_storage().data_ptr() == edited["base"].untyped_storage().data_ptr()
    )


@pytest.mark.parametrize(
    "source", [SAFETENSORS, FIXTURES / "legacy" / "state_dict.pth"], ids=["safetensors", "legacy"]
)
def test_other_formats_stay_their_format(tmp_path: Path, source: Path) -> None:
    from ckpttool.checkpoint import open_checkpoint

    out = tmp_path / f"out{source.suffix}"
    with open_checkpoint(source) as ckpt:
        fmt = ckpt.format
        keys = [r.key for r in ckpt.tensors()]
    report = edit_file(source, out, rename=[r"^=renamed."])
    assert report.written and report.format == fmt
    with open_checkpoint(out) as ckpt:
        assert ckpt.format == fmt
        assert [r.key for r in ckpt.tensors()] == [f"renamed.{k}" for k in keys]


def test_in_place_with_a_backup(tmp_path: Path) -> None:
    source = shutil.copy(WEIGHTS, tmp_path / "w.pth")
    before = Path(source).read_bytes()
    report = edit_file(source, drop=["lm_head.*"], in_place=True, backup=True)
    assert report.written and report.backup == str(tmp_path / "w.pth.bak")
    assert (tmp_path / "w.pth.bak").read_bytes() == before
    assert "lm_head.weight" not in torch.load(source, weights_only=True)
    with pytest.raises(OutputExistsError, match="bak already exists"):
        edit_file(source, drop=["model.norm.*"], in_place=True, backup=True)


def test_refusals_write_nothing(tmp_path: Path) -> None:
    cut = tmp_path / "cut.pth"
    cut.write_bytes(RESUME.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="repair"):
        edit_file(cut, tmp_path / "o.pth", drop=["optimizer"])
    with pytest.raises(InputError, match="would both be named"):
        edit_file(WEIGHTS, tmp_path / "o.pth", rename=[r"layers\.\d+=same"])
    with pytest.raises(InputError, match="would move"):
        edit_file(RESUME, tmp_path / "o.pth", rename=[r"^model\.=x."])
    with pytest.raises(InputError, match="REGEX=REPLACEMENT"):
        edit_file(WEIGHTS, tmp_path / "o.pth", rename=["no-equals-sign"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.pth"]
    # issue 49: a pattern that matches nothing is an error (it wrote an unchanged file, exit 0)
    with pytest.raises(InputError, match=r"--drop 'nothing.matches': matches no key"):
        edit_file(WEIGHTS, tmp_path / "o.pth", drop=["nothing.matches"])
    report = edit_file(WEIGHTS, tmp_path / "o.pth", drop=["nothing.matches"], require_matches=False)
    assert not report.changed and not report.written and not (tmp_path / "o.pth").exists()
    assert report.unmatched == ("--drop 'nothing.matches'",)


def test_the_cli_reports_and_exits(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["edit", str(RESUME), "--for-inference", "--dry-run", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["dry_run"] and not data["written"] and "optimizer" in data["dropped"]
    result = runner.invoke(cli, ["edit", str(RESUME), "--rename", "bad"])
    assert (
        result.exit_code == 2
        and result.stderr.startswith("Error: ")
        and "Traceback" not in result.stderr
    )


def test_compact_keeps_only_the_bytes_the_views_use(tmp_path: Path) -> None:
    """torch.save(big[:10]) stores all of big; --compact cuts it to the view's bytes, shared
    storages stay shared, the values load equal."""
    big = torch.arange(100_000, dtype=torch.float32)
    source = tmp_path / "big.pth"
    torch.save({"head": big[:10], "mid": big[50:60].view(2, 5).t(), "step": 3}, source)
    out = tmp_path / "small.pth"
    report = edit_file(source, out, compact=True)
    assert sorted(report.compacted) == ["head", "mid"]
    assert report.bytes_before == 400_000 and report.bytes_after == 60 * 4
    assert out.stat().st_size < 4_000 < source.stat().st_size
    original, edited = torch.load(source, weights_only=True), torch.load(out, weights_only=True)
    for key in ("head", "mid"):
        assert edited[key].equal(original[key]) and edited[key].stride() == original[key].stride()
    assert edited["head"].untyped_storage().nbytes() == 240
    assert edited["head"].untyped_storage().data_ptr() == edited["mid"].untyped_storage().data_ptr()
    assert not edit_file(out, tmp_path / "again.pth", compact=True).changed  # already compact


def test_dtype_casts_all_but_the_kept_tensors_as_torch_does(tmp_path: Path) -> None:
    out = tmp_path / "bf16.pth"
    report = edit_file(WEIGHTS, out, dtype="bf16", keep_dtype=["*norm*"])
    original = torch.load(WEIGHTS, weights_only=True)
    edited = torch.load(out, weights_only=True)
    assert report.dtype == "bfloat16" and report.cast
    for key, value in original.items():
        if "norm" in key or not value.is_floating_point():
            assert _same(edited[key], value), key
            assert key not in report.cast
        else:
            assert _same(edited[key], value.to(torch.bfloat16)), key  # torch's own rounding
    assert set(report.cast) == {
        k for k, v in original.items() if "norm" not in k and v.is_floating_point()
    }


def test_dtype_keeps_tied_weights_tied_and_views_as_values(tmp_path: Path) -> None:
    embed = torch.randn(8, 4)
    source = tmp_path / "tied.pth"
    torch.save({"embed": embed, "lm_head": embed, "t": embed.t(), "ids": torch.arange(3)}, source)
    out = tmp_path / "half.pth"
    edit_file(source, out, dtype="fp16")
    edited = torch.load(out, weights_only=True)
    assert (
        edited["embed"].untyped_storage().data_ptr()
        == edited["lm_head"].untyped_storage().data_ptr()
    )
    assert _same(edited["t"], embed.t().contiguous().to(torch.float16))
    assert edited["ids"].dtype == torch.int64


def test_dtype_overflow_is_an_error_unless_allowed(tmp_path: Path) -> None:
    source = tmp_path / "big.pth"
    torch.save({"w": torch.tensor([1e10, 1.0])}, source)
    with pytest.raises(InputError, match="do not fit in float16"):
        edit_file(source, tmp_path / "o.pth", dtype="fp16")
    assert not (tmp_path / "o.pth").exists()
    edit_file(source, tmp_path / "o.pth", dtype="fp16", allow_overflow=True)
    assert torch.load(tmp_path / "o.pth", weights_only=True)["w"][0].isinf()


def _ema_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A resume-style file with the EMA torch's own AveragedModel keeps (keys ``module.*``,
    plus its ``n_averaged`` counter)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
    path = tmp_path / "run.pth"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 0,
                "step": 3, "model_ema": ema.state_dict()}, path)  # fmt: skip
    averaged = {k.removeprefix("module."): v for k, v in ema.state_dict().items()}
    return path, averaged


def test_use_ema_puts_the_average_in_place_of_the_weights(tmp_path: Path) -> None:
    path, averaged = _ema_checkpoint(tmp_path)
    out = tmp_path / "ema.pth"
    report = edit_file(path, out, use_ema="", for_inference=True)
    edited = torch.load(out, weights_only=True)
    assert report.ema == "model_ema" and "model_ema" in report.dropped
    assert set(edited) == {"model", "epoch", "step"}
    # AveragedModel averages parameters; BatchNorm's buffers it copies (use_buffers=False: no)
    for key, value in edited["model"].items():
        if key in averaged:
            assert _same(value, averaged[key]), key
    assert report.ema_taken == sum(k in averaged for k in edited["model"])
    assert set(report.ema_missing) == {f"model.{k}" for k in edited["model"] if k not in averaged}


def test_use_ema_refusals(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no EMA weights found"):
        edit_file(RESUME, tmp_path / "o.pth", use_ema="")
    path, _ = _ema_checkpoint(tmp_path)
    with pytest.raises(InputError, match="no such key"):
        edit_file(path, tmp_path / "o.pth", use_ema="ema.weights")
    source = tmp_path / "wrong.pth"
    torch.save(
        {"model": {"w": torch.ones(2, 2)}, "optimizer": {}, "ema": {"w": torch.ones(3)}}, source
    )
    with pytest.raises(InputError, match="the model's is float32"):
        edit_file(source, tmp_path / "o.pth", use_ema="")
    assert not (tmp_path / "o.pth").exists()


def _fp8_reference(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's weight_dequant in plain torch, float32: value times its block's scale."""
    rows, cols = weight.shape
    if scale.numel() == 1:
        expanded = scale.float().reshape(1, 1).expand(rows, cols)
    elif scale.shape[0] == rows and scale.numel() == rows:
        expanded = scale.float().reshape(rows, 1).expand(rows, cols)
    else:
        expanded = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
        expanded = expanded[:rows, :cols]
    return weight.float() * expanded


@pytest.mark.parametrize("kind", ["block", "row", "tensor", "e8m0 block"])
def test_dtype_dequantizes_float8_weights_with_their_scales(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(300, 200) * 4).to(torch.float8_e4m3fn)  # uneven last blocks
    if kind.endswith("block"):
        scale = torch.rand(3, 2) + 0.5
    elif kind == "row":
        scale = torch.rand(300, 1) + 0.5
    else:
        scale = torch.tensor(0.25)
    if kind.startswith("e8m0"):
        scale = torch.exp2(torch.randint(-4, 4, (3, 2)).float()).to(torch.float8_e8m0fnu)
    source = tmp_path / "fp8.pth"
    torch.save(
        {"layer.weight": weight, "layer.weight_scale_inv": scale, "norm.weight": torch.ones(200)},
        source,
    )
    out = tmp_path / "bf16.pth"
    report = edit_file(source, out, dtype="bf16")
    edited = torch.load(out, weights_only=True)
    assert "layer.weight_scale_inv" in report.dropped and set(edited) == {
        "layer.weight",
        "norm.weight",
    }
    expected = _fp8_reference(weight, scale).to(torch.bfloat16)
    assert _same(edited["layer.weight"], expected)


def test_a_float8_scale_of_no_known_shape_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "fp8.pth"
    torch.save({"w": torch.zeros(4, 4).to(torch.float8_e4m3fn), "w_scale": torch.ones(3)}, source)
    with pytest.raises(InputError, match="neither per tensor, per row"):
        edit_file(source, tmp_path / "o.pth", dtype="bf16")


HF_SHARDED = FIXTURES / "frameworks" / "hf_sharded"


def test_a_hugging_face_directory_cast_to_bf16_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from ckpttool.commands.edit_directory import edit

    out = tmp_path / "bf16"
    report = edit(HF_SHARDED, out, dtype="bf16")
    assert report.written and report.format == "directory" and report.dtype == "bfloat16"
    config = json.loads((out / "config.json").read_text())
    assert "bfloat16" in (config.get("dtype"), config.get("torch_dtype"))
    original = AutoModelForCausalLM.from_pretrained(HF_SHARDED, dtype=torch.float32)
    edited = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(original.state_dict().items(), edited.state_dict().items()):
        assert _same(b, a.to(torch.bfloat16)), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == report.bytes_after


def test_a_dropped_tensor_leaves_the_index_consistent(tmp_path: Path) -> None:
    from ckpttool.commands.edit_directory import edit
    from ckpttool.commands.verify import verify

    out = tmp_path / "dropped"
    report = edit(HF_SHARDED, out, drop=["model.layers.1.mlp.*"])
    assert len(report.dropped) == 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not any(k.startswith("model.layers.1.mlp.") for k in index["weight_map"])
    (result,) = verify([str(out)])
    assert result.ok, result.problems
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in HF_SHARDED.iterdir())


def test_a_directory_edit_that_changes_nothing_writes_nothing(tmp_path: Path) -> None:
    from ckpttool.commands.edit_directory import edit

    report = edit(HF_SHARDED, tmp_path / "same", compact=True)
    assert not report.changed and not report.written and not (tmp_path / "same").exists()
    assert not list(tmp_path.iterdir())  # no staged directory left behind


def test_a_directory_edit_pattern_is_matched_against_every_file(tmp_path: Path) -> None:
    """Issue 49: a --drop pattern that no weights file matches is an error (it wrote nothing
    and exited 0); one that matches in one shard only is an edit of that shard."""
    from ckpttool.commands.edit_directory import edit

    with pytest.raises(InputError, match=r"--drop 'no.such.\*': matches no key"):
        edit(HF_SHARDED, tmp_path / "same", drop=["no.such.*"])
    with pytest.raises(InputError, match=r"--rename 'no.such=x': matches no key"):
        edit(HF_SHARDED, tmp_path / "same", rename=["no.such=x"], dry_run=True)
    assert not list(tmp_path.iterdir())  # no staged directory left behind
    shards = sorted(p.name for p in HF_SHARDED.glob("*.safetensors"))
    assert len(shards) > 1
    from safetensors import safe_open

    with safe_open(str(HF_SHARDED / shards[-1]), "pt") as handle:
        only_in_last = next(iter(handle.keys()))
    report = edit(HF_SHARDED, tmp_path / "out", drop=[only_in_last])
    assert report.written and report.dropped == (only_in_last,)


def test_convert_takes_edits_drop_and_rename(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ckpttool.commands.convert.run import convert

    out = tmp_path / "out.safetensors"
    convert(MINIMIND, out, drop=["*lm_head*"], rename=[r"^model\.=", r"\.mlp\.=.ffn."])
    written = load_file(out)
    model = torch.load(MINIMIND, weights_only=True)["model"]
    expected = {
        k.removeprefix("model.").replace(".mlp.", ".ffn."): v
        for k, v in model.items()
        if "lm_head" not in k
    }
    assert set(written) == set(expected)
    assert all(_same(written[k], v) for k, v in expected.items())
    with pytest.raises(InputError, match="would both be named"):
        convert(MINIMIND, tmp_path / "x.safetensors", rename=[r"layers\.\d+=L"])


def _adamw_resume(path: Path, grad_scale: float = 1.0) -> dict[str, Any]:
    """A resume dict as a training loop saves it: a real AdamW's state after 3 steps (its
    ``step`` counters are float32 tensors), a scheduler, the epoch."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    for _ in range(3):
        (net(torch.randn(2, 4)).sum() * grad_scale).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    state = {
        "model": net.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "epoch": 1, "step": 3,
    }  # fmt: skip
    torch.save(state, path)
    return state


def test_dtype_casts_a_resume_files_model_and_leaves_its_optimizer_state(tmp_path: Path) -> None:
    """Issue 49 item 3: ``--dtype bf16`` cast AdamW's ``step`` counters (a resumed run's step
    then freezes at 256) and its moments, silently. Now the model only, the rest said."""
    source = tmp_path / "resume.pth"
    original = _adamw_resume(source)
    report = edit_file(source, tmp_path / "bf16.pth", dtype="bf16")
    edited = torch.load(tmp_path / "bf16.pth", weights_only=True)
    for key, value in original["model"].items():
        assert _same(edited["model"][key], value.to(torch.bfloat16)), key
    for index, state in original["optimizer"]["state"].items():
        for name, value in state.items():
            assert _same(edited["optimizer"]["state"][index][name], value), (index, name)
    assert set(report.cast) == {f"model.{key}" for key in original["model"]}
    assert len(report.not_cast) == 12 and all(k.startswith("optimizer.") for k in report.not_cast)
    text = CliRunner().invoke(cli, ["edit", str(source), "--dtype", "bf16", "-o", str(tmp_path / "cli.pth")])  # fmt: skip
    assert text.exit_code == 0
    assert "not cast: 8 tensor(s) of optimizer state" in text.output
    assert "not cast: 4 step counter(s)" in text.output


def test_dtype_leaves_a_lightning_files_optimizer_states_alone(tmp_path: Path) -> None:
    """The optimizer's state is found by its structure: Lightning keeps it in a list."""
    edit_file(LIGHTNING, tmp_path / "bf16.ckpt", dtype="bf16")
    original = torch.load(LIGHTNING, weights_only=False)
    edited = torch.load(tmp_path / "bf16.ckpt", weights_only=False)
    assert {v.dtype for v in edited["state_dict"].values() if v.is_floating_point()} == {
        torch.bfloat16
    }
    moments = [
        (value, edited["optimizer_states"][0]["state"][index][name])
        for index, state in original["optimizer_states"][0]["state"].items()
        for name, value in state.items()
    ]
    assert moments and all(_same(after, before) for before, after in moments)


def test_cast_optimizer_casts_its_state_never_its_counters_and_reports_underflow(
    tmp_path: Path,
) -> None:
    """``--cast-optimizer``: the moments too, the ``step`` counters never; values fp16 makes 0
    (small second moments) are reported as convert reports them."""
    source = tmp_path / "resume.pth"
    original = _adamw_resume(source, grad_scale=1e-6)  # squared gradients ~1e-12: below fp16
    out = tmp_path / "fp16.pth"
    report = edit_file(source, out, dtype="fp16", cast_optimizer=True)
    edited = torch.load(out, weights_only=True)
    for index, state in original["optimizer"]["state"].items():
        after = edited["optimizer"]["state"][index]
        assert _same(after["step"], state["step"]) and after["step"].dtype == torch.float32
        for name in ("exp_avg", "exp_avg_sq"):
            assert _same(after[name], state[name].to(torch.float16)), (index, name)
    assert set(report.not_cast) == {f"optimizer.state.{i}.step" for i in range(4)}
    zeros = {
        f"optimizer.state.{index}.{name}": int(
            ((value != 0) & (value.to(torch.float16) == 0)).sum()
        )
        for index, state in original["optimizer"]["state"].items()
        for name, value in state.items()
        if name != "step"
    }
    assert dict(report.underflow) == {k: n for k, n in zeros.items() if n}
    assert sum(zeros.values()) > 0
    result = CliRunner().invoke(
        cli, ["edit", str(source), "--dtype", "fp16", "--cast-optimizer", "-o", str(tmp_path / "c.pth")]
    )  # fmt: skip
    assert result.exit_code == 0
    assert "note: values that became 0 in float16 (underflow): optimizer.state.0." in result.output


def test_cast_optimizer_without_dtype_is_refused_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "resume.pth"
    _adamw_resume(source)
    result = CliRunner().invoke(cli, ["edit", str(source), "--cast-optimizer", "-o", str(tmp_path / "o.pth")])  # fmt: skip
    assert result.exit_code == 2 and not (tmp_path / "o.pth").exists()
    assert result.output.strip().splitlines()[-1].endswith("--cast-optimizer goes with --dtype")
