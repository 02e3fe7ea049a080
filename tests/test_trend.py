"""ckpttool trend: a run's checkpoints in step order, norms and updates against references
computed here in float64, the first NaN, frozen tensors, update jumps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ckpttool.cli import cli
from ckpttool.commands.trend import JUMP_FACTOR, trend
from ckpttool.train import save_checkpoint
from tests.support.helpers import FIXTURES

NAN_STEP = 4  # the step at which the run below goes NaN
STEPS = 6
TOL = 1e-9


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers:
            h = block.norm(h + torch.tanh(block.mlp(h)))
        return self.head(h)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A real run saved with ckpttool's save_checkpoint after each step (resume files only):
    layers.1 frozen, layers.2.mlp.weight set to NaN before the save of step NAN_STEP (the
    steps after it train on NaN). Returns the directory and each step's weights."""
    directory = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = Tiny()
    for parameter in model.layers[1].parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    saved = []
    for step in range(1, STEPS + 1):
        loss = nn.functional.cross_entropy(model(data).flatten(0, 1), data.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == NAN_STEP:
            with torch.no_grad():
                model.layers[2].mlp.weight[1, 2] = float("nan")
        save_checkpoint(
            model, optimizer, save_dir=directory, weight=f"run{step}", hidden_size=8,
            epoch=0, step=step, weights_dtype=None,
        )  # fmt: skip
        saved.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return directory, saved


def finite_norm(t: torch.Tensor) -> float:
    t = t.double().flatten()
    return float(t[t.isfinite()].norm())


def test_a_real_run_names_the_nan_step_its_tensor_and_the_frozen_layer(run: tuple[Path, list[dict[str, torch.Tensor]]]) -> None:  # fmt: skip
    directory, saved = run
    report = trend([directory])
    assert report.order == "step"
    assert [p.step for p in report.checkpoints] == list(range(1, STEPS + 1))
    first = report.first_nonfinite
    assert first is not None and report.checkpoints[first].step == NAN_STEP
    assert report.nonfinite_tensors == ["layers.2.mlp.weight"]
    assert report.frozen_modules == ["layers.1"]
    assert sorted(report.never_changed) == sorted(k for k in saved[0] if k.startswith("layers.1."))
    tensors = {t.key: t for t in report.tensors}
    weight = tensors["layers.2.mlp.weight"]
    assert weight.nan[: NAN_STEP - 1] == [0] * (NAN_STEP - 1) and weight.nan[NAN_STEP - 1] == 1
    for key, item in tensors.items():  # norms and updates against torch, over finite elements
        for i, state in enumerate(saved):
            assert item.norms[i] == pytest.approx(finite_norm(state[key]), rel=TOL, abs=TOL)
        for i in range(1, NAN_STEP - 1):  # before the NaN
            delta = saved[i][key].double() - saved[i - 1][key].double()
            assert item.updates[i] == pytest.approx(float(delta.norm()), rel=TOL, abs=TOL)


def test_cli_on_the_run_exits_1_and_names_the_step(run: tuple[Path, list[dict[str, torch.Tensor]]]) -> None:  # fmt: skip
    directory, _ = run
    result = CliRunner().invoke(cli, ["trend", str(directory)])
    assert result.exit_code == 1, result.output
    assert f"first NaN/Inf: #{NAN_STEP - 1}, epoch 0 step {NAN_STEP} (run{NAN_STEP}_8_resume.pth): layers.2.mlp.weight (1 NaN)" in result.stdout  # fmt: skip
    assert "modules never changed: layers.1\n" in result.stdout
    data = json.loads(CliRunner().invoke(cli, ["trend", str(directory), "--json"]).stdout)
    assert data["first_nonfinite"]["step"] == NAN_STEP
    assert data["first_nonfinite"]["tensors"] == ["layers.2.mlp.weight"]
    assert data["healthy"] is False


def test_files_given_out_of_order_are_sorted_by_their_counters(run: tuple[Path, list[dict[str, torch.Tensor]]]) -> None:  # fmt: skip
    directory, _ = run
    files = [directory / f"run{step}_8_resume.pth" for step in (3, 1, 2)]
    report = trend(files)
    assert [p.step for p in report.checkpoints] == [1, 2, 3]
    assert report.first_nonfinite is None and report.healthy


def save_series(directory: Path, states: list[dict[str, torch.Tensor]]) -> list[Path]:
    """Plain state dicts named by step (no counters inside: ordered by name)."""
    paths = []
    for step, state in enumerate(states):
        path = directory / f"ckpt_{step * 10}.pt"
        torch.save(state, path)
        paths.append(path)
    return paths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)  # fmt: skip
def test_known_changes_in_every_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    """One layer scaled by 2 at each step (rel update 1), one frozen, a NaN from step 3."""
    g = torch.Generator().manual_seed(0)
    base = {f"blocks.{i}.proj.weight": (torch.rand(16, 8, generator=g) + 0.5) for i in range(2)}
    states = []
    for step in range(4):
        state = {
            "blocks.0.proj.weight": (base["blocks.0.proj.weight"] * 2.0**step).to(dtype),
            "blocks.1.proj.weight": base["blocks.1.proj.weight"].to(dtype),
        }
        if step >= 3:
            state["blocks.0.proj.weight"][0, 0] = float("nan")
        states.append(state)
    paths = save_series(tmp_path, states)
    report = trend(list(reversed(paths)))  # ordered by the numbers in the names
    assert report.order == "name"
    assert [p.name for p in report.checkpoints] == [str(p) for p in paths]
    tensors = {t.key: t for t in report.tensors}
    scaled = tensors["blocks.0.proj.weight"]
    assert scaled.relative_updates[1:3] == [pytest.approx(1.0, rel=1e-12)] * 2
    for i, state in enumerate(states):
        assert scaled.norms[i] == pytest.approx(finite_norm(state["blocks.0.proj.weight"]), rel=TOL)
    assert report.first_nonfinite == 3 and report.nonfinite_tensors == ["blocks.0.proj.weight"]
    assert report.never_changed == ["blocks.1.proj.weight"]
    assert report.frozen_modules == ["blocks.1"]
    group = next(g for g in report.groups if g.group == "blocks.#.proj")
    for i in range(1, 3):  # the group's update: sqrt of the sum of its tensors' squares
        expected = math.sqrt(sum((states[i][k].double() - states[i - 1][k].double()).norm() ** 2 for k in states[0]))  # fmt: skip
        assert group.updates[i] == pytest.approx(expected, rel=TOL)


def test_an_update_jump_is_reported_where_it_happens(tmp_path: Path) -> None:
    """Steady updates of 1% then one of 50% (> JUMP_FACTOR x the median): a jump there only."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 32, generator=g, dtype=torch.float64)
    direction = torch.randn(32, 32, generator=g, dtype=torch.float64)
    direction *= weight.norm() / direction.norm()
    sizes = [0.01, 0.012, 0.011, 0.5, 0.01]
    states = [{"layers.0.attn.weight": weight.clone(), "other.weight": weight.clone()}]
    for size in sizes:
        previous = states[-1]["layers.0.attn.weight"]
        states.append({"layers.0.attn.weight": previous + size * previous.norm() / direction.norm() * direction, "other.weight": weight.clone()})  # fmt: skip
    report = trend(save_series(tmp_path, states))
    assert [(j.checkpoint, j.group) for j in report.jumps] == [
        (4, "layers.0.attn")
    ]  # one block: no run, named as itself
    jump = report.jumps[0]
    assert jump.relative_update == pytest.approx(0.5, rel=1e-9)
    assert jump.relative_update > JUMP_FACTOR * jump.median_before
    assert report.frozen_modules == ["other"]


def test_a_trainer_output_dir(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    output = FIXTURES / "frameworks" / "trainer_1proc" / "output"
    report = trend([output])
    assert [(p.name, p.step) for p in report.checkpoints] == [("checkpoint-4", 4), ("checkpoint-8", 8)]  # fmt: skip
    weights = [load_file(output / name / "model.safetensors") for name in ("checkpoint-4", "checkpoint-8")]  # fmt: skip
    tensors = {t.key: t for t in report.tensors}
    assert set(tensors) == set(weights[0])
    for key, item in tensors.items():
        assert item.norms == [pytest.approx(finite_norm(w[key]), rel=TOL) for w in weights]
        delta = weights[1][key].double() - weights[0][key].double()
        assert item.updates[1] == pytest.approx(float(delta.norm()), rel=TOL, abs=TOL)
    assert report.healthy and report.never_changed == []


def test_a_deepspeed_save_directory() -> None:
    """The tags in step order, read as their consolidated fp32 weights (no DeepSpeed import);
    the frozen parameter and the buffer never change."""
    checkpoints = FIXTURES / "deepspeed" / "stage2_fp32_1proc" / "checkpoints"
    report = trend([checkpoints])
    assert [(p.name, p.step) for p in report.checkpoints] == [("global_step2", 2), ("global_step4", 4)]  # fmt: skip
    assert sorted(report.never_changed) == ["frozen_scale", "position_bias"]
    modules = [
        torch.load(checkpoints / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        for tag in ("global_step2", "global_step4")
    ]
    tensors = {t.key: t for t in report.tensors}
    for key, item in tensors.items():
        assert item.norms == [pytest.approx(finite_norm(m[key]), rel=TOL) for m in modules]


def test_one_checkpoint_and_no_checkpoint(tmp_path: Path) -> None:
    (path,) = save_series(tmp_path, [{"a.weight": torch.ones(3)}])
    report = trend([path])
    assert report.tensors[0].norms == [pytest.approx(math.sqrt(3))]
    assert report.never_changed == [] and report.jumps == []
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(cli, ["trend", str(empty)])
    assert result.exit_code == 2 and result.stderr.startswith("Error: ")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_directory_of_dcp_checkpoints(tmp_path: Path) -> None:
    """step_N/ DCP directories (each a single-process dcp.save), ordered by their step field."""
    import torch.distributed.checkpoint as dcp

    weight = torch.ones(4, 4)
    for step in (300, 100, 200):
        state = {"model": {"layers.0.w": weight * step / 100, "layers.1.w": torch.ones(3)}, "step": step}  # fmt: skip
        dcp.save(state, checkpoint_id=str(tmp_path / f"run_{step}"))
    report = trend([tmp_path])
    assert [(p.step, p.section) for p in report.checkpoints] == [(100, "model"), (200, "model"), (300, "model")]  # fmt: skip
    tensors = {t.key: t for t in report.tensors}
    assert tensors["layers.0.w"].norms == [pytest.approx(4.0 * k) for k in (1, 2, 3)]
    assert tensors["layers.0.w"].relative_updates[1:] == [pytest.approx(1.0), pytest.approx(0.5)]
    assert report.never_changed == ["layers.1.w"] and report.frozen_modules == ["layers.1"]
