"""ckpttool average: the mean, weighted mean and EMA of N checkpoints' weights, against torch
computed here in float64 and rounded once (bit for bit), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttool.cli import cli
from ckpttool.commands.average import PROVENANCE_KEY, average
from ckpttool.errors import InputError
from tests.support.minimind import MiniMindForCausalLM

STEPS = (100, 200, 300)
TIED = {"model.embed_tokens.weight"}  # an alias of lm_head.weight


def resume_files(directory: Path, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Three MiniMind resume files (model in ``dtype``, an int64 buffer, an optimizer) saved
    as MiniMind's trainer does; returns each one's model state dict."""
    directory.mkdir(parents=True, exist_ok=True)
    states = []
    for seed, step in enumerate(STEPS):
        torch.manual_seed(seed)
        model = MiniMindForCausalLM().to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = model.state_dict()
        state["model.position_ids"] = torch.arange(8)  # an int buffer, equal in every file
        torch.save(
            {"model": state, "optimizer": optimizer.state_dict(), "epoch": 0, "step": step},
            directory / f"resume_{step}.pth",
        )
        states.append(state)
    return states


def reference(states: list[dict[str, torch.Tensor]], key: str, weights: list[float] | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    xs = [s[key] for s in states]
    out = dtype or xs[0].dtype
    if not xs[0].is_floating_point():
        return xs[-1]
    if weights is None:
        return torch.stack(xs).double().mean(0).to(out)
    total = torch.zeros_like(xs[0], dtype=torch.float64)
    for w, x in zip(weights, xs):
        total += w * x.double()
    return total.to(out)


def assert_bitwise(got: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]],
                   **kwargs: object) -> None:  # fmt: skip
    # safetensors stores a tied pair once (the alias is in its __metadata__)
    assert set(got) <= set(states[0]) and set(states[0]) - set(got) <= TIED
    for key, tensor in got.items():
        want = reference(states, key, **kwargs)  # type: ignore[arg-type]
        assert tensor.dtype == want.dtype, key
        assert torch.equal(tensor, want), key


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_mean_of_three_resume_files_is_torchs_mean(tmp_path: Path, dtype: torch.dtype) -> None:
    states = resume_files(tmp_path / "run", dtype)
    paths = [tmp_path / "run" / f"resume_{s}.pth" for s in STEPS]
    out = tmp_path / "avg.safetensors"
    report = average(paths, out)
    assert report.method == "mean" and [i.step for i in report.inputs] == list(STEPS)
    assert report.ints == ["model.position_ids"] and report.averaged == report.tensors - 1
    assert_bitwise(load_file(out), states)
    with safe_open(out, "pt") as opened:
        provenance = json.loads(opened.metadata()[PROVENANCE_KEY])
    assert [(i["step"], i["weight"]) for i in provenance["inputs"]] == [(s, 1 / 3) for s in STEPS]
    # a mean of the float values is not one of the inputs (the test can see a copy)
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(load_file(out)[key], states[0][key])


def test_pth_output_and_dtype(tmp_path: Path) -> None:
    states = resume_files(tmp_path / "run", torch.float32)
    out = tmp_path / "avg.pth"
    average(sorted((tmp_path / "run").iterdir()), out, dtype="bf16")
    got = torch.load(out, weights_only=True)
    for key, tensor in got.items():
        want = reference(states, key, dtype=torch.bfloat16 if tensor.is_floating_point() else None)
        assert torch.equal(tensor, want), key
    # the tied embedding stays tied in the .pth
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()


def test_weights_and_ema(tmp_path: Path) -> None:
    states = resume_files(tmp_path / "run", torch.float16)
    paths = [tmp_path / "run" / f"resume_{s}.pth" for s in STEPS]
    out = tmp_path / "w.safetensors"
    report = average(paths, out, weights=[1, 1, 2])
    assert [i.weight for i in report.inputs] == [0.25, 0.25, 0.5]
    assert_bitwise(load_file(out), states, weights=[0.25, 0.25, 0.5])
    # EMA in step order, whatever the order given
    decay = 0.9
    ema = tmp_path / "ema.safetensors"
    report = average(list(reversed(paths)), ema, ema=decay)
    assert report.method == "ema" and [i.step for i in report.inputs] == list(STEPS)
    weights = [decay**2, (1 - decay) * decay, 1 - decay]
    assert [i.weight for i in report.inputs] == pytest.approx(weights)
    assert_bitwise(load_file(ema), states, weights=[i.weight for i in report.inputs])
    with pytest.raises(InputError, match="2 weight"):
        average(paths, tmp_path / "x.safetensors", weights=[1, 2])
    with pytest.raises(InputError, match=r"name OUT \.safetensors or \.pth"):
        average(paths, tmp_path / "x.txt")


def test_last_skips_a_broken_newest_file(tmp_path: Path) -> None:
    states = resume_files(tmp_path / "run", torch.float32)
    newest = tmp_path / "run" / "resume_300.pth"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    result = CliRunner().invoke(
        cli, ["average", "--last", "2", str(tmp_path / "run"), "-o", str(tmp_path / "a.safetensors"), "--json"]
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [i["name"] for i in data["inputs"]] == ["resume_100.pth", "resume_200.pth"]
    assert len(data["skipped"]) == 1 and data["skipped"][0].startswith("resume_300.pth: ")
    assert "skipped: resume_300.pth" in result.stderr
    assert_bitwise(load_file(tmp_path / "a.safetensors"), states[:2])


def test_last_with_fewer_checkpoints_averages_those_with_a_note(tmp_path: Path) -> None:
    # --last 5 over a run of 3 (one of them broken): the 2 complete ones, said on stderr and
    # in the JSON, exit 0 (it used to refuse)
    states = resume_files(tmp_path / "run", torch.float32)
    newest = tmp_path / "run" / "resume_300.pth"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    out = tmp_path / "a.safetensors"
    result = CliRunner().invoke(
        cli, ["average", "--last", "5", str(tmp_path / "run"), "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [i["name"] for i in data["inputs"]] == ["resume_100.pth", "resume_200.pth"]
    note = (
        "--last 5: "
        + str(tmp_path / "run")
        + " holds 2 complete checkpoint(s) of 3; averaged those 2"
    )
    assert data["notes"] == [note] and f"note: {note}" in result.stderr
    assert_bitwise(load_file(out), states[:2])
    for path in (tmp_path / "run").glob("resume_[12]*.pth"):
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(InputError, match="no complete checkpoint of 3 to average"):
        average([tmp_path / "run"], tmp_path / "b.safetensors", last=5)
    assert not (tmp_path / "b.safetensors").exists()


def test_missing_key_and_shape_mismatch_are_named(tmp_path: Path) -> None:
    resume_files(tmp_path / "run", torch.float32)
    paths = [tmp_path / "run" / f"resume_{s}.pth" for s in STEPS]
    state = torch.load(paths[1], weights_only=True)
    del state["model"]["model.norm.weight"]
    torch.save(state, paths[1])
    out = tmp_path / "avg.safetensors"
    result = CliRunner().invoke(cli, ["average", *map(str, paths), "-o", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "resume_200.pth lacks model.norm.weight" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()
    state["model"]["model.norm.weight"] = torch.ones(7)
    torch.save(state, paths[1])
    with pytest.raises(InputError, match=r"model.norm.weight is \[7\] in \S*resume_200.pth"):
        average(paths, out)
    assert not out.exists()


def test_unequal_int_tensors_are_refused_or_taken_from_the_last(tmp_path: Path) -> None:
    states = resume_files(tmp_path / "run", torch.float16)
    paths = [tmp_path / "run" / f"resume_{s}.pth" for s in STEPS]
    state = torch.load(paths[2], weights_only=True)
    state["model"]["model.position_ids"] = torch.arange(8) + 1
    torch.save(state, paths[2])
    states[2] = state["model"]
    out = tmp_path / "avg.safetensors"
    result = CliRunner().invoke(cli, ["average", *map(str, paths), "-o", str(out)])
    assert result.exit_code == 2 and "model.position_ids" in result.stderr
    assert "--ints last" in result.stderr and not out.exists()
    average(paths, out, ints="last")
    assert_bitwise(load_file(out), states)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_directories_with_ema(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    states = []
    for step in (300, 100, 200):
        torch.manual_seed(step)
        model = {"layers.0.w": torch.randn(4, 4), "layers.1.w": torch.randn(3).half()}
        dcp.save({"model": model, "step": step}, checkpoint_id=str(tmp_path / f"run_{step}"))
        states.append((step, model))
    states = [m for _, m in sorted(states, key=lambda s: s[0])]
    out = tmp_path / "ema.safetensors"
    report = average([tmp_path], out, ema=0.5)
    assert [i.step for i in report.inputs] == [100, 200, 300]
    assert_bitwise(load_file(out), states, weights=[0.25, 0.25, 0.5])


def test_worked_example_of_the_docs(tmp_path: Path) -> None:
    """docs/average.md: 1, 2 and 4 in float16 average to 2.333984375; EMA 0.5 to 2.75."""
    for value, step in zip((1.0, 2.0, 4.0), STEPS):
        torch.save({"model": {"w": torch.tensor([value], dtype=torch.float16)}, "step": step},
                   tmp_path / f"r_{step}.pth")  # fmt: skip
    paths = [tmp_path / f"r_{s}.pth" for s in STEPS]
    average(paths, tmp_path / "m.safetensors")
    assert load_file(tmp_path / "m.safetensors")["w"].item() == 2.333984375
    average(paths, tmp_path / "e.safetensors", ema=0.5)
    assert load_file(tmp_path / "e.safetensors")["w"].item() == 2.75


def test_a_deepspeed_zero2_run_is_averaged_from_its_fp32_weights(tmp_path: Path) -> None:
    """The DeepSpeed fixture (written by DeepSpeed): each checkpoint's weights as convert
    consolidates them (the fp32 master weights), averaged by torch here."""
    from ckpttool.commands.convert.run import convert
    from tests.support.helpers import FIXTURES

    run = FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"
    states = []
    for tag in ("global_step2", "global_step4"):
        convert(run / tag, tmp_path / f"{tag}.safetensors")
        states.append(load_file(tmp_path / f"{tag}.safetensors"))
    out = tmp_path / "avg.safetensors"
    report = average([run], out)
    assert [(i.name, i.step) for i in report.inputs] == [("global_step2", 2), ("global_step4", 4)]
    assert_bitwise(load_file(out), states)
    assert any(not torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_fp16_and_fp32_inputs_round_to_the_first_and_float8_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    values = [torch.randn(5, 3), torch.randn(5, 3)]
    torch.save({"w": values[0].half()}, tmp_path / "a.pth")
    torch.save({"w": values[1]}, tmp_path / "b.pth")
    out = tmp_path / "avg.safetensors"
    report = average([tmp_path / "a.pth", tmp_path / "b.pth"], out)
    assert any("other float dtypes" in note and "w" in note for note in report.notes)
    want = torch.stack([values[0].half().double(), values[1].double()]).mean(0).half()
    assert torch.equal(load_file(out)["w"], want)
    for name in ("a", "b"):
        torch.save({"w": torch.zeros(4).to(torch.float8_e4m3fn)}, tmp_path / f"{name}8.pth")
    result = CliRunner().invoke(
        cli, ["average", str(tmp_path / "a8.pth"), str(tmp_path / "b8.pth"), "-o", str(out), "--force"]
    )  # fmt: skip
    assert result.exit_code == 2 and "w is float8_e4m3fn, which is not averaged" in result.stderr


def test_memory_holds_a_few_tensors_not_the_inputs(tmp_path: Path) -> None:
    """3 inputs of 8 float32 tensors of 4 MiB (96 MiB in all): the peak NumPy/Python memory
    stays a few tensors (loading the inputs, as fairseq's script does, would be 96 MiB)."""
    import tracemalloc

    numel = 1 << 20
    tensor_bytes = numel * 4
    paths = []
    for seed in range(3):
        torch.manual_seed(seed)
        paths.append(tmp_path / f"big{seed}.pth")
        torch.save({f"t{k}": torch.randn(numel) for k in range(8)}, paths[-1])
    tracemalloc.start()
    try:
        average(paths, tmp_path / "avg.safetensors")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * tensor_bytes  # 8 tensors' worth measured: the float64 sum, one input's
