"""Every command on real files that hold config objects: builtin types as values (written with
Python 2's names by protocol 2), parent links (omegaconf's ``_parent``, a tree of nodes), a
list and a dict holding themselves. Made by ``torch.save`` (tests/fixtures/generate.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

BUILTIN_TYPES = FIXTURES / "special/builtin_types.pth"
PARENT_LINKS = FIXTURES / "special/parent_links.pth"
OMEGACONF = FIXTURES / "special/omegaconf_config.pth"
FILES = [BUILTIN_TYPES, PARENT_LINKS, OMEGACONF]


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def torch_tensor_keys(node: Any, prefix: str = "", seen: set[int] | None = None) -> set[str]:
    """The dotted keys of the tensors ``torch.load(weights_only=False)`` built, through dicts,
    lists, tuples and objects' attributes (each object once: the graphs have cycles)."""
    seen = set() if seen is None else seen
    if isinstance(node, torch.Tensor):
        return {prefix}
    if id(node) in seen:
        return set()
    seen.add(id(node))
    if isinstance(node, dict):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(node)]
    elif hasattr(node, "__dict__") and not isinstance(node, type):
        items = list(vars(node).items())
    else:
        return set()
    keys: set[str] = set()
    for name, child in items:
        keys |= torch_tensor_keys(child, f"{prefix}.{name}" if prefix else name, seen)
    return keys


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_show_lists_the_tensors_torch_load_sees(path: Path) -> None:
    result = run("show", path, "--json")
    assert result.exit_code == 0, result.output
    shown = {tensor["key"] for tensor in json.loads(result.stdout)["tensors"]}
    loaded = torch.load(path, map_location="cpu", weights_only=False)
    assert shown == torch_tensor_keys(loaded)
    assert run("show", path).exit_code == 0
    tree = run("show", path, "--tree")
    assert tree.exit_code == 0, tree.output
    assert run("show", path, "--tree", "--json").exit_code == 0


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_diff_convert_verify_accept_them(path: Path, tmp_path: Path) -> None:
    same = run("diff", path, path)
    assert same.exit_code == 0, same.output
    out = tmp_path / "model.safetensors"
    converted = run("convert", path, out)
    assert converted.exit_code == 0, converted.output
    verified = run("verify", path)
    assert verified.exit_code == 0, verified.output
    assert verified.stdout.startswith(f"{path}: OK")


def test_the_tree_shows_back_references() -> None:
    tree = json.loads(run("show", PARENT_LINKS, "--tree", "--json").stdout)
    node = "<back-reference to tests.fixtures.generate.TreeNode>"
    assert tree["tree"]["children"][0]["_parent"] == node
    assert tree["loop"] == [1, 2, "<back-reference to list>"]
    assert tree["mapping"] == {"name": "mapping", "self": "<back-reference to dict>"}
    config = json.loads(run("show", OMEGACONF, "--tree", "--json").stdout)["config"]
    model = config["_content"]["model"]
    assert model["_parent"] == "<back-reference to omegaconf.dictconfig.DictConfig>"
    assert model["_metadata"]["object_type"] == "<global builtins.dict>"


def test_builtin_types_show_under_their_python3_names() -> None:
    tree = json.loads(run("show", BUILTIN_TYPES, "--tree", "--json").stdout)
    assert tree["key_type"] == "<global builtins.int>"
    assert tree["kind"] == "<global builtins.str>"
    assert tree["span"] == "<global builtins.range>"


def test_scan_names_them_as_python_loads_them_and_as_written() -> None:
    result = run("scan", BUILTIN_TYPES, "--json")
    assert result.exit_code == 0, result.output  # only safe data constructs
    uses = {use["name"]: use for use in json.loads(result.stdout)["files"][0]["globals"]}
    assert uses["builtins.int"] == {
        "name": "builtins.int", "verdict": "safe", "count": 1, "written_as": "__builtin__.long"
    }  # fmt: skip
    assert uses["builtins.str"]["written_as"] == "__builtin__.unicode"
    assert uses["builtins.range"]["written_as"] == "__builtin__.xrange"
    assert uses["torch._utils._rebuild_tensor_v2"]["written_as"] is None
    # unknown classes (exit 1), nothing dangerous; OmegaConf's containers are known inert (0)
    for path, code, verdicts in ((PARENT_LINKS, 1, {"safe", "unknown"}), (OMEGACONF, 0, {"safe"})):
        scanned = run("scan", path, "--json")
        assert scanned.exit_code == code
        report = json.loads(scanned.stdout)["files"][0]
        assert report["error"] is None
        assert {use["verdict"] for use in report["globals"]} == verdicts
