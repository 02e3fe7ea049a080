"""``argparse.Namespace`` has one answer everywhere: plain data, read as its attributes.

Its instances only carry attributes, so the reader emulates it as the dict of them (never
importing argparse), ``scan`` classes it ``safe`` and ``show`` does not warn about it. torch
itself is stricter: ``torch.load(weights_only=True)`` refuses it unless allow-listed.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.pickle.interpreter import load_pickle

ARGS = argparse.Namespace(lr=1e-3, batch_size=32, layers=[1, 2], inner=argparse.Namespace(a=1))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_read_as_the_dict_of_its_attributes(protocol: int) -> None:
    result = load_pickle(pickle.dumps({"args": ARGS, "empty": argparse.Namespace()}, protocol))
    assert result.root == {
        "args": {"lr": 1e-3, "batch_size": 32, "layers": [1, 2], "inner": {"a": 1}},
        "empty": {},
    }
    assert type(result.root["args"]) is dict  # a plain dict in the tree, like OrderedDict
    assert set(result.globals_seen) == {("argparse", "Namespace", "safe")}


@pytest.mark.parametrize("protocol", [0, 1])
def test_old_protocols_read_it_too(protocol: int) -> None:
    # protocols 0/1 build objects through copyreg._reconstructor(cls, builtins.object, None):
    # builtins.object makes the default mode refuse them, so this is scan's mode
    result = load_pickle(pickle.dumps(ARGS, protocol), refuse_dangerous=False)
    assert result.root == {"lr": 1e-3, "batch_size": 32, "layers": [1, 2], "inner": {"a": 1}}


def test_show_scan_and_torch(tmp_path: Path) -> None:
    path = tmp_path / "run.pth"
    torch.save({"args": ARGS, "weight": torch.ones(2)}, path)
    with open_checkpoint(path) as ckpt:
        assert ckpt.root["args"]["inner"] == {"a": 1}
    runner = CliRunner()
    shown = runner.invoke(cli, ["show", str(path)])
    assert shown.exit_code == 0
    assert "Namespace" not in shown.stderr  # nothing opaque to warn about
    scanned = runner.invoke(cli, ["scan", str(path)])
    assert scanned.exit_code == 0
    assert scanned.stdout.startswith("clean: only safe data constructs referenced")
    # torch 2.13 is stricter than ckpttool here: it refuses the class unless allow-listed
    with pytest.raises(pickle.UnpicklingError, match=r"argparse\.Namespace"):
        torch.load(path, weights_only=True)
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert torch.load(path, weights_only=True)["args"] == ARGS
