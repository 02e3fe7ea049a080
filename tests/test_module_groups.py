"""Module groups from structure, not digits: only runs of blocks alike in keys, dtypes and
shapes fold; every other numbered module is a row of its own, in show --tree, diff
--by-module, trend and --plot alike. The state dicts are real torch modules'."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ckpttool.cli import cli
from ckpttool.commands.diff.modules import by_module, top_changed
from ckpttool.commands.diff.run import diff
from ckpttool.model.modules import ModuleGroups, fold_runs
from ckpttool.render import plot


class Block(nn.Module):
    """A transformer block: attention and MLP projections, a norm."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Linear(width, hidden, bias=False)
        self.norm = nn.LayerNorm(width)


class Transformer(nn.Module):
    def __init__(self, layers: int = 3, last_hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        blocks = [Block() for _ in range(layers - 1)]
        self.layers = nn.ModuleList([*blocks, Block(hidden=last_hidden)])
        self.head = nn.Linear(8, 10, bias=False)


class Both(nn.Module):
    """A convolutional stem (an nn.Sequential of different layers) and a stack of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 4, 3), nn.ReLU(), nn.Conv1d(4, 8, 3), nn.ReLU(), nn.BatchNorm1d(8)
        )
        self.layers = nn.ModuleList([Block() for _ in range(4)])


class Heads(nn.Module):
    """A ModuleDict keyed '0' and '1' holding different modules."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"0": nn.Linear(8, 2), "1": nn.Conv1d(8, 2, 1)})
        self.scale = nn.Parameter(torch.ones(1))


def sequential() -> nn.Module:
    # 0 and 2 have different shapes, 4 too; 2 and 4 are not consecutive (a ReLU between)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


#: each model's groups, in the order they first appear (diff --by-module and trend)
MODELS: dict[str, tuple[Callable[[], nn.Module], list[str]]] = {
    "sequential": (sequential, ["0", "2", "4"]),
    "transformer": (
        Transformer,
        ["embed", "layers.#.attn", "layers.#.mlp", "layers.#.norm", "head"],
    ),
    "both": (
        Both,
        [
            "features.0",
            "features.2",
            "features.4",
            "layers.#.attn",
            "layers.#.mlp",
            "layers.#.norm",
        ],
    ),
    "moduledict": (Heads, ["scale", "heads.0", "heads.1"]),
    # layers.0..1 alike, layers.2's MLP wider: the alike ones fold, the other is its own row
    "partial": (
        lambda: Transformer(layers=3, last_hidden=24),
        [
            "embed",
            "layers.0..1.attn",
            "layers.0..1.mlp",
            "layers.0..1.norm",
            "layers.2.attn",
            "layers.2.mlp",
            "layers.2.norm",
            "head",
        ],
    ),
}


def state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    factory, _ = MODELS[name]
    module = factory()
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def save_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A and B: B every tensor nudged."""
    a = state_dict(name)
    g = torch.Generator().manual_seed(1)
    b = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt"


def groups_of(state: dict[str, torch.Tensor]) -> list[str]:
    names = ModuleGroups((k, (str(v.dtype), tuple(v.shape))) for k, v in state.items())
    return list(dict.fromkeys(names.groups().values()))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_helper_groups_by_structure(name: str) -> None:
    assert groups_of(state_dict(name)) == MODELS[name][1]


def test_fold_runs_needs_consecutive_numbers_and_equal_signatures() -> None:
    assert fold_runs({0: "a", 1: "a", 2: "a"}) == [range(0, 3)]
    assert fold_runs({0: "a", 2: "a", 4: "a"}) == []  # gaps: an nn.Sequential with activations
    assert fold_runs({0: "a", 1: "b"}) == []
    assert fold_runs({3: "a", 0: "b", 1: "a", 2: "a"}) == [range(1, 4)]  # number order
    assert fold_runs({0: "a"}) == []  # one block repeats nothing


def test_a_dtype_difference_breaks_a_run() -> None:
    state = state_dict("transformer")
    state["layers.1.mlp.weight"] = state["layers.1.mlp.weight"].half()
    assert groups_of(state)[1:4] == ["layers.0.attn", "layers.0.mlp", "layers.0.norm"]


def test_blocks_keyed_in_text_order_still_fold() -> None:
    """safetensors-style sorted keys (layers.0, layers.1, layers.10, layers.2...)."""
    keys = sorted(f"layers.{i}.w" for i in range(12))
    names = ModuleGroups((k, ("float32", (2,))) for k in keys)
    assert set(names.groups().values()) == {"layers.#"}


@pytest.mark.parametrize("name", list(MODELS))
def test_diff_by_module_rows(name: str, tmp_path: Path) -> None:
    path_a, path_b = save_pair(tmp_path, name)
    result = CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--by-module", "--json"])
    data = json.loads(result.stdout)
    assert [m["group"] for m in data["modules"]] == MODELS[name][1]
    text = CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--by-module"]).stdout
    rows = [line.split()[0] for line in text.splitlines()[2:] if line.strip()][: len(MODELS[name][1])]  # fmt: skip
    assert rows == MODELS[name][1]


def test_diff_by_module_names_the_resized_layer(tmp_path: Path) -> None:
    """B widens layers.3's MLP: layers 0..2 fold, layers.3 is a row of its own."""
    torch.manual_seed(0)
    a = Transformer(layers=4).state_dict()
    b = {k: v.clone() for k, v in a.items()}
    b["layers.3.mlp.weight"] = torch.randn(24, 8)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    groups = [g.group for g in by_module(diff(tmp_path / "a.pt", tmp_path / "b.pt", norms=True))]
    assert groups == [
        "embed", "layers.0..2.attn", "layers.0..2.mlp", "layers.0..2.norm",
        "layers.3.attn", "layers.3.mlp", "layers.3.norm", "head",
    ]  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_trend_groups(name: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    state = state_dict(name)
    paths = []
    for step in range(3):
        state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        torch.save(state, tmp_path / f"ckpt_{step}.pt")
        paths.append(str(tmp_path / f"ckpt_{step}.pt"))
    result = CliRunner().invoke(cli, ["trend", *paths, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [group["group"] for group in data["groups"]] == MODELS[name][1]


#: show --tree's top level per model: folded runs as first..last, other numbers as themselves
TREE_TOP = {
    "sequential": ["0", "2", "4"],
    "transformer": ["embed.weight", "layers.0..2", "head.weight"],
    "both": ["features", "layers.0..3"],
    "moduledict": ["scale", "heads"],
    "partial": ["embed.weight", "layers", "head.weight"],
}
TREE_BELOW = {  # the numbered level's lines, where it is not the top: (its parent, its lines)
    "both": ("features", ["0", "2", "4"]),
    "moduledict": ("heads", ["0", "1"]),
    "partial": ("layers", ["0..1", "2"]),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_show_tree(name: str, tmp_path: Path) -> None:
    torch.save(state_dict(name), tmp_path / "m.pt")
    result = CliRunner().invoke(cli, ["show", "--tree", str(tmp_path / "m.pt")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    top = [line.strip().split(":")[0] for line in lines if line.startswith("  ") and not line.startswith("    ")]  # fmt: skip
    assert top == TREE_TOP[name]
    if name in TREE_BELOW:
        parent, expected = TREE_BELOW[name]
        start = lines.index(next(line for line in lines if line.startswith(f"  {parent}:")))
        below = []
        for line in lines[start + 1 :]:
            if not line.startswith("    "):
                break
            if not line.startswith("      "):
                below.append(line.strip().split(":")[0])
        assert below == expected


def test_plot_heatmap_rows_are_the_stack_and_the_stem_is_left_out(tmp_path: Path) -> None:
    path_a, path_b = save_pair(tmp_path, "both")
    report = diff(path_a, path_b, norms=True)
    layers, kinds, _ = plot.layer_cells(report)
    assert layers == [0, 1, 2, 3]  # features.0/2/4 are no layers of a stack
    assert kinds == ["attn", "mlp", "norm"]


def test_plot_heatmap_keeps_the_odd_layer(tmp_path: Path) -> None:
    path_a, path_b = save_pair(tmp_path, "partial")
    layers, kinds, grid = plot.layer_cells(diff(path_a, path_b, norms=True))
    assert layers == [0, 1, 2] and kinds == ["attn", "mlp", "norm"]
    assert all(cell == cell for row in grid for cell in row)  # no NaN: every layer measured


@pytest.mark.parametrize("name", ["sequential", "moduledict"])
def test_plot_without_a_stack_draws_a_bar_per_group(name: str, tmp_path: Path) -> None:
    path_a, path_b = save_pair(tmp_path, name)
    report = diff(path_a, path_b, norms=True)
    assert plot.layer_cells(report)[0] == []
    figure = plot.diff_figure(report, by_module(report), top_changed(report, 3), str(tmp_path / "p.png"))  # fmt: skip
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    assert labels == MODELS[name][1]
