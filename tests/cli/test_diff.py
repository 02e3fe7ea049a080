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

from ckpttool.checkpoint import Checkpoint
from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

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
        "key                                status    A                B                max abs diff    max rel diff    rel change    cosine      changed    mismatched      notes\n"
        "---------------------------------  --------  ---------------  ---------------  --------------  --------------  ------------  ----------  ---------  --------------  -------\n"
        "model.layers.0.mlp.up_proj.weight  differ    float32 [16, 8]  float32 [16, 8]  0.25            1.362           0.3144        0.95194553  0.781%     1/128 (0.781%)\n"
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
        "comparing A's 'model' section with all of B (use --section-a/--section-b to choose)\n"
        # exit 0 compares the weights; what only A's kind holds is named, never passed over
        "note: not compared: A's optimizer, epoch, step, world_size, wandb_id, scaler (outside "
        "its 'model' section): the other side holds nothing under those names\n"
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
    aligned = run(PAIRS / "ddp.pth", BASE)  # module. on every key: aligned automatically
    assert aligned.exit_code == 0
    assert aligned.stderr == "note: A's tensor keys are B's with the prefix 'module.': compared without it\n"  # fmt: skip
    assert run(PAIRS / "ddp.pth", BASE, "--ignore-wrappers").exit_code == 0
    explicit = run(BASE, PAIRS / "ddp.pth", "--strip-prefix", "module.")
    assert explicit.exit_code == 0 and explicit.stderr == ""
    other = run(BASE, PAIRS / "ddp.pth", "--strip-prefix", "other.")
    assert other.exit_code == 0 and "with the prefix 'module.'" in other.stderr


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


def test_json_reports_rounding_and_key_prefixes() -> None:
    """The keys added for issue 12. The whole document is held to docs/schemas/diff.schema.json
    and to the excerpt in docs/diff.md by tests/test_json_schemas.py."""
    result = run(FIXTURES / "minimind/pretrain_32_resume.pth", FIXTURES / "safetensors/model.safetensors", "--json")  # fmt: skip
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["rounded"] is False and data["a"]["prefix"] is None and data["b"]["prefix"] is None
    assert data["summary"] == {"identical": 0, "within_tolerance": 0, "differ": 21, "only_a": 0, "only_b": 0, "equal_after_rounding": 0}  # fmt: skip


def test_json_fields_and_inf_values(tmp_path: Path) -> None:
    import torch

    data = json.loads(run(PAIRS / "lightning_a.ckpt", PAIRS / "lightning_b.ckpt", "--json").stdout)
    no_tensor = {"a_tensor": None, "b_tensor": None}
    assert data["fields"] == [
        {"key": "global_step", "status": "changed", "a": 40, "b": 80, **no_tensor},
        {"key": "hyper_parameters.optim.lr", "status": "changed", "a": 0.001, "b": 0.002, **no_tensor},
    ]  # fmt: skip
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
    assert missing.exit_code == 2 and missing.stderr == (
        f"Error: {BASE}: no section 'optimizer' in this checkpoint (--section applies to both "
        "files; to compare B's 'optimizer' with all of A, use --section-b optimizer)\n"
    )


def test_diff_does_not_import_torch() -> None:
    code = (
        "import sys; from ckpttool.cli import cli\n"
        f"code = cli.main(['diff', {str(BASE)!r}, {str(PAIRS / 'base.safetensors')!r}], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_progress_bar_goes_to_stderr_and_json_stays_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpttool.io.progress

    class Eager(ckpttool.io.progress.Progress):
        """A terminal that is always there and work that is always slow."""

        def __init__(self, total: int, label: str, **options: Any) -> None:
            super().__init__(total, label, enabled=True, delay=0.0)

    monkeypatch.setattr(ckpttool.io.progress, "Progress", Eager)
    result = run(BASE, PAIRS / "base_fp16.pth", "--json")
    assert result.stderr.startswith("\rdiff [") and result.stderr.endswith("\n")
    assert json.loads(result.stdout)["equal"] is True
    quick = run(BASE, PAIRS / "base_fp16.pth", "--quick")
    assert "diff [" not in quick.stderr  # nothing to read, no bar


# --- issue 12: type changes, --rounded, hidden rows, per-side sections, alignment -------------


def test_a_type_change_is_one_line_and_one_json_field(tmp_path: Path) -> None:
    import torch

    weights = {"w": torch.ones(2)}
    torch.save({"model_state_dict": weights, "loss": 2.5}, tmp_path / "float.pt")
    torch.save({"model_state_dict": weights, "loss": torch.tensor(2.5)}, tmp_path / "tensor.pt")
    result = run(tmp_path / "float.pt", tmp_path / "tensor.pt")
    assert result.exit_code == 1
    assert result.stdout == (
        "loss: 2.5 (float) -> 2.5 (tensor float32 [])\n"
        "\n"
        "1 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"
    )
    data = json.loads(run(tmp_path / "float.pt", tmp_path / "tensor.pt", "--json").stdout)
    assert data["fields"] == [
        {"key": "loss", "status": "type_changed", "a": 2.5, "b": 2.5, "a_tensor": None,
         "b_tensor": {"key": "loss", "dtype": "float32", "shape": []}},
    ]  # fmt: skip
    assert [t["key"] for t in data["tensors"]] == ["model_state_dict.w"]
    quick = run(tmp_path / "tensor.pt", tmp_path / "float.pt", "--quick")
    assert quick.stdout.startswith("loss: (tensor float32 []) -> 2.5 (float)\n")


CKPTTOOL_WEIGHTS = FIXTURES / "ckpttool/pretrain_32.pth"  # float16, written from the model below
CKPTTOOL_RESUME = FIXTURES / "ckpttool/pretrain_32_resume.pth"  # its model in float32


def test_rounded_fp16_weights_against_the_fp32_resume_file() -> None:
    result = run(CKPTTOOL_WEIGHTS, CKPTTOOL_RESUME, "--rounded")
    assert result.exit_code == 0
    assert result.stdout == (
        "0 identical, 21 equal after rounding, 0 differ within tolerance, 0 differ, "
        "0 only in A, 0 only in B\n"
    )
    assert "--rounded" not in result.stderr
    strict = run(CKPTTOOL_WEIGHTS, CKPTTOOL_RESUME)
    assert strict.exit_code == 1 and SUMMARY.match(strict.stdout.splitlines()[-1])
    assert strict.stderr.splitlines()[-1] == (
        "note: the dtypes differ: 21 tensors are float16 in A and float32 in B, compared in the "
        "wider dtype. To check whether one side is exactly the other rounded to its dtype, use "
        "--rounded"
    )
    data = json.loads(run(CKPTTOOL_WEIGHTS, CKPTTOOL_RESUME, "--rounded", "--json").stdout)
    assert data["rounded"] is True and data["equal"] is True
    assert data["summary"]["equal_after_rounding"] == 21
    first = data["tensors"][0]
    assert first["status"] == "equal_after_rounding"
    assert first["values"]["compared_as"] == "float16"
    assert first["values"]["cast"] == {"b": "float32 -> float16"}
    assert first["changes"] == ["dtype float16 -> float32, compared after rounding to float16"]


def test_rows_equal_after_rounding_are_listed_only_with_all() -> None:
    listed = run(BASE, PAIRS / "base_fp16.pth", "--rounded", "--all")
    assert listed.exit_code == 0
    rows = listed.stdout.splitlines()[2:-2]
    assert len(rows) == 12
    assert all("equal after rounding" in row and row.endswith("compared after rounding to float16") for row in rows)  # fmt: skip
    quiet = run(BASE, PAIRS / "base_fp16.pth", "--rounded")
    assert quiet.stdout == (
        "0 identical, 12 equal after rounding, 0 differ within tolerance, 0 differ, "
        "0 only in A, 0 only in B\n"
    )


def test_a_lossless_cast_lists_no_rows_without_all() -> None:
    # base_fp16 holds exactly base's values: compared in float32 nothing differs, so no row is
    # listed (the summary still counts them; the note suggests --rounded); --all lists them.
    quiet = run(BASE, PAIRS / "base_fp16.pth")
    assert quiet.exit_code == 0
    assert quiet.stdout == (
        "0 identical, 12 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"
    )
    assert "use --rounded" in quiet.stderr
    listed = run(BASE, PAIRS / "base_fp16.pth", "--all")
    rows = listed.stdout.splitlines()[2:-2]
    assert len(rows) == 12 and all("within tolerance" in row for row in rows)


def test_section_per_side_and_the_hint_when_section_names_one_side_only(tmp_path: Path) -> None:
    import torch

    weights = torch.load(BASE, weights_only=True)
    general = tmp_path / "tutorial.pt"
    torch.save({"epoch": 5, "model_state_dict": weights, "loss": 0.5}, general)
    shared = run(general, BASE, "--section", "model_state_dict")
    assert shared.exit_code == 2 and shared.stderr == (
        f"Error: {BASE}: no section 'model_state_dict' in this checkpoint (--section applies to "
        "both files; to compare A's 'model_state_dict' with all of B, use --section-a "
        "model_state_dict)\n"
    )
    result = run(general, BASE, "--section-a", "model_state_dict")
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout == "12 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"  # fmt: skip
    assert run(BASE, general, "--section-b", "model_state_dict").exit_code == 0
    data = json.loads(run(general, BASE, "--section-a", "model_state_dict", "--json").stdout)
    assert (data["a"]["section"], data["a"]["auto_section"], data["b"]["section"]) == (
        "model_state_dict", False, None
    )  # fmt: skip


def test_dcp_directory_aligns_with_a_plain_file_of_its_model(tmp_path: Path) -> None:
    import torch

    model = torch.load(FIXTURES / "dcp/checkpoint.pth", weights_only=True)["model"]
    torch.save({f"module.{key}": value for key, value in model.items()}, tmp_path / "ddp.pth")
    result = run(FIXTURES / "dcp/checkpoint", tmp_path / "ddp.pth")
    assert result.exit_code == 0
    assert result.stdout == "12 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B\n"  # fmt: skip
    assert result.stderr.splitlines()[-2:] == [
        "note: B's tensor keys are A's with the prefix 'module.': compared without it",
        "note: not compared: A's optimizer, epoch, step, world_size (outside its 'model' "
        "section): the other side holds nothing under those names",
    ]
    data = json.loads(run(FIXTURES / "dcp/checkpoint", tmp_path / "ddp.pth", "--json").stdout)
    assert data["b"]["prefix"] == "module." and data["a"]["section"] == "model"
    torch.save({"model": model, "step": 1200}, tmp_path / "nested.pth")
    torch.save(model, tmp_path / "plain.pth")
    nested = run(tmp_path / "nested.pth", tmp_path / "plain.pth")
    assert nested.exit_code == 0 and nested.stderr == (
        "note: A (training checkpoint) and B (plain state dict) are different kinds: comparing "
        "A's 'model' section with all of B (use --section-a/--section-b to choose)\n"
        "note: not compared: A's step (outside its 'model' section): the other side holds "
        "nothing under those names\n"
    )


def test_help_documents_the_new_options() -> None:
    text = CliRunner().invoke(cli, ["diff", "--help"]).stdout
    for option in ("--section-a KEY", "--section-b KEY", "--rounded", "--all"):
        assert option in text
    assert "tensor.to(dtype)" in text and "one extra prefix" in text


def test_wrapper_prefixes_on_both_sides_get_a_hint_in_text_and_json() -> None:
    a, b = FIXTURES / "wrapped/compiled.pth", FIXTURES / "wrapped/ddp.pth"
    hint = (
        "12 keys only in A are keys only in B once DDP/torch.compile wrapper prefixes are removed "
        "(12 of A's start with '_orig_mod.'; 12 of B's start with 'module.'): use "
        "--ignore-wrappers to compare them"
    )
    result = run(a, b)
    assert result.exit_code == 1
    assert f"note: {hint}\n" in result.stderr
    assert hint not in result.stdout
    assert hint in json.loads(run(a, b, "--json").stdout)["notes"]
    assert run(a, b, "--ignore-wrappers").exit_code == 0


def test_two_paths_flattening_to_one_key_is_an_error_naming_both(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "same_key.pth"
    torch.save({"a.b": {"c": torch.ones(2)}, "a": {"b.c": torch.ones(2)}}, path)
    result = run(path, path)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path}: two paths flatten to the same key 'a.b.c': ['a.b']['c'] and "
        "['a']['b.c']; tensors are named by their dotted path, which cannot tell them apart\n"
    )
    shown = CliRunner().invoke(cli, ["show", str(path)])
    assert "warning: two paths flatten to the same key 'a.b.c'" in shown.stderr
