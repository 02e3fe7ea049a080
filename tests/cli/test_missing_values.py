"""`convert` and `show` of one rank's FSDP2 file through the CLI: exit codes, messages, output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result
from safetensors import safe_open

from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

RANK1 = FIXTURES / "frameworks/fsdp2_2proc/model_world_size_2_rank_1.pt"


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_convert_of_dtensor_shards_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = run("convert", RANK1, out)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"Error: {RANK1}: 5 of the 6 tensors selected have no values")
    assert "DTensor shards" in result.stderr and "--skip-missing-values" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_skip_missing_values_writes_the_rest_with_a_note(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = run("convert", RANK1, out, "--skip-missing-values", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tensors"] == 1
    with safe_open(str(out), "pt") as handle:
        assert list(handle.keys()) == ["positions"]
    assert any(n.startswith("left out 5 tensor(s) without values") for n in report["notes"])
    assert "note: left out 5 tensor(s) without values (--skip-missing-values)" in result.stderr


def test_show_warns_and_notes_each_shard() -> None:
    result = run("show", RANK1)
    assert result.exit_code == 0
    row = next(line for line in result.stdout.splitlines() if line.startswith("proj.weight"))
    assert row.split()[1:3] == ["float32", "[5,"]
    assert row.endswith("DTensor Shard(dim=0), local [2, 4]")
    assert "warning: of the tensors listed, 5 are DTensor shards" in result.stderr
    data = json.loads(run("show", RANK1, "--json").stdout)
    assert any("5 are DTensor shards" in w for w in data["warnings"])
    (proj,) = [t for t in data["tensors"] if t["key"] == "proj.weight"]
    assert proj["dtensor"]["local_shape"] == [2, 4]
