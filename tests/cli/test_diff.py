"""`ckpttool diff` through the CLI: output contract, exit codes (JSON schema: tests/test_json_schemas.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from ckpttool.reader import Checkpoint
from tests.helpers import FIXTURES

PAIRS = FIXTURES / "pairs"
BASE = PAIRS / "base.pth"


SUMMARY = re.compile(
    r"^\d+ identical, \d+ differ within tolerance, \d+ differ, \d+ only in A, \d+ only in B$"
)


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, ["diff", *(str(a) for a in args)])


def test_equal_files_print_only_the_summary_and_exit_0() -> None:
    result = run(BASE, PAIRS / "base_legacy.pth")
    assert result.exit_code == 0
    assert (
        result.stdout
        == "12 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"
    )
    assert result.stderr == ""


def test_one_changed_element_table_is_exact() -> None:
    result = run(BASE, PAIRS / "one_element.pth")
    assert result.exit_code == 1
    assert result.stdout == (
        "key                                status    A                B                max abs diff    max rel diff    mismatched      notes\n"
        "---------------------------------  --------  ---------------  ---------------  --------------  --------------  --------------  -------\n"
        "model.layers.0.mlp.up_proj.weight  differ    float32 [16, 8]  float32 [16, 8]  0.25            1.362           1/128 (0.781%)\n"
        "\n"
        "11 identical, 0 differ within tolerance, 1 differ, 0 only in A, 0 only in B\n"
    )


def test_changed_fields_are_listed_above_as_a_to_b() -> None:
    result = run(PAIRS / "resume_a.pth", PAIRS / "resume_b.pth")
    assert result.exit_code == 1  # fields alone make the files differ
    assert result.stdout == (
        "step: 1200 -> 2400\n"
        "world_size: 8 -> 4\n"
        "wandb_id: 'run-a' -> 'run-b'\n"
        "config.model.dropout: 0.0 -> 0.1\n"
        "optimizer.param_groups.0.lr: 0.0005 -> 0.00025\n"
        "scaler.scale: 65536.0 -> 32768.0\n"
        "\n"
        "16 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"
    )


def test_all_lists_identical_tensors_and_the_rows_are_in_order() -> None:
    result = run(BASE, PAIRS / "structure.pth", "--all")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 2 + 13 + 2
    assert lines[10].split() == ["model.layers.0.mlp.down_proj.weight", "only", "in", "A",
                                 "float32", "[8,", "16]", "-"]  # fmt: skip
    assert lines[12].split()[:2] == ["model.norm.weight", "differ"]
    assert lines[12].endswith("shape [8] -> [2, 4]")
    assert lines[14].split()[:4] == ["model.extra.bias", "only", "in", "B"]
    assert (
        lines[-1] == "10 identical, 0 differ within tolerance, 1 differ, 1 only in A, 1 only in B"
    )
    without_all = run(BASE, PAIRS / "structure.pth").stdout.splitlines()
    assert len(without_all) == 2 + 3 + 2


def test_resume_against_weights_says_which_section() -> None:
    result = run(
        FIXTURES / "minimind/pretrain_32_resume.pth", FIXTURES / "minimind/pretrain_32.pth"
    )
    assert result.exit_code == 0
    assert SUMMARY.match(result.stdout.strip())
    assert result.stderr == (
        "note: A (MiniMind-style resume checkpoint) and B (plain state dict) are different kinds: "
        "comparing A's 'model' section with all of B (use --section to choose)\n"
    )


def test_dtype_cast_is_reported_and_tolerance_decides() -> None:
    a, b = PAIRS / "fine_fp32.pth", PAIRS / "fine_fp16.pth"
    strict = run(a, b)
    assert strict.exit_code == 1
    assert "dtype float32 -> float16, compared as float32" in strict.stdout
    loose = run(a, b, "--rtol", "1e-3")
    assert loose.exit_code == 0
    assert loose.stdout.endswith(
        "0 identical, 2 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"
    )


def test_wrappers_and_prefixes() -> None:
    assert run(PAIRS / "ddp.pth", BASE).exit_code == 1
    assert run(PAIRS / "ddp.pth", BASE, "--ignore-wrappers").exit_code == 0
    assert run(BASE, PAIRS / "ddp.pth", "--strip-prefix", "module.").exit_code == 0
    assert run(BASE, PAIRS / "ddp.pth", "--strip-prefix", "other.").exit_code == 1


def test_nan_row() -> None:
    result = run(BASE, PAIRS / "nan.pth")
    assert result.exit_code == 1
    row = result.stdout.splitlines()[2]
    assert row.startswith("model.norm.weight  differ") and row.endswith("NaN positions differ")


def test_quick_reads_no_bytes_through_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Checkpoint, record: Any) -> Any:
        raise AssertionError("read")

    monkeypatch.setattr(Checkpoint, "read_bytes", refuse)
    quick = run(PAIRS / "resume_a.pth", PAIRS / "resume_b.pth", "--quick")
    assert quick.exit_code == 1 and quick.stdout.startswith("step: 1200 -> 2400\n")
    assert "--quick: values not read" in quick.stderr
    same = run(BASE, PAIRS / "one_element.pth", "--quick", "--json")
    assert same.exit_code == 0
    data = json.loads(same.stdout)
    assert data["quick"] is True and all(t["values"] is None for t in data["tensors"])
    assert run(BASE, PAIRS / "one_element.pth").exit_code != 0  # the patch bites without --quick


# --- JSON -----------------------------------------------------------------------------------


def test_json_fields_and_inf_values(tmp_path: Path) -> None:
    import torch

    data = json.loads(run(PAIRS / "lightning_a.ckpt", PAIRS / "lightning_b.ckpt", "--json").stdout)
    assert data["fields"] == [
        {"key": "global_step", "status": "changed", "a": 40, "b": 80},
        {"key": "hyper_parameters.optim.lr", "status": "changed", "a": 0.001, "b": 0.002},
    ]
    assert data["equal"] is False
    torch.save({"t": torch.tensor([1.0, float("inf")])}, tmp_path / "a.pth")
    torch.save({"t": torch.tensor([0.0, 1.0]), "u": torch.zeros(1)}, tmp_path / "b.pth")
    result = run(tmp_path / "a.pth", tmp_path / "b.pth", "--json")
    data = json.loads(result.stdout)
    values = data["tensors"][0]["values"]
    assert values["max_abs_diff"] == "inf" and values["max_rel_diff"] == "inf"
    assert values["inf_positions_differ"] is True
    assert data["tensors"][1]["status"] == "only_b" and data["tensors"][1]["a"] is None


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "the file is empty"),
        (b"just some text\n", "not a checkpoint: unrecognised format"),
        ("truncated", "truncated"),
        ("directory", "is a directory"),
    ],
)
def test_bad_input_on_either_side_is_one_line_exit_2(
    tmp_path: Path, side: str, content: bytes | str | None, message: str
) -> None:
    bad = tmp_path / "bad.pth"
    if content == "truncated":
        bad.write_bytes(BASE.read_bytes()[:3000])
    elif content == "directory":
        bad.mkdir()
    elif isinstance(content, bytes):
        bad.write_bytes(content)
    args = (bad, BASE) if side == "a" else (BASE, bad)
    result = run(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {bad}") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_usage_exits_2() -> None:
    assert run(BASE).exit_code == 2
    assert run(BASE, BASE, "--rtol", "-1").exit_code == 2
    missing = run(BASE, PAIRS / "resume_a.pth", "--section", "optimizer")
    assert missing.exit_code == 2 and missing.stderr == f"Error: {BASE}: no section 'optimizer' in this checkpoint\n"  # fmt: skip


def test_diff_does_not_import_torch() -> None:
    code = (
        "import sys; from ckpttool.cli import cli\n"
        f"code = cli.main(['diff', {str(BASE)!r}, {str(PAIRS / 'base.safetensors')!r}], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_progress_bar_goes_to_stderr_and_json_stays_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpttool.progress

    class Eager(ckpttool.progress.Progress):
        """A terminal that is always there and work that is always slow."""

        def __init__(self, total: int, label: str, **options: Any) -> None:
            super().__init__(total, label, enabled=True, delay=0.0)

    monkeypatch.setattr(ckpttool.progress, "Progress", Eager)
    result = run(BASE, PAIRS / "base_fp16.pth", "--json")
    assert result.stderr.startswith("\rdiff [") and result.stderr.endswith("\n")
    assert json.loads(result.stdout)["equal"] is True
    quick = run(BASE, PAIRS / "base_fp16.pth", "--quick")
    assert "diff [" not in quick.stderr  # nothing to read, no bar
