"""Every ``--json`` output against its JSON Schema in docs/schemas/, and the schemas against the docs.

Real outputs: the CLI run with ``CliRunner`` on the committed fixtures (and on broken copies in
``tmp_path``), successes and the cases where a command reports a difference, a problem or a
file it could not scan. The schemas are closed where ckpttool chooses the keys, so a field
renamed or removed in the code, or added without the docs, fails here.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from ckpttool.cli import cli
from tests.support.helpers import FIXTURES, copy_fixture

DOCS = Path(__file__).resolve().parents[1] / "docs"
SCHEMAS = DOCS / "schemas"
COMMANDS = [
    "show", "diff", "convert", "rescale-step", "verify", "scan", "repair", "edit", "lora-merge",
    "lora-extract", "trend", "average", "merge",
]  # fmt: skip
#: The page that documents a command's --json, where it is not ``<command>.md``.
PAGE = {"lora-merge": "lora.md", "lora-extract": "lora.md"}
PAIRS = FIXTURES / "pairs"
DCP = FIXTURES / "dcp" / "checkpoint"
FRAMEWORKS = FIXTURES / "frameworks"
RESUME = FIXTURES / "minimind" / "pretrain_32_resume.pth"


@cache
def validator(command: str) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{command}.schema.json").read_text())
    return Draft202012Validator(schema)


def run_json(*args: Any, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(cli, [*(str(a) for a in args), "--json"])
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)  # stdout holds the JSON object and nothing else


def assert_valid(command: str, data: Any) -> None:
    errors = sorted(validator(command).iter_errors(data), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


# --- the schemas themselves -------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_schema_is_valid_draft_2020_12(command: str) -> None:
    schema = json.loads((SCHEMAS / f"{command}.schema.json").read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    # the top level is closed; show's is one of two closed objects (a checkpoint, a collection)
    tops = [schema["$defs"][ref["$ref"].rsplit("/", 1)[1]] for ref in schema.get("oneOf", [])]
    assert all(top["additionalProperties"] is False for top in tops or [schema])


def test_every_schema_file_belongs_to_a_command() -> None:
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(
        f"{c}.schema.json" for c in COMMANDS
    )


def property_names(schema: Any) -> set[str]:
    """Every key a schema names under ``properties``, at any depth (``$defs`` included)."""
    names: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "properties":
                names.update(value)
            names |= property_names(value)
    elif isinstance(schema, list):
        for item in schema:
            names |= property_names(item)
    return names


def code_words(markdown: str) -> set[str]:
    """Words that appear inside code (inline spans and fenced blocks) on a page."""
    spans = re.findall(r"```.*?```|`(?:[^`\n]|\n(?!\n))+`", markdown, flags=re.S)
    return {word for span in spans for word in re.findall(r"[\w-]+", span)}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_schema_field_is_documented_on_the_command_page(command: str) -> None:
    schema = json.loads((SCHEMAS / f"{command}.schema.json").read_text())
    page = (DOCS / PAGE.get(command, f"{command}.md")).read_text()
    assert f"schemas/{command}.schema.json" in page  # the page links its schema
    missing = property_names(schema) - code_words(page)
    assert not missing, (
        f"docs/{PAGE.get(command, command + '.md')} does not mention {sorted(missing)}"
    )


# --- show ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [RESUME],
        [RESUME, "--section", "optimizer"],
        [FIXTURES / "ckpttool/pretrain_32_resume.pth", "--stats"],
        [FIXTURES / "ckpttool/pretrain_32.pth", "--filter", "*layers.0.*"],
        [FIXTURES / "minimind/pretrain_32_moe_resume.pth"],
        [FIXTURES / "legacy/state_dict.pth"],
        [FIXTURES / "legacy/resume_bigkeys.pth"],
        [FIXTURES / "safetensors/model.safetensors"],
        [FIXTURES / "lightning/epoch=1-step=40.ckpt"],
        [FIXTURES / "special/namespace_config.pth"],
        [FIXTURES / "special/numpy_rng.pth"],
        [FIXTURES / "special/cuda_storages.pth"],
        [FIXTURES / "special/views.pth"],
        [FIXTURES / "wrapped/ddp_compiled.pth"],
        [PAIRS / "nan.pth", "--stats"],  # a warning for the NaN
        [DCP, "--stats"],  # chunks and stats
        [FRAMEWORKS / "hf_sharded"],  # framework directories: members, roles, counters
        [FRAMEWORKS / "trainer_2proc/output/checkpoint-8"],
        [FRAMEWORKS / "trainer_1proc/half_written/checkpoint-8"],  # missing, incomplete
        [FRAMEWORKS / "accelerate_2proc/state"],
        [FRAMEWORKS / "tutorial/whole_model.pt"],  # a pickled module
        [FRAMEWORKS / "trainer_1proc/output/checkpoint-4/optimizer.pt"],  # a bare optimizer
        [FRAMEWORKS / "fsdp2_2proc/model_world_size_2_rank_0.pt"],  # DTensor shards
        [FRAMEWORKS / "rank_sets/tp/model_world_size_2_rank_0.pt"],  # a named mesh
        [FRAMEWORKS / "rank_sets/tp"],  # a rank set: placements of the assembled tensors
        [FRAMEWORKS / "megatron/tp2"],  # Megatron torch_dist: stacked layers, parallel sizes
        [FRAMEWORKS / "megatron/legacy_pp2"],  # Megatron legacy: merged, renumbered
        [FRAMEWORKS / "peft/lora"],  # a PEFT adapter: patterns, modules_to_save
        [FRAMEWORKS / "peft/dora"],
        [FRAMEWORKS / "peft/trainer/checkpoint-2"],  # the adapter in a Trainer checkpoint
    ],
    ids=lambda args: "-".join(str(a).rsplit("/", 1)[-1] for a in args),
)
def test_show_json_matches_its_schema(args: list[Any]) -> None:
    incomplete = "half_written" in str(args[0])  # shown whole, exit 1 (issue 49)
    data = run_json("show", *args, exit_code=1 if incomplete else 0)
    assert_valid("show", data)
    assert data["num_tensors"] == len(data["tensors"])


def test_show_json_of_a_trainer_output_directory_lists_its_checkpoints() -> None:
    data = run_json("show", FRAMEWORKS / "trainer_1proc/half_written")
    assert_valid("show", data)
    assert [(c["name"], c["complete"], c["missing"]) for c in data["checkpoints"]] == [
        ("checkpoint-4", True, []), ("checkpoint-8", False, ["trainer_state.json"]),
    ]  # fmt: skip
    del data["checkpoints"]
    assert not validator("show").is_valid(data)


def test_show_json_optional_keys_appear_when_documented(tmp_path: Path) -> None:
    import torch

    torch.save({"t": torch.full((3,), float("nan"))}, tmp_path / "nan.pth")
    data = run_json("show", tmp_path / "nan.pth", "--stats")
    assert_valid("show", data)
    assert data["tensors"][0]["stats"] == {
        "min": "nan", "max": "nan", "mean": "nan", "std": "nan", "nan": 3, "inf": 0
    }  # fmt: skip
    assert "stats" not in run_json("show", RESUME)["tensors"][0]
    dcp = run_json("show", DCP)
    assert all("chunks" in t for t in dcp["tensors"])
    assert dcp["details"]["files"] == {"__0_0.distcp": 43905, "__1_0.distcp": 94808}


# --- diff ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "options", "exit_code"),
    [
        (PAIRS / "base.pth", PAIRS / "base_legacy.pth", [], 0),
        (PAIRS / "base.pth", PAIRS / "one_element.pth", [], 1),
        (PAIRS / "base.pth", PAIRS / "one_element.pth", ["--quick"], 0),
        (PAIRS / "base.pth", PAIRS / "structure.pth", ["--all"], 1),
        (PAIRS / "base.pth", PAIRS / "base_fp16.pth", ["--rtol", "1e-3"], 0),
        (PAIRS / "fine_fp32.pth", PAIRS / "fine_fp16.pth", [], 1),
        (PAIRS / "base.pth", PAIRS / "nan.pth", [], 1),
        (PAIRS / "base.pth", PAIRS / "one_element.pth", ["--by-module", "--top", "3"], 1),
        (PAIRS / "fine_fp32.pth", PAIRS / "fine_fp16.pth", ["--by-module"], 1),
        (PAIRS / "base.pth", PAIRS / "base_nometa.safetensors", [], 0),
        (PAIRS / "base.pth", PAIRS / "base_aliases.safetensors", [], 0),
        (PAIRS / "ddp.pth", PAIRS / "base.pth", ["--ignore-wrappers"], 0),
        (PAIRS / "resume_a.pth", PAIRS / "resume_b.pth", [], 1),
        (PAIRS / "lightning_a.ckpt", PAIRS / "lightning_b.ckpt", [], 1),
        (RESUME, FIXTURES / "safetensors/model.safetensors", [], 1),
        (DCP, FIXTURES / "dcp/model.safetensors", [], 0),
    ],
    ids=lambda v: v.name if isinstance(v, Path) else str(v),
)
def test_diff_json_matches_its_schema(a: Path, b: Path, options: list[str], exit_code: int) -> None:
    data = run_json("diff", a, b, *options, exit_code=exit_code)
    assert_valid("diff", data)
    assert data["equal"] is (exit_code == 0)
    assert sum(data["summary"].values()) == len(data["tensors"])


@pytest.mark.parametrize(
    "b", [FRAMEWORKS / "hf_sharded", FRAMEWORKS / "hf_model/model.safetensors"], ids=["dir", "file"]
)
def test_diff_json_weights_section_matches_the_schema(b: Path) -> None:
    """A framework directory's side names the section its weights files fill."""
    data = run_json("diff", FRAMEWORKS / "hf_model", b, exit_code=0)
    assert_valid("diff", data)
    assert data["a"]["weights_section"] == "model"
    assert ("weights_section" in data["b"]) is b.is_dir()


def test_diff_json_inf_values_match_the_schema(tmp_path: Path) -> None:
    import torch

    torch.save({"t": torch.tensor([1.0, float("inf")])}, tmp_path / "a.pth")
    torch.save({"t": torch.tensor([0.0, 1.0]), "u": torch.zeros(1)}, tmp_path / "b.pth")
    data = run_json("diff", tmp_path / "a.pth", tmp_path / "b.pth", exit_code=1)
    assert_valid("diff", data)
    assert data["tensors"][0]["values"]["max_abs_diff"] == "inf"


def documented_diff_example() -> dict[str, Any]:
    text = (DOCS / "diff.md").read_text()
    return json.loads(text.split("```json\n", 1)[1].split("\n```", 1)[0])


def shape_of(value: Any) -> Any:
    """The schema of a JSON value: key names and value types, lists by their first item."""
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape_of(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def test_diff_json_is_what_docs_diff_md_documents() -> None:
    """The excerpt in docs/diff.md is real output of the fixtures it names, and valid."""
    result = CliRunner().invoke(cli, ["diff", str(RESUME), str(FIXTURES / "safetensors/model.safetensors"), "--json"])  # fmt: skip
    assert result.exit_code == 1
    data = json.loads(result.stdout)  # stdout is JSON only; notes are on stderr
    assert result.stderr.startswith("note: ")
    aliased = [t for t in data["tensors"] if t["alias"]]
    assert len(aliased) == 1
    example = documented_diff_example()
    assert_valid("diff", example)
    field = {"key": "step", "status": "changed", "a": 1, "b": 2, "a_tensor": None, "b_tensor": None}  # fmt: skip
    actual = {**data, "tensors": aliased, "fields": [field]}
    assert shape_of(actual) == shape_of(example)
    assert aliased[0] == example["tensors"][0] | {"values": aliased[0]["values"]}
    assert aliased[0]["values"]["cast"] == {"a": "float16 -> float32"}
    assert data["summary"] == {"identical": 0, "within_tolerance": 0, "differ": 21, "only_a": 0, "only_b": 0, "equal_after_rounding": 0}  # fmt: skip
    table = (DOCS / "diff.md").read_text().split("| key | meaning |", 1)[1]
    for key in [*data, *data["a"], *data["tensors"][0], *aliased[0]["values"], *actual["fields"][0]]:  # fmt: skip
        assert f"`{key}`" in table or f"`{key}[]`" in table, key


# --- trend -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [FRAMEWORKS / "trainer_1proc/output", FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"],
    ids=["trainer", "deepspeed"],
)
def test_trend_json_matches_its_schema(path: Path) -> None:
    data = run_json("trend", path)
    assert_valid("trend", data)
    assert data["healthy"] is True and len(data["checkpoints"]) == 2


@pytest.mark.parametrize(
    "options", [[], ["--ema", "0.9", "--dtype", "bf16"], ["--last", "1", "--weights", "2"]],
    ids=["mean", "ema", "last"],
)  # fmt: skip
def test_average_json_matches_its_schema(tmp_path: Path, options: list[str]) -> None:
    run = FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"
    data = run_json("average", run, *options, "-o", tmp_path / "avg.safetensors")
    assert_valid("average", data)
    assert data["verified"] is True and (tmp_path / "avg.safetensors").is_file()
    assert sum(i["weight"] for i in data["inputs"]) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "options",
    [["--method", "linear", "--weights", "1,3"], ["--method", "task-arithmetic", "--lambda", "0.5"],
     ["--method", "ties", "--density", "0.5"], ["--method", "slerp", "--t", "0.3"]],
    ids=["linear", "task-arithmetic", "ties", "slerp"],
)  # fmt: skip
def test_merge_json_matches_its_schema(tmp_path: Path, options: list[str]) -> None:
    base, model = FRAMEWORKS / "peft/base", FRAMEWORKS / "peft/lora_merged"
    data = run_json("merge", base, model, *options, "-o", tmp_path / "m.safetensors")
    assert_valid("merge", data)
    assert data["verified"] is True and (tmp_path / "m.safetensors").is_file()
    assert data["method"] == options[1] and [i["role"] for i in data["inputs"]] == ["base", "model"]


def test_trend_json_with_a_nan_matches_its_schema(tmp_path: Path) -> None:
    import torch

    for step, value in enumerate([1.0, float("nan"), float("inf")]):
        torch.save(
            {"a.w": torch.tensor([value, 0.0]), "b.w": torch.zeros(2)}, tmp_path / f"s{step}.pt"
        )
    data = run_json("trend", tmp_path, exit_code=1)
    assert_valid("trend", data)
    assert data["first_nonfinite"] == {
        "checkpoint": 1,
        "step": None,
        "name": "s1.pt",
        "tensors": ["a.w"],
    }
    assert data["tensors"][0]["nan"] == [0, 1, 0] and data["tensors"][0]["inf"] == [0, 0, 1]


# --- verify ----------------------------------------------------------------------------------


def flipped(tmp_path: Path) -> Path:
    """A copy of a fixture with one byte of a tensor record changed (a CRC mismatch)."""
    target = copy_fixture("pairs/base.pth", tmp_path)
    data = bytearray(target.read_bytes())
    data[data.index(b"base/data/0") + 200] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def truncated(tmp_path: Path) -> Path:
    target = tmp_path / "truncated.pth"
    target.write_bytes((PAIRS / "base.pth").read_bytes()[:3000])
    return target


def with_leftover(tmp_path: Path) -> Path:
    target = copy_fixture("pairs/base.pth", tmp_path)
    (tmp_path / ".base.pth.abc123.ckpttool-tmp").write_bytes(b"partial")
    return target


def not_a_checkpoint(tmp_path: Path) -> Path:
    target = tmp_path / "config.json"
    target.write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return target


VERIFY_CASES: list[tuple[str, Callable[[Path], list[Path]], int]] = [
    (
        "fixtures",
        lambda _: [
            RESUME,
            FIXTURES / "legacy/state_dict.pth",
            FIXTURES / "safetensors/model.safetensors",
        ],
        0,
    ),
    ("dcp", lambda _: [DCP], 0),
    ("flipped-byte", lambda tmp: [flipped(tmp), RESUME], 1),
    ("truncated", lambda tmp: [truncated(tmp)], 1),
    ("leftover-temp-file", lambda tmp: [with_leftover(tmp)], 1),
    ("not-a-checkpoint", lambda tmp: [not_a_checkpoint(tmp), RESUME], 1),
    ("unreadable-paths", lambda tmp: [tmp / "missing.pth", RESUME], 2),
]


@pytest.mark.parametrize(("name", "paths", "exit_code"), VERIFY_CASES, ids=[c[0] for c in VERIFY_CASES])  # fmt: skip
def test_verify_json_matches_its_schema(
    tmp_path: Path, name: str, paths: Callable[[Path], list[Path]], exit_code: int
) -> None:
    inputs = paths(tmp_path)
    data = run_json("verify", *inputs, exit_code=exit_code)
    assert_valid("verify", data)
    assert data["ok"] is (exit_code == 0)
    assert [f["path"] for f in data["files"]] == [str(p) for p in inputs]
    unchecked = [f["path"] for f in data["files"] if f["error"] is not None]
    assert bool(unchecked) is (exit_code == 2)  # each path its own verdict, the run goes on


def test_verify_values_json_matches_its_schema() -> None:
    data = run_json("verify", PAIRS / "nan.pth", "--values", exit_code=1)
    assert_valid("verify", data)
    assert data["files"][0]["problems"]


# --- scan ------------------------------------------------------------------------------------


def mixed_directory(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "special", tmp_path / "special")
    (tmp_path / "special" / "README.md").write_text("not a checkpoint\n")
    return tmp_path / "special"


SCAN_CASES: list[tuple[str, Callable[[Path], list[Any]], int]] = [
    ("clean", lambda _: [RESUME, FIXTURES / "safetensors/model.safetensors", DCP], 0),
    ("unknown-and-torchscript", lambda tmp: [mixed_directory(tmp)], 1),
    (
        "allowed",
        lambda _: [
            FIXTURES / "special/namespace_config.pth",
            "--allow",
            "argparse.Namespace",
            "--allow",
            "tests.fixtures.generate.TrainConfig",
        ],
        0,
    ),
    ("unreadable", lambda tmp: [truncated(tmp)], 2),
    ("empty-directory", lambda tmp: [tmp], 2),  # scanning nothing is not clean
    ("missing-path", lambda tmp: [tmp / "missing.pth", RESUME], 2),
]


@pytest.mark.parametrize(("name", "args", "exit_code"), SCAN_CASES, ids=[c[0] for c in SCAN_CASES])
def test_scan_json_matches_its_schema(
    tmp_path: Path, name: str, args: Callable[[Path], list[Any]], exit_code: int
) -> None:
    data = run_json("scan", *args(tmp_path), exit_code=exit_code)
    assert_valid("scan", data)
    assert data["clean"] is (exit_code == 0)


def test_scan_json_reports_what_the_schema_documents(tmp_path: Path) -> None:
    data = run_json("scan", mixed_directory(tmp_path), exit_code=1)
    assert data["skipped"] == [str(tmp_path / "special" / "README.md")]
    verdicts = {g["verdict"] for f in data["files"] for g in f["globals"]}
    assert {"safe", "unknown"} <= verdicts
    assert any(f["format"] == "torchscript" and f["notes"] for f in data["files"])
    error = run_json("scan", truncated(tmp_path), exit_code=2)["files"][0]
    assert error["format"] is None and "truncated" in error["error"]


# --- convert ---------------------------------------------------------------------------------


def big_and_tiny(tmp_path: Path) -> Path:
    """Values that overflow and underflow float16."""
    import torch

    path = tmp_path / "extremes.pth"
    torch.save({"big": torch.tensor([1e6, 1.0]), "tiny": torch.tensor([1e-10, 1.0])}, path)
    return path


CONVERT_CASES: list[tuple[str, Callable[[Path], list[Any]]]] = [
    (
        "resume-fp16",
        lambda tmp: [
            FIXTURES / "ckpttool/pretrain_32_resume.pth",
            tmp / "m.safetensors",
            "--dtype",
            "fp16",
        ],
    ),
    ("minimind-default-dst", lambda tmp: [copy_fixture("minimind/pretrain_32_resume.pth", tmp)]),
    ("shards", lambda tmp: [PAIRS / "base.pth", tmp / "shards/", "--max-shard-size", "2KB"]),
    ("to-pth", lambda tmp: [FIXTURES / "safetensors/model.safetensors", tmp / "model.pth"]),
    (
        "lightning-filter",
        lambda tmp: [
            FIXTURES / "lightning/epoch=1-step=40.ckpt",
            tmp / "l.safetensors",
            "--filter",
            "*weight",
        ],
    ),
    (
        "wrapped-no-verify",
        lambda tmp: [
            FIXTURES / "wrapped/ddp.pth",
            tmp / "w.safetensors",
            "--ignore-wrappers",
            "--no-verify",
        ],
    ),
    (
        "overflow-underflow",
        lambda tmp: [
            big_and_tiny(tmp),
            tmp / "e.safetensors",
            "--dtype",
            "fp16",
            "--allow-overflow",
        ],
    ),
    ("dcp", lambda tmp: [DCP, tmp / "dcp.safetensors"]),
]


@pytest.mark.parametrize(("name", "args"), CONVERT_CASES, ids=[c[0] for c in CONVERT_CASES])
def test_convert_json_matches_its_schema(
    tmp_path: Path, name: str, args: Callable[[Path], list[Any]]
) -> None:
    data = run_json("convert", *args(tmp_path))
    assert_valid("convert", data)
    assert all(Path(p).is_file() for p in data["outputs"])
    if name == "overflow-underflow":
        assert data["overflow"] == {"big": 1} and data["underflow"] == {"tiny": 1}


# --- rescale-step ----------------------------------------------------------------------------


RESCALE_CASES: list[tuple[str, str, list[Any]]] = [
    ("in-place-backup", "minimind/pretrain_32_resume.pth", ["--world-size", "2", "--backup"]),
    (
        "inexact-dry-run",
        "minimind/pretrain_32_resume.pth",
        ["--world-size", "7", "--batch-size", "16", "--dry-run"],
    ),
    ("nothing-to-do", "minimind/pretrain_32_resume.pth", ["--world-size", "8"]),
    ("ckpttool-resume", "ckpttool/pretrain_32_resume.pth", ["--world-size", "4"]),
    (
        "legacy-from-world-size",
        "legacy/resume_bigkeys.pth",
        ["--world-size", "2", "--from-world-size", "4"],
    ),
    (
        "lightning-step-key",
        "lightning/epoch=1-step=40.ckpt",
        ["--world-size", "2", "--from-world-size", "4", "--step-key", "global_step"],
    ),
]


@pytest.mark.parametrize(("name", "fixture", "options"), RESCALE_CASES, ids=[c[0] for c in RESCALE_CASES])  # fmt: skip
def test_rescale_step_json_matches_its_schema(
    tmp_path: Path, name: str, fixture: str, options: list[Any]
) -> None:
    path = copy_fixture(fixture, tmp_path)
    data = run_json("rescale-step", path, *options)
    assert_valid("rescale-step", data)
    assert data["written"] is (data["changed"] and not data["dry_run"])


def test_rescale_step_json_to_another_output(tmp_path: Path) -> None:
    source = copy_fixture("minimind/pretrain_32_resume.pth", tmp_path)
    first = run_json("rescale-step", source, "--world-size", "4", "-o", tmp_path / "a.pth")
    second = run_json("rescale-step", tmp_path / "a.pth", "--world-size", "2", "--output", tmp_path / "b.pth")  # fmt: skip
    for data in (first, second):
        assert_valid("rescale-step", data)
    assert second["rescaled_from"] == [
        {"step": 1200, "world_size": 8},
        {"step": 2400, "world_size": 4},
    ]


# --- repair ----------------------------------------------------------------------------------


def _cut_resume(tmp_path: Path, fraction: float = 0.6) -> Path:
    """MiniMind's resume fixture cut short at ``fraction`` of its bytes."""
    data = RESUME.read_bytes()
    path = tmp_path / "cut_resume.pth"
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def test_repair_json_of_a_cut_file_matches_its_schema(tmp_path: Path) -> None:
    cut = _cut_resume(tmp_path)
    before = cut.read_bytes()
    planned = run_json("repair", cut, "--dry-run", exit_code=1)  # tensors lost
    assert_valid("repair", planned)
    assert planned["dry_run"] and not planned["written"] and planned["damaged"]
    assert not Path(planned["output"]).exists()
    done = run_json("repair", cut, "-o", tmp_path / "fixed.pth", exit_code=1)
    assert_valid("repair", done)
    assert done["written"] and done["output"] == str(tmp_path / "fixed.pth")
    assert done["lost"] and done["recovered"] == planned["recovered"] > 0
    assert (tmp_path / "fixed.pth").is_file() and cut.read_bytes() == before


def test_repair_json_of_a_file_that_lost_only_its_tail_exits_0(tmp_path: Path) -> None:
    data = RESUME.read_bytes()
    cut = tmp_path / "tail.pth"
    cut.write_bytes(data[:-100])  # the end records only: every tensor is there
    out = run_json("repair", cut, "-o", tmp_path / "fixed.pth")
    assert_valid("repair", out)
    assert out["damaged"] and out["written"] and out["lost"] == [] and out["dropped"] == []


def test_repair_json_of_a_model_directory_without_its_index(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(FRAMEWORKS / "hf_sharded", model)
    (model / "model.safetensors.index.json").unlink()
    planned = run_json("repair", model, "--dry-run", exit_code=1)
    assert_valid("repair", planned)
    assert planned["kind"] == "directory" and planned["format"] == "directory"
    assert [a["action"] for a in planned["actions"]] == ["rewrite index"]
    assert not (model / "model.safetensors.index.json").exists()
    done = run_json("repair", model)
    assert_valid("repair", done)
    assert done["written"] and (model / "model.safetensors.index.json").is_file()
    assert run_json("repair", model)["damaged"] is False


def test_repair_json_of_a_trainer_run_with_an_incomplete_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "output"
    shutil.copytree(FRAMEWORKS / "trainer_1proc" / "half_written", run)
    planned = run_json("repair", run, "--dry-run", "--quarantine", exit_code=1)
    assert_valid("repair", planned)
    assert [c["complete"] for c in planned["checkpoints"]] == [True, False]
    assert planned["newest_complete"] == str(run / "checkpoint-4")
    done = run_json("repair", run, "--quarantine")
    assert_valid("repair", done)
    assert [a["action"] for a in done["actions"]] == ["quarantine"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "incomplete-checkpoint-8"]


# --- edit ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [["--for-inference"], ["--drop", "optimizer.*", "--keep", "model.*"], ["--rename", "layers=blocks"],
     ["--compact"]],  # nothing to compact: nothing to change
    ids=["for-inference", "drop-keep", "rename", "nothing"],
)  # fmt: skip
def test_edit_json_matches_its_schema(tmp_path: Path, options: list[str]) -> None:
    data = run_json("edit", RESUME, *options, "-o", tmp_path / "out.pth")
    assert_valid("edit", data)
    assert data["written"] is data["changed"] is (tmp_path / "out.pth").exists()


@pytest.mark.parametrize(
    ("source", "options"),
    [("dcp/checkpoint", ["--for-inference", "--dtype", "bf16"]),
     ("frameworks/trainer_1proc/output/checkpoint-8", ["--for-inference"]),
     ("frameworks/accelerate_1proc/state", ["--for-inference", "--dry-run"])],
    ids=["dcp", "trainer", "accelerate"],
)  # fmt: skip
def test_edit_json_of_a_directory_matches_its_schema(
    tmp_path: Path, source: str, options: list[str]
) -> None:
    data = run_json("edit", FIXTURES / source, *options, "-o", tmp_path / "out")
    assert_valid("edit", data)
    assert data["changed"] and data["written"] is (tmp_path / "out").exists()
    assert data["files_dropped"] or data["dropped"]


# --- the schemas are strict enough to catch a renamed field -----------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_a_renamed_or_missing_field_fails_validation(tmp_path: Path, command: str) -> None:
    outputs = {
        "show": lambda: run_json("show", RESUME),
        "diff": lambda: run_json(
            "diff", PAIRS / "base.pth", PAIRS / "one_element.pth", exit_code=1
        ),
        "convert": lambda: run_json("convert", PAIRS / "base.pth", tmp_path / "o.safetensors"),
        "rescale-step": lambda: run_json(
            "rescale-step",
            copy_fixture("minimind/pretrain_32_resume.pth", tmp_path),
            "--world-size",
            "2",
            "--dry-run",
        ),
        "verify": lambda: run_json("verify", RESUME),
        "scan": lambda: run_json("scan", RESUME),
        "repair": lambda: run_json("repair", _cut_resume(tmp_path), "--dry-run", exit_code=1),
        "edit": lambda: run_json(
            "edit", RESUME, "--for-inference", "--rename", "^model\\.=model.m.", "--dry-run"
        ),
        "lora-merge": lambda: run_json(
            "lora",
            "merge",
            FRAMEWORKS / "peft/base",
            FRAMEWORKS / "peft/lora",
            "-o",
            tmp_path / "m",
        ),
        "lora-extract": lambda: run_json(
            "lora",
            "extract",
            FRAMEWORKS / "peft/base",
            FRAMEWORKS / "peft/lora_merged",
            "--rank",
            "2",
            "-o",
            tmp_path / "x",
        ),
        "trend": lambda: run_json("trend", FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"),
        "average": lambda: run_json(
            "average",
            FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints",
            "-o",
            tmp_path / "a.pth",
        ),
        "merge": lambda: run_json(
            "merge",
            FRAMEWORKS / "peft/base",
            FRAMEWORKS / "peft/lora_merged",
            "-o",
            tmp_path / "m.safetensors",
            "--method",
            "ties",
            "--density",
            "0.5",
        ),
    }
    data = outputs[command]()
    assert_valid(command, data)
    first = next(iter(data))
    renamed = {("renamed_" + k if k == first else k): v for k, v in data.items()}
    with pytest.raises(ValidationError):
        validator(command).validate(renamed)
    inner = {  # a closed object inside the output, reached from the top
        "show": lambda d: d["tensors"][0],
        "diff": lambda d: d["tensors"][0]["values"],
        "convert": None,  # below its top level only maps, whose keys come from the file
        "rescale-step": lambda d: d["from"],
        "verify": lambda d: d["files"][0],
        "scan": lambda d: d["files"][0]["globals"][0],
        "repair": lambda d: d["lost"][0],
        "edit": lambda d: d["renamed"][0],
        "lora-merge": lambda d: d["merged"][0],
        "lora-extract": lambda d: d["extracted"][0],
        "trend": lambda d: d["groups"][0],
        "average": lambda d: d["inputs"][0],
        "merge": lambda d: d["inputs"][0],
    }[command]
    if inner is not None:
        nested = json.loads(json.dumps(data))
        target = inner(nested)
        target.pop(next(iter(target)))
        with pytest.raises(ValidationError):
            validator(command).validate(nested)
