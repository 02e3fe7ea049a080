"""diff --plot and trend --plot: the data each figure draws is the --json numbers (no pixels)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from ckpttool.cli import cli
from ckpttool.commands.diff.modules import by_module, top_changed
from ckpttool.commands.diff.run import diff
from ckpttool.commands.trend import trend
from ckpttool.render import plot


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    a = {}
    for i in range(3):
        a[f"model.layers.{i}.attn.weight"] = torch.randn(8, 8, generator=g)
        a[f"model.layers.{i}.mlp.weight"] = torch.randn(16, 8, generator=g)
    a["lm_head.weight"] = torch.randn(10, 8, generator=g)
    b = {k: v + 0.01 * (i + 1) * torch.randn(v.shape, generator=g) for i, (k, v) in enumerate(a.items())}  # fmt: skip
    b["model.layers.0.attn.weight"] = a["model.layers.0.attn.weight"].clone()  # frozen
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt"


def test_diff_figure_plots_the_json_numbers(pair: tuple[Path, Path], tmp_path: Path) -> None:
    path_a, path_b = pair
    result = CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--by-module", "--top", "4", "--json"])  # fmt: skip
    data = json.loads(result.stdout)
    report = diff(path_a, path_b, norms=True)
    figure = plot.diff_figure(report, by_module(report), top_changed(report, 4), str(tmp_path / "d.png"))  # fmt: skip
    heatmap, bars = figure.axes[0], figure.axes[1]  # (axes[2]: the colour bar)
    cells = np.ma.filled(heatmap.images[0].get_array(), np.nan)
    values = {t["key"]: t["values"] for t in data["tensors"]}
    for layer in range(3):
        for column, kind in enumerate(["attn", "mlp"]):
            v = values[f"model.layers.{layer}.{kind}.weight"]
            assert cells[layer, column] == pytest.approx(v["diff_norm"] / v["norm_a"], rel=1e-12, abs=1e-15)  # fmt: skip
    assert cells[0, 0] == 0.0  # the frozen one
    assert [label.get_text() for label in heatmap.get_xticklabels()] == ["attn", "mlp"]
    heights = [patch.get_width() for patch in bars.patches]
    assert heights == [pytest.approx(values[key]["relative_change"], rel=1e-12) for key in data["top"]]  # fmt: skip
    assert [label.get_text() for label in bars.get_yticklabels()] == data["top"]


def test_diff_plot_writes_a_png_of_the_expected_size(pair: tuple[Path, Path], tmp_path: Path) -> None:  # fmt: skip
    path_a, path_b = pair
    out = tmp_path / "change.png"
    result = CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--plot", str(out)])
    assert result.exit_code == 1, result.output
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size == (13 * plot.DPI, 4 * plot.DPI)
    svg = tmp_path / "change.svg"
    CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--plot", str(svg)])
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()


def test_trend_figure_plots_the_json_numbers(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 8, generator=g)
    for step in range(4):
        state = {"blocks.0.w": weight * (1 + 0.1 * step), "blocks.1.w": weight.clone()}
        if step == 2:
            state["blocks.0.w"][0, 0] = float("nan")
        torch.save(state, tmp_path / f"ckpt_{step}.pt")
    data = json.loads(CliRunner().invoke(cli, ["trend", str(tmp_path), "--json"]).stdout)
    figure = plot.trend_figure(trend([tmp_path]), str(tmp_path / "t.png"))
    norms_axes, updates_axes = figure.axes
    groups = {g["group"]: g for g in data["groups"]}
    lines = [line for line in norms_axes.get_lines() if line.get_label() in groups]
    assert [line.get_label() for line in lines] == list(groups)
    for line in lines:
        expected = [math.nan if v is None else v for v in groups[line.get_label()]["norms"]]
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
        assert list(line.get_xdata()) == [0, 1, 2, 3]  # no step counters: checkpoint index
    for line in (x for x in updates_axes.get_lines() if x.get_label() in groups):
        expected = [math.nan if v is None else v for v in groups[line.get_label()]["relative_updates"][1:]]  # fmt: skip
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
    marks = [line for line in norms_axes.get_lines() if line.get_label() == "first NaN/Inf"]
    assert [list(m.get_xdata()) for m in marks] == [[data["first_nonfinite"]["checkpoint"]] * 2]
    out = tmp_path / "trend.png"
    result = CliRunner().invoke(cli, ["trend", str(tmp_path), "--plot", str(out)])
    assert result.exit_code == 1
    with Image.open(out) as image:
        assert image.size == (11 * plot.DPI, 8 * plot.DPI)


def test_a_missing_matplotlib_is_one_line_naming_the_extra(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "x.png"
    result = CliRunner().invoke(cli, ["diff", *map(str, pair), "--plot", str(out)])
    assert result.exit_code == 2
    assert result.stderr == f"Error: {out}: --plot needs matplotlib: pip install 'ckpttool[plot]'\n"
    assert not out.exists()


def test_an_unknown_suffix_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["trend", *map(str, pair), "--plot", str(tmp_path / "x.jpg")])
    assert result.exit_code == 2 and ".png or .svg" in result.stderr
