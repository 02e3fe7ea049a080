"""diff --by-module and --top N: the rollup by module group against sums computed here."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.diff.modules import by_module, top_changed
from ckpttool.commands.diff.run import diff
from ckpttool.model.modules import ModuleGroups
from ckpttool.render.text import BLOCKS, bar

LAYERS = 4


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(50, 16, generator=g)}
    for i in range(LAYERS):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(16, 16, generator=g)
        out[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(32, 16, generator=g)
        out[f"model.layers.{i}.mlp.up_proj.bias"] = torch.randn(32, generator=g)
    out["lm_head.weight"] = torch.randn(50, 16, generator=g)
    return out


@pytest.fixture
def finetuned(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """Attention frozen, every MLP nudged, layer 2's up_proj weight scaled by 3."""
    a = model()
    g = torch.Generator().manual_seed(1)
    b = {k: v + 0.01 * torch.randn(v.shape, generator=g) if ".mlp." in k else v.clone() for k, v in a.items()}  # fmt: skip
    b["model.layers.2.mlp.up_proj.weight"] = a["model.layers.2.mlp.up_proj.weight"] * 3
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt", a, b


def in_group(key: str, group: str) -> bool:
    """Whether ``key`` is a tensor of ``group`` (``#`` standing for any block number)."""
    module = re.escape(group).replace("\\#", "[0-9]+")
    return re.fullmatch(module + r"\.[^.]+", key) is not None


def test_module_group_folds_block_numbers() -> None:
    same = ("float32", (4, 4))
    keys = ["model.layers.3.mlp.up_proj.weight", "model.layers.4.mlp.up_proj.weight"]
    keys += [f"blocks.{i}.attn.{j}.weight" for i in range(2) for j in range(2)]
    groups = ModuleGroups([(key, same) for key in [*keys, "lm_head.weight", "scale"]])
    assert groups.group("model.layers.3.mlp.up_proj.weight") == "model.layers.#.mlp.up_proj"
    assert groups.group("blocks.0.attn.1.weight") == "blocks.#.attn.#"
    assert groups.group("lm_head.weight") == "lm_head"
    assert groups.group("scale") == "scale"


def test_groups_are_parameter_weighted(finetuned: tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:  # fmt: skip
    path_a, path_b, a, b = finetuned
    groups = {g.group: g for g in by_module(diff(path_a, path_b, norms=True))}
    assert list(groups) == [
        "model.embed_tokens", "model.layers.#.self_attn.q_proj", "model.layers.#.mlp.up_proj",
        "lm_head",
    ]  # fmt: skip
    for name, group in groups.items():
        keys = [k for k in a if in_group(k, name)]
        diff_sq = sum(float((b[k].double() - a[k].double()).norm() ** 2) for k in keys)
        norm_sq = sum(float(a[k].double().norm() ** 2) for k in keys)
        assert group.tensors == len(keys)
        assert group.parameters == sum(a[k].numel() for k in keys)
        assert group.relative_change == pytest.approx(math.sqrt(diff_sq / norm_sq), rel=1e-9, abs=1e-12)  # fmt: skip
    frozen = groups["model.layers.#.self_attn.q_proj"]
    assert frozen.relative_change == 0.0 and frozen.changed == 0
    assert groups["model.layers.#.mlp.up_proj"].changed == 2 * LAYERS


def test_without_norms_identical_tensors_are_not_measured(finetuned: tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:  # fmt: skip
    path_a, path_b, _, _ = finetuned
    groups = {g.group: g for g in by_module(diff(path_a, path_b))}
    frozen = groups["model.layers.#.self_attn.q_proj"]
    assert frozen.unmeasured == LAYERS and frozen.relative_change is None


def test_top_lists_the_most_changed_first(finetuned: tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:  # fmt: skip
    path_a, path_b, a, b = finetuned
    report = diff(path_a, path_b)
    top = top_changed(report, 3)
    changes = {k: float((b[k].double() - a[k].double()).norm() / a[k].double().norm()) for k in a}
    expected = sorted((k for k in a if changes[k] > 0), key=lambda k: -changes[k])[:3]
    assert [entry.key for entry in top] == expected
    assert top[0].key == "model.layers.2.mlp.up_proj.weight"
    assert len(top_changed(report, 1000)) == 2 * LAYERS  # frozen tensors are not listed


def test_cli_by_module_text_and_json(finetuned: tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("COLUMNS", "80")  # the bar's width follows the terminal's
    path_a, path_b, _, _ = finetuned
    runner = CliRunner()
    result = runner.invoke(cli, ["diff", str(path_a), str(path_b), "--by-module", "--top", "2"])
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.startswith("model.layers.#.mlp.up_proj "))
    assert row.endswith(BLOCKS[8] * 10)  # the largest group: a full bar (80 columns: 10 cells)
    frozen = next(line for line in lines if line.startswith("model.layers.#.self_attn.q_proj "))
    assert not any(block in frozen for block in BLOCKS[1:])
    assert "\x1b" not in result.stdout  # no colour when not a terminal
    assert "model.layers.2.mlp.up_proj.weight" in result.stdout
    data = json.loads(runner.invoke(cli, ["diff", str(path_a), str(path_b), "--by-module", "--top", "2", "--json"]).stdout)  # fmt: skip
    groups = {g["group"]: g for g in data["modules"]}
    assert groups["model.layers.#.self_attn.q_proj"]["relative_change"] == 0.0
    assert data["top"][0] == "model.layers.2.mlp.up_proj.weight"
    plain = json.loads(runner.invoke(cli, ["diff", str(path_a), str(path_b), "--json"]).stdout)
    assert "modules" not in plain and "top" not in plain


def test_quick_refuses_by_module(finetuned: tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:  # fmt: skip
    path_a, path_b, _, _ = finetuned
    result = CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--quick", "--by-module"])
    assert result.exit_code == 2 and "--quick" in result.output


def test_bar_lengths() -> None:
    assert bar(1.0, 1.0, 10) == BLOCKS[8] * 10
    assert bar(0.5, 1.0, 10) == BLOCKS[8] * 5
    assert bar(0.5, 1.0, 1) == BLOCKS[4]
    assert bar(math.inf, 1.0, 4) == BLOCKS[8] * 4
    assert bar(1e-9, 1.0, 10) == BLOCKS[1]  # changed: visible
    assert bar(0.0, 1.0, 10) == "" and bar(None, 1.0, 10) == ""


@pytest.mark.parametrize(("columns", "cells"), [(40, 10), (60, 60 - 30 - 3), (80, 40), (200, 40)])
def test_bars_fit_the_terminal(monkeypatch: pytest.MonkeyPatch, columns: int, cells: int) -> None:
    """10 to 40 cells, what the terminal has left after the table (here 30 columns wide)."""
    from ckpttool.render.text import table, with_bars

    monkeypatch.setenv("COLUMNS", str(columns))
    text = with_bars(table([["a", "1"], ["bb", "2"]], ["name", "a long column header"]), [1.0, 0.5])  # fmt: skip
    lines = text.splitlines()
    assert len(lines[1].split("  ")[0]) + 2 + len("a long column header") + 2 == 30
    assert lines[2].endswith(" " + BLOCKS[8] * cells)
    assert lines[3].endswith(" " + BLOCKS[8] * (cells // 2) + (BLOCKS[4] if cells % 2 else ""))


# The norms of identical tensors (--by-module decodes them for their group's ‖W‖): one
# float64 pass per chunk when every element is finite, the counting path otherwise.

NORM_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]  # fmt: skip


def _identical_pair(tmp_path: Path, nonfinite: bool) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """One tensor per dtype, small (read in blocks) and large (streamed in chunks of 4096
    elements here), equal on both sides, and a changed one; NaN and Inf in some."""
    g = torch.Generator().manual_seed(3)
    a: dict[str, torch.Tensor] = {}
    for dtype in NORM_DTYPES:
        name = str(dtype).removeprefix("torch.")
        for size, suffix in ((300, "small"), (10_000, "large")):
            values = torch.randn(size, generator=g) * 5
            if nonfinite and suffix == "large":
                values[7], values[9_000] = math.nan, -math.inf
            if nonfinite and dtype == torch.float8_e4m3fn:  # no Inf: its top code is NaN
                values[9_000 if suffix == "large" else 3] = math.nan
            a[f"{name}.{suffix}.weight"] = values.to(dtype)
    a["f64.large.weight"] = torch.randn(10_000, generator=g, dtype=torch.float64) * 1e200
    b = {k: v.clone() for k, v in a.items()}
    b["changed.weight"] = torch.ones(4)
    a["changed.weight"] = torch.zeros(4) + 0.5
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt", a


@pytest.mark.parametrize("nonfinite", [False, True])
def test_identical_norms_equal_the_reference_and_the_counting_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nonfinite: bool) -> None:  # fmt: skip
    from ckpttool.commands.diff import values as diff_values

    monkeypatch.setattr(diff_values, "CHUNK", 4096)  # the large tensors: three chunks each
    path_a, path_b, a = _identical_pair(tmp_path, nonfinite)
    runner = CliRunner()
    argv = ["diff", str(path_a), str(path_b), "--by-module", "--json"]
    fast = json.loads(runner.invoke(cli, argv).stdout)
    # the counting path for every chunk: what the measures computed before the one-pass sum
    monkeypatch.setattr(diff_values, "square_sum", lambda x: math.nan)
    counted = json.loads(runner.invoke(cli, argv).stdout)
    assert [t["key"] for t in fast["tensors"]] == [t["key"] for t in counted["tensors"]]
    for mine, theirs in zip(fast["tensors"], counted["tensors"]):
        for field in ("norm_a", "norm_b", "diff_norm", "relative_change", "cosine_similarity"):
            assert mine["values"][field] == pytest.approx(theirs["values"][field], rel=1e-12), (mine["key"], field)  # fmt: skip
    for mine, theirs in zip(fast["modules"], counted["modules"], strict=True):
        assert mine.keys() == theirs.keys()
        for field, value in mine.items():
            if isinstance(value, float):
                assert value == pytest.approx(theirs[field], rel=1e-12), (mine["group"], field)
            else:
                assert value == theirs[field], (mine["group"], field)
    for entry in fast["tensors"]:
        tensor = a[entry["key"]].double()
        finite = tensor[torch.isfinite(tensor)]
        expected = float(finite.square().sum().sqrt())
        if entry["key"] == "f64.large.weight":
            expected = math.inf  # its squares overflow float64, in either path
        assert entry["values"]["norm_a"] == pytest.approx(expected, rel=1e-12), entry["key"]


def test_identical_norms_do_not_use_blas_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenBLAS splits np.dot of a long vector across threads, which on a busy machine made
    --by-module of a pair with one changed element 3.6x a plain diff: identical chunks are
    summed by NumPy's own loop."""
    import numpy as np

    from ckpttool.commands.diff import values as diff_values

    monkeypatch.setattr(diff_values, "CHUNK", 4096)
    path_a, _, a = _identical_pair(tmp_path, nonfinite=False)
    del a["changed.weight"]
    torch.save(a, tmp_path / "b.pt")  # every tensor identical to A's

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("np.dot called for an identical chunk")

    monkeypatch.setattr(np, "dot", refuse)
    report = diff(path_a, tmp_path / "b.pt", norms=True)
    measured = [entry for entry in report.tensors if entry.values is not None]
    assert len(measured) == len(a) and all(entry.values.measured for entry in measured)  # type: ignore[union-attr]


def test_identical_tensors_over_several_blocks_are_measured_as_they_are_compared(
    tmp_path: Path,
) -> None:
    """A large identical tensor's norm is summed from A's blocks while the two files' bytes are
    compared (no second read): every block counts once, a NaN in a later block is counted and
    left out of the sums, and a block that differs after equal ones starts the measures over."""
    from ckpttool.io.blocks import BLOCK

    g = torch.Generator().manual_seed(3)
    count = 2 * BLOCK // 4 + 1000  # three blocks of float32
    a = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(count, generator=g),
        "model.layers.1.mlp.up_proj.weight": torch.randn(count, generator=g),
    }
    a["model.layers.0.mlp.up_proj.weight"][BLOCK // 4 + 5] = math.nan  # in the second block
    b = {k: v.clone() for k, v in a.items()}
    b["model.layers.1.mlp.up_proj.weight"][-1] += 1.0  # the last block differs
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt", norms=True)
    values = {entry.key: entry.values for entry in report.tensors}
    same = values["model.layers.0.mlp.up_proj.weight"]
    assert same is not None and same.bitwise_equal and same.measured
    tensor = a["model.layers.0.mlp.up_proj.weight"].double()
    finite = tensor[torch.isfinite(tensor)]
    assert (same.elements, same.nan_a, same.nan_b) == (count, 1, 1)
    assert same.norm_a == pytest.approx(float(finite.square().sum().sqrt()), rel=1e-12)
    assert same.norm_b == same.norm_a and same.diff_norm == 0.0
    changed = values["model.layers.1.mlp.up_proj.weight"]
    assert changed is not None and not changed.bitwise_equal and changed.elements == count
    other = a["model.layers.1.mlp.up_proj.weight"].double()
    assert changed.norm_a == pytest.approx(float(other.norm()), rel=1e-12)
    assert changed.diff_norm == pytest.approx(1.0, rel=1e-6)


def test_optimizer_groups_are_not_their_step_counters() -> None:
    """Issue 49 item 13: between two Trainer checkpoints every optimizer group read 1, the
    change of its ``step`` counter (4 -> 8, one element that outweighs the moments). The
    counters are left out and counted; the moments make the group's change (torch's values of
    Trainer's own ``optimizer.pt`` are the oracle)."""
    output = Path(__file__).resolve().parent / "fixtures/frameworks/trainer_1proc/output"
    report = diff(output / "checkpoint-4", output / "checkpoint-8", norms=True)
    groups = {g.group: g for g in by_module(report) if g.group.startswith("optimizer.state.")}
    before = torch.load(output / "checkpoint-4/optimizer.pt", weights_only=True)["state"]
    after = torch.load(output / "checkpoint-8/optimizer.pt", weights_only=True)["state"]
    assert {int(before[i]["step"]) for i in before} == {4}  # the counter alone would read 1
    assert sum(g.counters for g in groups.values()) == len(before)
    for name, group in groups.items():
        first, _, last = name.removeprefix("optimizer.state.").partition("..")
        indices = range(int(first), int(last or first) + 1)
        moments = [(before[i][m].double(), after[i][m].double()) for i in indices
                   for m in ("exp_avg", "exp_avg_sq")]  # fmt: skip
        diff_sq = sum(float(((b - a) ** 2).sum()) for a, b in moments)
        base_sq = sum(float((a**2).sum()) for a, _ in moments)
        assert group.counters == len(indices)
        assert math.isclose(group.relative_change, math.sqrt(diff_sq / base_sq), rel_tol=1e-9), name
        assert group.relative_change != 1.0
