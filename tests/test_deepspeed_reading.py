"""DeepSpeed ZeRO directories as one checkpoint: ``show``, ``show --json``, ``verify`` and the
file-discovery API on every DeepSpeed-written fixture (tests/fixtures/deepspeed/) and every
damaged copy, compared with what DeepSpeed's own loaders saw (manifest.json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.show import show
from ckpttool.errors import CorruptCheckpointError, InputError
from ckpttool.frameworks.deepspeed.checks import summarize
from ckpttool.frameworks.deepspeed.files import record_value, zero_files
from ckpttool.model.records import OpaqueObject
from ckpttool.pickle.policy import Verdict, classify_global
from tests.fixtures.deepspeed.generate import CASES, DAMAGED, DEEPSPEED_DIR, MANIFEST, SAVE_DIR

MANIFEST_DATA = json.loads(MANIFEST.read_text())
CASE_NAMES = [case.name for case in CASES]
SCHEMA = json.loads((Path(__file__).parents[1] / "docs/schemas/show.schema.json").read_text())


def save_dir(case: str) -> Path:
    return DEEPSPEED_DIR / case / SAVE_DIR


def damaged(name: str) -> Path:
    return DEEPSPEED_DIR / DAMAGED / name / SAVE_DIR


def deepspeed_view(case: str, tag: str = "global_step4") -> dict[str, Any]:
    return MANIFEST_DATA["cases"][case]["deepspeed"]["tags"][tag]


def first_model_states(case: str, tag: str = "global_step4") -> dict[str, Any]:
    states = deepspeed_view(case, tag)["model_states"]
    return states[sorted(states)[0]]


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


# --- show: the library report ------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_show_reads_what_deepspeed_recorded(case) -> None:  # type: ignore[no-untyped-def]
    report = show(save_dir(case.name))
    summary = report.details["deepspeed"]
    recorded = first_model_states(case.name)
    assert report.layout == "deepspeed"
    assert (summary["stage"], summary["dtype"]) == (case.stage, case.dtype)
    assert summary["stage"] == recorded["zero_stage"]
    assert summary["dp_world_size"] == recorded["dp_world_size"] == case.processes
    assert summary["mp_world_size"] == recorded["mp_world_size"] == 1
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_version"):
        assert summary[key] == recorded[key], key
    assert (summary["tag"], summary["latest"]) == ("global_step4", "global_step4")
    assert summary["tags"] == ["global_step2", "global_step4"]
    assert summary["optimizer"]["type"] == "AdamW"
    assert report.num_parameters == summary["num_parameters"] == 340  # 335 trained + 5 frozen


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parameters_have_their_real_shapes(case) -> None:  # type: ignore[no-untyped-def]
    """Every parameter by name at the shape DeepSpeed recorded (param_shapes, frozen shapes,
    the module); under ZeRO-3 the module's entries are placeholders and the shapes still real.
    For ZeRO 1-3 they are the shapes zero_to_fp32 rebuilds."""
    summary = show(save_dir(case.name)).details["deepspeed"]
    recorded = first_model_states(case.name)
    shapes = {p["name"]: p["shape"] for p in summary["parameters"]}
    kinds = {p["name"]: p["kind"] for p in summary["parameters"]}
    expected = {
        name: shape for group in recorded["param_shapes"] or [] for name, shape in group.items()
    }
    expected.update(recorded["frozen_param_shapes"] or {})
    if case.stage != 3:  # the module stores full weights: every parameter's shape is there
        module = {
            n: t["shape"]
            for n, t in recorded["module"].items()
            if n not in recorded["buffer_names"]
        }
        expected.update(module)
    for alias, owner in (recorded["shared_params"] or {}).items():
        expected[alias] = expected[owner]
    assert shapes == expected
    fp32 = MANIFEST_DATA["cases"][case.name]["deepspeed"]["fp32_latest"]
    if case.stage > 0:
        assert {n: s for n, s in shapes.items() if n in fp32} == {
            n: t["shape"] for n, t in fp32.items() if n in shapes
        }
    assert kinds["head.weight"] == "shared"
    assert (
        next(p for p in summary["parameters"] if p["name"] == "head.weight")["owner"]
        == "embed.weight"
    )
    assert kinds["frozen_scale"] == ("parameter" if case.stage == 0 else "frozen")
    assert kinds["gate"] == ("parameter" if case.stage == 0 else "trained")
    assert summary["buffers"] == [{"name": "position_bias", "dtype": "float32", "shape": [6]}]
    assert summary["placeholders"] == (case.stage == 3)
    if case.stage == 3:
        stored = {p["name"]: p["stored"]["shape"] for p in summary["parameters"]}
        assert set(map(tuple, stored.values())) == {(0,)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_files_are_listed_with_roles_and_sizes(case) -> None:  # type: ignore[no-untyped-def]
    details = show(save_dir(case.name)).details
    files = MANIFEST_DATA["cases"][case.name]["files"]
    members = {m["name"]: m for m in details["members"]}
    for name, member in members.items():
        assert member["size"] == files[f"{SAVE_DIR}/{name}"]["size"]
    roles = sorted(m["role"] for m in members.values())
    model_files = case.processes if case.stage == 3 else 1
    optim_files = case.processes if case.stage > 0 else 0
    scripts = 2 if (save_dir(case.name) / "zero_to_fp32.py").exists() else 0
    assert roles == sorted(
        ["latest"] + ["model_states"] * model_files + ["optimizer_states"] * optim_files
        + ["script"] * scripts
    )  # fmt: skip
    optim = [m for m in members.values() if m["role"] == "optimizer_states"]
    assert sorted(m["rank"] for m in optim) == list(range(optim_files))
    prefix = "bf16_" if case.dtype == "bf16" else ""
    assert all(m["name"].startswith(f"global_step4/{prefix}zero_pp_rank_") for m in optim)


def test_partitions_show_the_padding() -> None:
    """2 ranks, 335 trained elements: ZeRO-2 saves 168 + 167 and records the 1 of padding; ZeRO-3
    pads each parameter (ceil(numel / 2)): 168 on each rank."""
    zero2 = show(save_dir("stage2_fp32_2proc")).details["deepspeed"]["partitions"]
    assert [(p["rank"], p["numel"], p["padding"]) for p in zero2] == [(0, 168, 0), (1, 167, 1)]
    zero3 = show(save_dir("stage3_fp32_2proc")).details["deepspeed"]["partitions"]
    assert [(p["rank"], p["numel"]) for p in zero3] == [(0, 168), (1, 168)]


def test_a_tag_directory_reads_on_its_own() -> None:
    report = show(save_dir("stage3_bf16_2proc") / "global_step2")
    summary = report.details["deepspeed"]
    assert (summary["tag"], summary["global_steps"], summary["global_samples"]) == (
        "global_step2",
        2,
        8,
    )
    assert summary["latest"] == "global_step4"  # the save directory's, for the record
    assert {m["name"] for m in report.details["members"]} == {
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }  # fmt: skip


# --- show: the CLI ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_NAMES)
def test_show_json_follows_its_schema(case: str) -> None:
    result = run("show", "--json", str(save_dir(case)))
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    Draft202012Validator(SCHEMA).validate(data)
    assert data["layout"] == "deepspeed"
    assert data["details"]["deepspeed"]["num_parameters"] == 340
    assert data["warnings"] == []  # DeepSpeed's records are known data, no "opaque" warning


def test_show_text_names_stage_counters_and_real_shapes() -> None:
    result = run("show", str(save_dir("stage3_bf16_2proc")))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert (
        "deepspeed:  ZeRO-3, bf16, 2 data-parallel x 1 model-parallel rank(s), DeepSpeed 0.19.8"
        in lines
    )
    assert "counters:   global_steps 4, global_samples 16, skipped_steps 0" in lines
    assert "scheduler:  last_batch_iteration=3" in lines
    assert any(line.startswith("parameters: 340: 8 trained (335 elements), 1 frozen (5 elements), 1 shared, 1 buffer")
               for line in lines)  # fmt: skip
    row = next(line for line in lines if line.startswith("embed.weight "))
    assert row.split()[:4] == ["embed.weight", "[13,", "8]", "104"]
    assert "placeholder" in row
    assert any(
        line.startswith("head.weight ") and "shared with embed.weight" in line for line in lines
    )


# --- damaged copies --------------------------------------------------------------------------

DAMAGE_PROBLEMS = {
    "optim_missing": "incomplete: global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing",
    "optim_truncated": "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt: corrupt or truncated",
    "latest_missing": "incomplete: latest is missing",
    "latest_dangling": "latest: names tag 'global_step9', which does not exist",
    "optim_empty": "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt: incomplete: the file is empty",
    "model_states_missing_z3": "incomplete: global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt is missing",
    "model_states_empty_z3": "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt: incomplete: the file is empty",
}  # fmt: skip


@pytest.mark.parametrize("case", CASE_NAMES)
def test_verify_passes_every_case(case: str) -> None:
    result = run("verify", str(save_dir(case)))
    assert result.exit_code == 0, result.output
    assert "DeepSpeed: latest names a tag" in result.output


@pytest.mark.parametrize("name", sorted(DAMAGE_PROBLEMS))
def test_verify_reports_each_damage_naming_the_file(name: str) -> None:
    result = run("verify", "--json", str(damaged(name)))
    assert result.exit_code == 1, result.output
    problems = json.loads(result.output)["files"][0]["problems"]
    assert any(DAMAGE_PROBLEMS[name] in problem for problem in problems), problems


def test_verify_goes_on_past_an_unreadable_rank_file(tmp_path: Path) -> None:
    """Rank 1's optimizer file truncated and rank 0's missing, in one tag: both reported."""
    copy = tmp_path / "ckpt"
    shutil.copytree(damaged("optim_truncated"), copy)
    (copy / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    result = run("verify", "--json", str(copy))
    assert result.exit_code == 1, result.output
    problems = json.loads(result.output)["files"][0]["problems"]
    assert problems == [
        "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt: corrupt or truncated zip archive "
        "(File is not a zip file (no end of central directory record)); an interrupted torch.save "
        "leaves files like this: use the previous checkpoint, or salvage what it still holds "
        "with ckpttool repair",
        "incomplete: global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (written "
        "by the framework; its resume needs it)",
    ]


def test_deepspeed_itself_fails_on_every_damaged_copy_verify_reports() -> None:
    """The manifest: DeepSpeed's own consolidation of the latest tag fails on each damaged copy
    (or, for latest_missing, finds no tag to read) where verify reports a problem."""
    for name in DAMAGE_PROBLEMS:
        view = MANIFEST_DATA[DAMAGED][name]["deepspeed"]["fp32_latest"]
        assert "error" in view, name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("latest_dangling", "latest: names tag 'global_step9', which does not exist"),
        ("optim_truncated", "zero_pp_rank_1_mp_rank_00_optim_states.pt: corrupt or truncated"),
        ("optim_empty", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt: incomplete: the file is empty"),
        ("model_states_empty_z3", "zero_pp_rank_1_mp_rank_00_model_states.pt: incomplete: the file is empty"),
    ],
)  # fmt: skip
def test_show_refuses_a_broken_tag_in_one_line(name: str, message: str) -> None:
    result = run("show", str(damaged(name)))
    assert result.exit_code == CorruptCheckpointError.exit_code
    assert len(result.output.strip().splitlines()) == 1
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("name", ["optim_missing", "latest_missing", "model_states_missing_z3"])
def test_show_reads_an_incomplete_tag_and_says_what_is_missing(name: str) -> None:
    result = run("show", str(damaged(name)))
    assert result.exit_code == 1, result.output  # shown, and found incomplete (issue 49)
    assert "missing:    " in result.output
    assert "complete:   no" in result.output


# --- the file-discovery API ----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_zero_files_of_every_case(case) -> None:  # type: ignore[no-untyped-def]
    files = zero_files(save_dir(case.name))
    assert (files.tag, files.latest) == ("global_step4", "global_step4")
    assert files.tag_dir == os.path.join(save_dir(case.name), "global_step4")
    assert files.save_dir == str(save_dir(case.name))
    assert files.tags == ("global_step2", "global_step4")
    model_ranks = range(case.processes) if case.stage == 3 else range(1)
    assert list(files.model_states) == [(0, dp) for dp in model_ranks]
    assert files.partitioned_model_states == (case.stage == 3)
    assert list(files.optim_states) == (
        [(0, dp) for dp in range(case.processes)] if case.stage else []
    )
    for path in [*files.model_states.values(), *files.optim_states.values()]:
        assert os.path.isfile(path) and os.path.dirname(path) == files.tag_dir
    if case.stage:
        assert files.dtype_hint == ("bf16" if case.dtype == "bf16" else None)
    # a tag directory names itself; its save directory is the one with `latest`
    tag = zero_files(save_dir(case.name) / "global_step2")
    assert (tag.tag, tag.save_dir, tag.latest) == (
        "global_step2",
        str(save_dir(case.name)),
        "global_step4",
    )


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (damaged("latest_missing"), "no 'latest' file"),
        (damaged("latest_dangling"), "names tag 'global_step9', which does not exist"),
        (DEEPSPEED_DIR / "stage2_fp32_1proc", "not a DeepSpeed checkpoint"),
    ],
)
def test_zero_files_errors_say_what_to_do(path: Path, message: str) -> None:
    with pytest.raises(InputError, match=message):
        zero_files(path)


@pytest.mark.parametrize("text", ["../elsewhere", "/etc", "", "a" * 5000, ".."])
def test_a_latest_that_leaves_the_directory_is_refused(tmp_path: Path, text: str) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(save_dir("stage1_fp32_1proc"), copy)
    (copy / "latest").write_text(text)
    with pytest.raises(InputError):
        zero_files(copy)
    result = run("show", str(copy))
    assert result.exit_code != 0 and "latest" in result.output


# --- consistency checks on trees that disagree ---------------------------------------------


def tree_and_details(case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    ckpt = open_checkpoint(save_dir(case))
    details = {
        k: v for k, v in ckpt.details.items() if k not in ("deepspeed", "missing", "complete")
    }
    details["missing"] = []
    return ckpt.root, details


def test_summarize_finds_a_partition_count_that_disagrees() -> None:
    root, details = tree_and_details("stage2_fp32_2proc")
    root["optimizer_states"]["rank1"]["optimizer_state_dict"]["partition_count"] = [4]
    _, problems = summarize(root, details)
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt: partition_count [4], but dp_world_size is 2" in p
               for p in problems), problems  # fmt: skip


def test_summarize_finds_a_shape_that_does_not_add_up() -> None:
    root, details = tree_and_details("stage3_fp32_2proc")
    shapes = root["model_states"]["rank0"]["param_shapes"][0]
    shapes["fc1.weight"] = (13, 8)  # 104 elements: ceil(104 / 2) = 52, the files hold 48
    _, problems = summarize(root, details)
    assert any(
        "group 0 holds 168 elements, its parameters' partitions need 172" in p for p in problems
    ), problems


def test_summarize_finds_a_zero2_group_that_does_not_add_up() -> None:
    root, details = tree_and_details("stage2_bf16_2proc")
    root["model_states"]["param_shapes"][0]["fc1.weight"] = (12, 9)  # 12 more elements
    _, problems = summarize(root, details)
    assert any(
        "the 2 partitions hold 335 elements, the group's parameters need 347" in p for p in problems
    )
    assert any(
        "module['fc1.weight'] has shape [12, 8], param_shapes says [12, 9]" in p for p in problems
    )


def test_summarize_finds_a_rank_beyond_the_world_size() -> None:
    root, details = tree_and_details("stage1_fp32_2proc")
    root["model_states"]["dp_world_size"] = 1
    _, problems = summarize(root, details)
    assert any(
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1, but dp_world_size is 1" in p
        for p in problems
    )


# --- DeepSpeed's pickled records, and DeepSpeed never imported ------------------------------


def test_deepspeed_records_are_safe_data() -> None:
    for module, name in [
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ]:
        assert classify_global(module, name) is Verdict.SAFE
    assert classify_global("deepspeed.runtime.engine", "DeepSpeedEngine") is Verdict.UNKNOWN
    assert record_value(OpaqueObject("deepspeed.runtime.zero.config.ZeroStageEnum", (2,))) == 2
    scaler = OpaqueObject("deepspeed.runtime.fp16.loss_scaler.LossScaler", (), {"cur_scale": 1.0})
    assert record_value({"s": [scaler]}) == {"s": [{"cur_scale": 1.0}]}
    other = OpaqueObject("mymodule.Config", (), {"a": 1})
    assert record_value(other) is other


def test_scan_calls_a_deepspeed_checkpoint_clean() -> None:
    result = run("scan", str(save_dir("stage2_bf16_2proc")))
    assert result.exit_code == 0, result.output
    assert "clean" in result.output


def test_reading_imports_nothing_from_deepspeed() -> None:
    code = (
        "import sys\n"
        "from ckpttool.commands.show import show\n"
        "from ckpttool.commands.verify import verify_file\n"
        f"show({str(save_dir('stage3_bf16_2proc'))!r})\n"
        f"assert verify_file({str(save_dir('stage2_fp32_2proc'))!r}).ok\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'torch')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
