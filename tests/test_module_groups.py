"""Module groups from structure, not from digits (issue 42, item 2): a number in a key folds
to ``#`` only when its siblings repeat the same keys and shapes; the different layers of an
``nn.Sequential`` and the numeric-looking names of a ``ModuleDict`` keep their own rows, in
``diff --by-module``, ``trend``, ``--plot``'s heatmap and ``show --tree``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

from ckpttool.cli import cli
from ckpttool.commands.diff.run import diff
from ckpttool.commands.trend import trend
from ckpttool.model.modules import ModuleGroups
from ckpttool.render.plot import layer_cells


class Both(nn.Module):
    """A sequential stem of different layers, three identical blocks and a different last one,
    and a ModuleDict whose names look like numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16)
        )
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)] + [nn.Linear(16, 4)])
        self.heads = nn.ModuleDict({"007": nn.Linear(4, 2), "1": nn.Linear(4, 3)})


class Transformer(nn.Module):
    """``layers.N`` of one structure, each with an MLP ``nn.Sequential`` inside (``mlp.0`` and
    ``mlp.2`` differ) and four identical experts."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attn": nn.Linear(8, 8),
                    "mlp": nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)),
                    "experts": nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4)),
                }
            )
            for _ in range(layers)
        )


def _state(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    for parameter in module.parameters():
        nn.init.normal_(parameter)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _pair(tmp_path: Path, module: nn.Module) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A's state dict, and B = A with every floating tensor changed."""
    a = _state(module, 0)
    b = {k: v + 1 if v.is_floating_point() else v for k, v in a.items()}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt", a


def _by_module_rows(path_a: Path, path_b: Path) -> list[str]:
    result = CliRunner().invoke(cli, ["diff", str(path_a), str(path_b), "--by-module", "--json"])
    assert result.exit_code == 1, result.output
    return [row["group"] for row in json.loads(result.stdout)["modules"]]


def test_a_sequential_keeps_each_layer(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    path_a, path_b, _ = _pair(tmp_path, model)
    assert _by_module_rows(path_a, path_b) == ["0", "2", "4"]
    groups = {g.group: g for g in trend([path_a, path_b]).groups}
    assert list(groups) == ["0", "2", "4"]
    assert groups["4"].tensors == 2


def test_a_transformer_folds_its_layers_and_nothing_else(tmp_path: Path) -> None:
    path_a, path_b, a = _pair(tmp_path, Transformer())
    assert _by_module_rows(path_a, path_b) == [
        "embed", "layers.#.attn", "layers.#.mlp.0", "layers.#.mlp.2", "layers.#.experts.#",
    ]  # fmt: skip
    layers, kinds, grid = layer_cells(diff(path_a, path_b, norms=True))
    assert layers == [0, 1, 2, 3]
    assert kinds == ["attn", "mlp.0", "mlp.2", "experts.#"]
    assert all(value > 0 for row in grid for value in row)
    # the rows' sums are over the tensors the rule puts in them
    by_name = {g.group: g for g in trend([path_a, path_b]).groups}
    assert by_name["layers.#.experts.#"].tensors == 4 * 4
    assert by_name["layers.#.mlp.2"].tensors == 4 * 2
    assert sum(g.tensors for g in by_name.values()) == len(a)


def test_a_model_with_both(tmp_path: Path) -> None:
    path_a, path_b, _ = _pair(tmp_path, Both())
    rows = _by_module_rows(path_a, path_b)
    assert rows == [
        "features.0", "features.2", "features.3", "blocks.#", "blocks.3", "heads.007", "heads.1",
    ]  # fmt: skip
    assert [g.group for g in trend([path_a, path_b]).groups] == rows
    # the heatmap's layers are the folded blocks' numbers only, not the stem's or the heads'
    layers, kinds, _ = layer_cells(diff(path_a, path_b, norms=True))
    assert layers == [0, 1, 2] and kinds == ["weight", "bias"]
    tree = CliRunner().invoke(cli, ["show", "--tree", str(path_a)])
    assert tree.exit_code == 0, tree.output
    lines = [line.strip().split(":")[0] for line in tree.stdout.splitlines()]
    assert {"0", "2", "3", "0..2", "007", "1"} <= set(lines)


def test_a_sequential_heatmap_has_no_layers(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    path_a, path_b, _ = _pair(tmp_path, model)
    layers, kinds, grid = layer_cells(diff(path_a, path_b, norms=True))
    assert (layers, kinds, grid) == ([], [], [])


def test_numeric_looking_names_of_alike_modules_fold() -> None:
    """Structure decides, not the kind of container: two heads of one shape are a repeat."""
    shape = ("float32", (2, 4))
    groups = ModuleGroups([("heads.007.weight", shape), ("heads.1.weight", shape)])
    assert groups.group("heads.007.weight") == groups.group("heads.1.weight") == "heads.#"


def test_the_largest_alike_set_folds_and_a_number_is_no_block_alone() -> None:
    alike, other = ("f16", (8, 8)), ("f16", (8, 2))
    keys = [(f"layers.{i}.w", alike) for i in range(5)] + [("layers.5.w", other)]
    keys += [(f"pair.{i}.w", alike if i < 2 else other) for i in range(4)]
    keys += [("one.3.w", alike), ("top.0", alike), ("top.1", alike)]
    groups = ModuleGroups(keys)
    assert groups.group("layers.4.w") == "layers.#"
    assert groups.group("layers.5.w") == "layers.5"
    # a tie: the set met first folds
    assert [groups.group(f"pair.{i}.w") for i in range(4)] == ["pair.#", "pair.#", "pair.2", "pair.3"]  # fmt: skip
    assert groups.group("one.3.w") == "one.3"  # one block is not a repeat
    assert groups.group("top.1") == "top"  # a tensor's own name is its name, not a block
    assert groups.group("unknown.2.w") == "unknown.2"
