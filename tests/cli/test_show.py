"""`ckpttool show` through the CLI: output contract, JSON schema, options, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.helpers import FIXTURES, fixture_files, fixture_id

RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("path", fixture_files(), ids=fixture_id)
def test_show_every_fixture(path: Path) -> None:
    result = run("show", path)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"file:       {path}"
    data = json.loads(run("show", path, "--json").stdout)
    assert data["num_tensors"] == len(data["tensors"]) > 0


def test_show_header_is_exact_for_a_minimind_resume() -> None:
    lines = run("show", RESUME).stdout.splitlines()
    assert lines[1].startswith("format:     torch-zip  (")
    assert lines[2] == "layout:     MiniMind-style resume checkpoint"
    assert lines[3] == "tensors:    81  (22.69K parameters)"
    assert "epoch:      1" in lines
    assert "step:       1200" in lines
    assert "world_size: 8" in lines
    assert "wandb_id:   'run-abc123'" in lines
    assert any(line.startswith("optimizer:  AdamW, state for 20 params") for line in lines)


def test_show_json_schema() -> None:
    data = json.loads(run("show", RESUME, "--json").stdout)
    assert {"format", "layout", "fields", "tensors", "size", "num_parameters"} <= set(data)
    assert data["format"] == "torch-zip"
    assert data["layout"] == "minimind_resume"
    assert data["fields"]["step"] == 1200
    assert data["fields"]["world_size"] == 8
    assert data["fields"]["wandb_id"] == "run-abc123"
    assert data["fields"]["scaler.scale"] == 65536.0
    first = data["tensors"][0]
    assert first["key"] == "model.model.embed_tokens.weight"
    assert first["dtype"] == "float16"
    assert first["shape"] == [64, 32]
    assert first["numel"] == 2048
    assert first["nbytes"] == 4096
    keys = [t["key"] for t in data["tensors"]]
    assert "optimizer.state.0.exp_avg" in keys
    assert data["optimizer"]["type_guess"] == "AdamW"
    assert data["optimizer"]["param_names"]["0"] == "model.embed_tokens.weight"  # parameter name


def test_plain_state_dict_keys_are_unprefixed() -> None:
    data = json.loads(run("show", FIXTURES / "minimind/pretrain_32.pth", "--json").stdout)
    assert data["tensors"][0]["key"] == "model.embed_tokens.weight"
    assert data["layout"] == "state_dict"


def test_filter_and_section() -> None:
    data = json.loads(run("show", RESUME, "--json", "--filter", "*exp_avg_sq").stdout)
    assert data["tensors"] and all(t["key"].endswith("exp_avg_sq") for t in data["tensors"])
    data = json.loads(run("show", RESUME, "--json", "--section", "model").stdout)
    assert all(t["key"].startswith("model.") for t in data["tensors"])
    assert len(data["tensors"]) == 21
    result = run("show", RESUME, "--section", "nope")
    assert result.exit_code == 2
    assert result.stderr == f"Error: {RESUME}: no section 'nope' in this checkpoint\n"


def test_stats_match_numpy(tmp_path: Path) -> None:
    path = tmp_path / "w.pth"
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    weight[1, 1] = float("nan")
    torch.save(
        {"w": weight, "view": weight.t()[1:], "half": torch.ones(3, dtype=torch.bfloat16)}, path
    )
    result = run("show", path, "--json", "--stats")
    stats = {t["key"]: t["stats"] for t in json.loads(result.stdout)["tensors"]}
    finite = weight[~weight.isnan()].double().numpy()
    assert stats["w"]["nan"] == 1
    assert stats["w"]["min"] == 0 and stats["w"]["max"] == 11
    assert stats["w"]["mean"] == pytest.approx(finite.mean())
    assert stats["w"]["std"] == pytest.approx(finite.std())
    view = weight.t()[1:].double().numpy()
    assert stats["view"]["mean"] == pytest.approx(np.nanmean(view))
    assert stats["half"] == {"min": 1.0, "max": 1.0, "mean": 1.0, "std": 0.0, "nan": 0, "inf": 0}
    assert "w: 1 NaN and 0 Inf values" in run("show", path, "--stats").stderr


def test_tree_view() -> None:
    out = run("show", RESUME, "--tree", "--depth", "1").stdout.splitlines()
    assert out[0] == "dict[7]"
    assert "  model: dict[21]" in out
    assert "  step: 1200" in out
    assert not any(line.startswith("    ") for line in out)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("minimind/pretrain_32_resume.pth", "resuming from it is lossy"),
        ("wrapped/ddp.pth", "wrapper prefixes"),
        ("special/namespace_config.pth", "tests.fixtures.generate.TrainConfig"),
    ],
)
def test_warnings_go_to_stderr(name: str, fragment: str) -> None:
    result = run("show", FIXTURES / name)
    assert fragment in result.stderr
    assert fragment not in result.stdout


def test_notes_for_tied_cuda_and_views() -> None:
    out = run("show", FIXTURES / "special/cuda_storages.pth").stdout
    assert "saved on cuda:0" in out
    assert "tied with" in out
    out = run("show", FIXTURES / "special/views.pth").stdout
    assert "non-contiguous" in out
    assert "shares storage with" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "the file is empty"),
        (b"just some text\n", "not a checkpoint: unrecognised format"),
    ],
)
def test_errors_are_one_line_exit_2(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "input.pth"
    if content is not None:
        path.write_bytes(content)
    result = run("show", path)
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_directory_truncated_and_torchscript(tmp_path: Path) -> None:
    assert "is a directory" in run("show", tmp_path).stderr
    truncated = tmp_path / "cut.pth"
    truncated.write_bytes(RESUME.read_bytes()[:5000])
    result = run("show", truncated)
    assert result.exit_code == 2 and "truncated" in result.stderr
    result = run("show", FIXTURES / "special/torchscript.pt")
    assert result.exit_code == 2 and "TorchScript" in result.stderr


def test_every_command_has_help_with_an_example() -> None:
    for name, command in cli.commands.items():
        result = run(name, "--help")
        assert result.exit_code == 0
        assert "Example" in (command.help or ""), name
    assert "Exit codes" in run("--help").stdout
