"""ckpttool merge: linear, task arithmetic, TIES and SLERP of tiny Hugging Face-style state
dicts (safetensors), against mergekit's formulas written out in torch here (against mergekit's
own run_merge: tests/test_merge_mergekit.py), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpttool.cli import cli
from ckpttool.commands.merge import PROVENANCE_KEY
from ckpttool.model import merge_methods

SHAPES = {
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.mlp.up_proj.weight": (12, 8),
    "model.norm.weight": (8,),
}
POSITION = "model.rotary_emb.position_ids"  # an int buffer, equal in every model


def models(directory: Path, count: int, dtype: torch.dtype = torch.float32) -> list[Path]:
    """A base and ``count - 1`` fine-tunes of it (base + noise), one safetensors file each."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    base = {name: torch.randn(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    paths = []
    for index in range(count):
        state = {
            name: (value + 0.1 * torch.randn(value.shape, dtype=torch.float64) if index else value)
            for name, value in base.items()
        }
        out = {name: value.to(dtype) for name, value in state.items()}
        out[POSITION] = torch.arange(6)
        paths.append(directory / f"model_{index}.safetensors")
        save_file(out, paths[-1])
    return paths


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, ["merge", *(str(a) for a in args)])


def loaded(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    return [load_file(p) for p in paths]


# --- mergekit's formulas, in torch (mergekit commit 0031a40) ----------------------------------


def mk_linear(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    stacked = torch.stack(tensors, dim=0)
    w = torch.tensor(weights, dtype=stacked.dtype)
    while len(w.shape) < len(stacked.shape):
        w.unsqueeze_(-1)
    return (w * stacked).sum(dim=0) / w.sum(dim=0)


def mk_magnitude(tensor: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return tensor
    k = max(1, int(density * tensor.numel()))  # mergekit 0.1.5
    mask = torch.zeros_like(tensor)
    topk = torch.argsort(tensor.abs().view(-1), descending=True)[:k]
    mask.view(-1)[topk] = 1
    return tensor * mask


def mk_gta(
    base: torch.Tensor,
    tensors: list[torch.Tensor],
    weights: list[float],
    *,
    density: float,
    consensus: bool,
    normalize: bool,
    lam: float = 1.0,
) -> torch.Tensor:
    deltas = torch.stack([mk_magnitude(t - base, density) for t in tensors], dim=0)
    w = torch.tensor(weights, dtype=deltas.dtype)
    while len(deltas.shape) > len(w.shape):
        w.unsqueeze_(-1)
    weighted = deltas * w
    if consensus:
        sign = weighted.sign()
        majority = (weighted.sum(dim=0) >= 0).to(weighted.dtype) * 2 - 1
        mask = sign == majority
        mixed = (weighted * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = weighted.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    return base + lam * mixed


def mk_slerp(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    a, b = v0.double(), v1.double()
    u0 = a / a.norm() if a.norm() > 1e-8 else a
    u1 = b / b.norm() if b.norm() > 1e-8 else b
    dot = (u0 * u1).sum()
    if dot.abs() > 0.9995:
        return (1 - t) * a + t * b
    theta_0 = torch.arccos(dot)
    theta_t = theta_0 * t
    s0 = torch.sin(theta_0 - theta_t) / torch.sin(theta_0)
    s1 = torch.sin(theta_t) / torch.sin(theta_0)
    return s0 * a + s1 * b


def expected(states: list[dict[str, torch.Tensor]], combine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Each float tensor combined in float64 and rounded once to the base's dtype."""
    return {
        name: combine([s[name].double() for s in states]).to(states[0][name].dtype)
        for name in SHAPES
    }


def assert_merged(out: Path, want: dict[str, torch.Tensor]) -> None:
    got = load_file(out)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[POSITION], torch.arange(6))


# --- each method against its formula --------------------------------------------------------


def test_linear_normalises_the_weights_over_base_and_models(tmp_path: Path) -> None:
    paths = models(tmp_path, 3)
    out = tmp_path / "out.safetensors"
    result = run(*paths, "-o", out, "--method", "linear", "--weights", "1,2,5")
    assert result.exit_code == 0, result.output
    assert_merged(out, expected(loaded(paths), lambda xs: mk_linear(xs, [1, 2, 5])))
    with safe_open(out, "pt") as f:
        meta = json.loads(f.metadata()[PROVENANCE_KEY])
    assert meta["method"] == "linear" and [m["weight"] for m in meta["models"]] == [2, 5]


@pytest.mark.parametrize("lam", [1.0, 0.6])
def test_task_arithmetic_adds_lambda_times_the_weighted_task_vectors(
    tmp_path: Path, lam: float
) -> None:
    paths = models(tmp_path, 3)
    out = tmp_path / "out.safetensors"
    args = ["--method", "task-arithmetic", "--weights", "0.7,0.4", "--lambda", str(lam)]
    assert run(*paths, "-o", out, *args).exit_code == 0
    want = expected(
        loaded(paths),
        lambda xs: mk_gta(xs[0], xs[1:], [0.7, 0.4], density=1.0, consensus=False,
                          normalize=False, lam=lam),
    )  # fmt: skip
    assert_merged(out, want)


@pytest.mark.parametrize(("density", "weights"), [(0.5, "1,1"), (0.3, "0.8,0.5"), (0.9, "1,3")])
def test_ties_trims_elects_the_sign_by_mass_and_averages_the_agreeing(
    tmp_path: Path, density: float, weights: str
) -> None:
    paths = models(tmp_path, 4)[:1] + models(tmp_path / "more", 4)[1:]  # base + 3 fine-tunes
    w = [float(x) for x in weights.split(",")] + [0.6]
    out = tmp_path / "out.safetensors"
    result = run(*paths, "-o", out, "--method", "ties", "--density", density,
                 "--weights", f"{weights},0.6")  # fmt: skip
    assert result.exit_code == 0, result.output
    want = expected(
        loaded(paths),
        lambda xs: mk_gta(xs[0], xs[1:], w, density=density, consensus=True, normalize=True),
    )
    assert_merged(out, want)
    # trimming and the sign election change the result: not plain task arithmetic
    plain = expected(
        loaded(paths),
        lambda xs: mk_gta(xs[0], xs[1:], w, density=1.0, consensus=False, normalize=True),
    )
    got = load_file(out)
    assert not torch.allclose(got["model.layers.0.mlp.up_proj.weight"],
                              plain["model.layers.0.mlp.up_proj.weight"])  # fmt: skip


def test_ties_at_density_1_is_task_arithmetic_with_sign_consensus(tmp_path: Path) -> None:
    paths = models(tmp_path, 3)
    out = tmp_path / "out.safetensors"
    assert run(*paths, "-o", out, "--method", "ties", "--lambda", "0.5").exit_code == 0
    want = expected(
        loaded(paths),
        lambda xs: mk_gta(xs[0], xs[1:], [1, 1], density=1.0, consensus=True, normalize=True,
                          lam=0.5),
    )  # fmt: skip
    assert_merged(out, want)


def test_ties_with_agreeing_signs_is_the_mean_task_vector(tmp_path: Path) -> None:
    """Where every task vector has the same sign, TIES at density 1 is task arithmetic with
    the weights normalised."""
    torch.manual_seed(3)
    base = torch.randn(6, 5)
    states = [base, base + torch.rand(6, 5) + 0.1, base + 2 * torch.rand(6, 5) + 0.1]
    paths = []
    for index, value in enumerate(states):
        paths.append(tmp_path / f"m{index}.safetensors")
        save_file({"w": value}, paths[-1])
    out = tmp_path / "ties.safetensors"
    assert run(*paths, "-o", out, "--method", "ties", "--weights", "1,3").exit_code == 0
    ta = tmp_path / "ta.safetensors"
    args = ["--method", "task-arithmetic", "--weights", "0.25,0.75"]
    assert run(*paths, "-o", ta, *args).exit_code == 0
    torch.testing.assert_close(load_file(out)["w"], load_file(ta)["w"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t", [0.25, 0.5, 0.9])
def test_slerp_interpolates_each_tensor_on_the_sphere(tmp_path: Path, t: float) -> None:
    paths = models(tmp_path, 2)
    out = tmp_path / "out.safetensors"
    assert run(*paths, "-o", out, "--method", "slerp", "--t", t).exit_code == 0
    want = expected(loaded(paths), lambda xs: mk_slerp(t, xs[0], xs[1]))
    assert_merged(out, want)
    states = loaded(paths)
    name = "model.layers.0.self_attn.q_proj.weight"
    lerp = ((1 - t) * states[0][name].double() + t * states[1][name].double()).float()
    assert not torch.equal(load_file(out)[name], lerp)  # not a plain lerp


@pytest.mark.parametrize("t", [0.0, 1.0])
def test_slerp_at_the_ends_returns_the_endpoints(tmp_path: Path, t: float) -> None:
    paths = models(tmp_path, 2)
    out = tmp_path / "out.safetensors"
    assert run(*paths, "-o", out, "--method", "slerp", "--t", t).exit_code == 0
    end = loaded(paths)[int(t)]
    got = load_file(out)
    for name in SHAPES:
        torch.testing.assert_close(got[name], end[name], rtol=1e-6, atol=1e-7)


def test_slerp_of_colinear_tensors_is_a_lerp(tmp_path: Path) -> None:
    torch.manual_seed(1)
    v = torch.randn(7, 3, dtype=torch.float64)
    save_file({"w": v.float()}, tmp_path / "a.safetensors")
    save_file({"w": (2.5 * v).float()}, tmp_path / "b.safetensors")
    out = tmp_path / "out.safetensors"
    args = [tmp_path / "a.safetensors", tmp_path / "b.safetensors", "-o", out]
    assert run(*args, "--method", "slerp", "--t", "0.4").exit_code == 0
    a, b = load_file(tmp_path / "a.safetensors")["w"], load_file(tmp_path / "b.safetensors")["w"]
    want = (0.6 * a.double() + 0.4 * b.double()).float()
    assert torch.equal(load_file(out)["w"], want)


def test_fp16_models_are_merged_in_float64_and_rounded_once(tmp_path: Path) -> None:
    paths = models(tmp_path, 3, torch.float16)
    out = tmp_path / "out.safetensors"
    assert run(*paths, "-o", out, "--method", "task-arithmetic").exit_code == 0
    want = expected(
        loaded(paths),
        lambda xs: mk_gta(xs[0], xs[1:], [1, 1], density=1.0, consensus=False, normalize=False),
    )
    got = load_file(out)
    for name, value in want.items():
        assert got[name].dtype == torch.float16 and torch.equal(got[name], value)


def test_json_and_pth_output(tmp_path: Path) -> None:
    paths = models(tmp_path, 3)
    out = tmp_path / "out.pth"
    result = run(*paths, "-o", out, "--method", "ties", "--density", "0.5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["method"] == "ties" and data["density"] == 0.5 and data["lambda"] == 1.0
    assert [i["role"] for i in data["inputs"]] == ["base", "model", "model"]
    assert data["ints"] == [POSITION] and data["merged"] == len(SHAPES)
    state = torch.load(out, weights_only=True)
    want = expected(
        loaded(paths),
        lambda xs: mk_gta(xs[0], xs[1:], [1, 1], density=0.5, consensus=True, normalize=True),
    )
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)


# --- refusals --------------------------------------------------------------------------------


def one_line_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    for fragment in fragments:
        assert fragment in result.stderr


def test_a_missing_tensor_is_refused_by_name(tmp_path: Path) -> None:
    paths = models(tmp_path, 2)
    state = load_file(paths[1])
    del state["model.norm.weight"]
    save_file(state, paths[1])
    out = tmp_path / "out.safetensors"
    one_line_error(run(*paths, "-o", out, "--method", "linear"), "lacks model.norm.weight")
    assert not out.exists()


def test_a_shape_mismatch_is_refused_by_name(tmp_path: Path) -> None:
    paths = models(tmp_path, 2)
    state = load_file(paths[1])
    state["model.norm.weight"] = torch.zeros(9)
    save_file(state, paths[1])
    out = tmp_path / "out.safetensors"
    result = run(*paths, "-o", out, "--method", "slerp", "--t", "0.5")
    one_line_error(result, "model.norm.weight is [9]")
    assert not out.exists()


def test_unequal_integer_tensors_are_refused(tmp_path: Path) -> None:
    paths = models(tmp_path, 2)
    state = load_file(paths[1])
    state[POSITION] = torch.arange(6) + 1
    save_file(state, paths[1])
    result = run(*paths, "-o", tmp_path / "out.safetensors", "--method", "task-arithmetic")
    one_line_error(result, POSITION)


@pytest.mark.parametrize(
    ("count", "args", "fragment"),
    [
        (3, ["--method", "slerp", "--t", "0.5"], "two models"),
        (2, ["--method", "slerp"], "--t"),
        (2, ["--method", "slerp", "--t", "1.5"], "--t"),
        (3, ["--method", "linear", "--weights", "1,2"], "--weights gives 2"),
        (3, ["--method", "ties", "--weights", "1,2,3"], "--weights gives 3"),
        (3, ["--method", "ties", "--density", "0"], "--density"),
        (3, ["--method", "task-arithmetic", "--density", "0.5"], "--density is for"),
        (3, ["--method", "linear", "--weights", "1,x,2"], "--weights takes numbers"),
        (3, ["--method", "linear", "--weights", "1,-1,0"], "sum to 0"),
        (3, ["--method", "linear", "--lambda", "0.5"], "--lambda is for"),
    ],
)
def test_bad_parameters_are_refused(
    tmp_path: Path, count: int, args: list[str], fragment: str
) -> None:
    paths = models(tmp_path, count)
    one_line_error(run(*paths, "-o", tmp_path / "out.safetensors", *args), fragment)


# --- the arithmetic module -------------------------------------------------------------------


def test_magnitude_keeps_the_largest_entries() -> None:
    delta = np.array([0.1, -3.0, 2.0, -0.5, 0.0, 1.0])
    assert merge_methods.magnitude(delta, 0.5).tolist() == [0.0, -3.0, 2.0, 0.0, 0.0, 1.0]
    assert merge_methods.magnitude(delta, 1.0) is delta


def test_ties_entries_no_model_moves_stay_at_base() -> None:
    base = np.array([1.0, 2.0, 3.0])
    models = [np.array([1.0, 2.5, 2.0]), np.array([1.0, 3.5, 3.5])]
    merged = merge_methods.task_arithmetic(base, models, [1.0, 1.0], consensus=True,
                                           normalize=True)  # fmt: skip
    # entry 0: no delta, divisor 0 -> 1; entry 1: both +, mean 1.0; entry 2: -1 vs +0.5, sum -0.5
    assert merged.tolist() == [1.0, 3.0, 2.0]


def test_slerp_of_a_zero_tensor_follows_mergekit() -> None:
    """A zero vector is not normalised, so the cosine is 0 and the angle a right one:
    mergekit gives sin(t pi/2) v, not a lerp."""
    zero, v = np.zeros(4), np.array([1.0, -2.0, 0.5, 3.0])
    got = merge_methods.slerp(0.3, zero, v)
    np.testing.assert_allclose(got, np.sin(0.3 * np.pi / 2) * v, rtol=1e-15)
    np.testing.assert_allclose(got, mk_slerp(0.3, torch.zeros(4), torch.from_numpy(v)).numpy())


def test_the_worked_example_of_docs_merge_md(tmp_path: Path) -> None:
    values = {"base": [1, 2, 3, 4], "chat": [1.5, 1, 3, 6], "code": [0, 2.7, 3.4, 4.5]}
    paths = []
    for name, value in values.items():
        paths.append(tmp_path / f"{name}.safetensors")
        save_file({"w": torch.tensor(value, dtype=torch.float64)}, paths[-1])
    out = tmp_path / "out.safetensors"

    def merged(*args: object) -> list[float]:
        assert run(*args, "-o", out, "--force").exit_code == 0
        return load_file(out)["w"].tolist()

    assert merged(*paths, "--method", "ties", "--density", "0.5") == [0, 1, 3, 6]
    ta = merged(*paths, "--method", "task-arithmetic", "--lambda", "0.5")
    np.testing.assert_allclose(ta, [0.75, 1.85, 3.2, 5.25], rtol=1e-15)
    linear = merged(*paths, "--method", "linear", "--weights", "0,1,1")
    np.testing.assert_allclose(linear, [0.75, 1.85, 3.2, 5.25], rtol=1e-15)
    slerp = merged(*paths[:2], "--method", "slerp", "--t", "0.5")
    np.testing.assert_allclose(slerp, [1.2629, 1.5155, 3.0309, 5.0516], atol=1e-4)


def test_ties_of_minimind_resume_files_through_the_library(tmp_path: Path) -> None:
    """Any layout ckpttool reads: three MiniMind resume .pth files (model, int buffer,
    optimizer), merged with the library call, the tied embedding stored once."""
    from ckpttool.commands.merge import merge
    from tests.test_average import STEPS, TIED, resume_files

    states = resume_files(tmp_path / "run", torch.float32)
    paths = [tmp_path / "run" / f"resume_{s}.pth" for s in STEPS]
    out = tmp_path / "ties.safetensors"
    report = merge(paths[0], paths[1:], out, method="ties", density=0.4, lam=0.8,
                   weights=[0.6, 1.2])  # fmt: skip
    assert report.ints == ["model.position_ids"] and report.merged == report.tensors - 1
    got = load_file(out)
    assert set(states[0]) - set(got) <= TIED
    for key, tensor in got.items():
        xs = [s[key].double() for s in states]
        if key == "model.position_ids":
            assert torch.equal(tensor, states[0][key])
            continue
        want = mk_gta(xs[0], xs[1:], [0.6, 1.2], density=0.4, consensus=True, normalize=True,
                      lam=0.8).float()  # fmt: skip
        torch.testing.assert_close(tensor, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("command", ["merge", "average"])
def test_weights_that_are_not_numbers_are_one_line(tmp_path: Path, command: str) -> None:
    for name in ("a", "b"):
        save_file({"w": torch.ones(2)}, tmp_path / f"{name}.safetensors")
    out = tmp_path / "out.safetensors"
    args = [command, str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    args += ["--method", "linear"] if command == "merge" else []
    result = CliRunner().invoke(cli, [*args, "-o", str(out), "--weights", "1,x"])
    assert result.exit_code == 2
    assert result.stderr == "Error: --weights takes numbers separated by commas; got '1,x'\n"
    assert not out.exists()
