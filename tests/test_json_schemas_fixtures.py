"""Every command's ``--json`` on EVERY committed fixture, against its schema in docs/schemas/.

tests/test_json_schemas.py holds the chosen cases (differences, problems, options); this holds
the breadth: each checkpoint file and checkpoint directory under tests/fixtures/ through
``show``, ``diff`` with itself, ``verify``, ``scan``, ``convert`` into a temporary directory and
``rescale-step --dry-run``. Each run is in-process (click's ``CliRunner``), so the whole sweep
takes seconds. A command that refuses a fixture (exit 2) prints nothing on stdout (``verify``
and ``scan`` print their entry with its ``error``) and one ``Error:`` line on stderr; which
fixtures ``show``, ``diff``, ``verify`` and ``scan`` may refuse is listed here.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from ckpttool.cli import cli
from ckpttool.model.vocabulary import FORMATS, LAYOUTS
from tests.support.helpers import FIXTURES
from tools import schema_enums

SCHEMAS = Path(__file__).resolve().parents[1] / "docs" / "schemas"
#: Files in tests/fixtures that are not checkpoints: generators, docs, a framework's own JSON
#: (config, trainer state, DeepSpeed's losses), DeepSpeed's ``latest`` pointers.
NOT_FILES = (".py", ".pyc", ".md", ".txt")
#: Fixtures a reading command may refuse (exit 2), with why: everything under them.
REFUSED = {
    "special/torchscript.pt": "a TorchScript archive holds code, not a checkpoint",
    # tests/fixtures/deepspeed/README.md: a rank file empty, truncated or missing, a dangling
    # or missing `latest`
    "deepspeed/damaged": "DeepSpeed's damaged saves",
    "frameworks/rank_sets/partial": "a Partial DTensor: addends of a reduction never done",
}
#: Trainer output directories of several checkpoints: show lists them; diff and verify ask
#: which one is meant.
COLLECTIONS = ("frameworks/trainer_1proc/half_written", "frameworks/trainer_1proc/output",
               "frameworks/trainer_2proc/output", "frameworks/peft/trainer",
               "frameworks/torchtitan/checkpoint", "frameworks/torchtune/output")  # fmt: skip


#: Folders refused themselves, not their files: a folder of checkpoint files is one checkpoint of
#: parts (docs/formats.md, "Containers"), and this one holds the TorchScript archive above,
#: refused in one line naming it.
REFUSED_FOLDERS = {"special": "a folder of parts one of which is a TorchScript archive"}


def refused(path: Path) -> bool:
    return name(path) in REFUSED_FOLDERS or any(
        name(path) == where or name(path).startswith(where + "/") for where in REFUSED
    )


def refused_or_collection(path: Path) -> bool:
    return refused(path) or name(path) in COLLECTIONS


def checkpoint_directories() -> list[Path]:
    """Every directory some command reads as one checkpoint: DCP, framework layouts, the
    folders holding DeepSpeed's ``latest``."""
    from ckpttool.frameworks.registry import detect_directory

    found = []
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_dir()):
        if "__pycache__" in path.parts:
            continue
        if (path / ".metadata").is_file() or (path / "latest").is_file():
            found.append(path)
            continue
        try:
            layout = detect_directory(str(path))
        except Exception:  # a damaged layout: verify and scan still take it
            layout = None
        if layout is not None:
            found.append(path)
    return found


def checkpoint_files() -> list[Path]:
    """Every file a command reads as a checkpoint (an index.json included)."""
    return sorted(
        p for p in FIXTURES.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in NOT_FILES
        and (p.suffix != ".json" or p.name.endswith(".index.json"))
        and p.name != "latest" and p.suffix not in (".distcp", ".metadata")
    )  # fmt: skip


@cache
def inputs() -> list[Path]:
    return checkpoint_files() + checkpoint_directories()


@cache
def validator(command: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads((SCHEMAS / f"{command}.schema.json").read_text()))


def name(path: Path) -> str:
    return str(path.relative_to(FIXTURES))


def check(command: str, args: list[Any], refusable: bool) -> str | None:
    """Run ``command`` with ``--json``; a description of what is wrong, or None."""
    result = CliRunner().invoke(cli, [command, *(str(a) for a in args), "--json"])
    where = f"{command} {' '.join(str(a) for a in args)}"
    if "Traceback" in result.stderr or (result.exception and result.exit_code not in (0, 1, 2)):
        return f"{where}: crashed: {result.stderr[-300:] or result.exception!r}"
    if result.exit_code == 2 and command not in ("verify", "scan"):
        if not refusable:
            return f"{where}: exit 2: {result.stderr.strip()[:300]}"
        if result.stdout or not result.stderr.startswith("Error: "):
            return f"{where}: a refusal must print one Error: line and nothing on stdout"
        return None
    try:
        data = json.loads(result.stdout)
    except ValueError:
        return f"{where}: exit {result.exit_code}, stdout is not JSON: {result.stdout[:200]!r}"
    if result.exit_code == 2 and not refusable:
        return f"{where}: exit 2: {json.dumps(data)[:300]}"
    errors = list(validator(command).iter_errors(data))
    if errors:
        first = errors[0]
        return f"{where}: {list(first.absolute_path)}: {first.message[:200]}"
    return None


def sweep(command: str, arguments: Any, refusable: Any) -> None:
    problems = [
        problem
        for path in inputs()
        if (problem := check(command, arguments(path), refusable(path))) is not None
    ]
    assert not problems, f"{len(problems)} of {len(inputs())}:\n" + "\n".join(problems[:20])


def test_the_sweep_covers_every_kind_of_fixture() -> None:
    names = {name(p) for p in inputs()}
    for expected in (
        "minimind/pretrain_32_resume.pth", "legacy/state_dict.pth", "dcp/checkpoint",
        "frameworks/hf_model", "frameworks/hf_sharded/model.safetensors.index.json",
        "frameworks/trainer_1proc/output/checkpoint-8", "frameworks/accelerate_2proc/state",
        "frameworks/tutorial/whole_model.pt", "frameworks/lightning/checkpoints/epoch=1-step=6.ckpt",
        "deepspeed/stage3_bf16_2proc/checkpoints",
        "deepspeed/stage3_bf16_2proc/checkpoints/global_step4",
        "deepspeed/stage1_fp32_1proc/checkpoints/global_step4/mp_rank_00_model_states.pt",
        "gguf/llama_f32.gguf", "gguf/q8_0.gguf",
    ):  # fmt: skip
        assert expected in names
    assert all(any(n.startswith(where) for n in names) for where in REFUSED)
    assert set(COLLECTIONS) <= names
    assert len(names) > 250


@pytest.mark.parametrize("command", ["show", "verify", "scan"])
def test_every_fixture_through_a_reading_command(command: str) -> None:
    sweep(command, lambda path: [path], refused if command != "verify" else refused_or_collection)


def test_every_fixture_diffed_with_itself() -> None:
    """A ZeRO-3 rank's model states (0-element placeholders, whose values its folder holds)
    is refused: "identical" would be no answer (tests/test_deepspeed_placeholders.py)."""
    sweep("diff", lambda path: [path, path], lambda path: refused_or_collection(path) or (
        path.name.startswith("zero_pp_rank_") and path.name.endswith("_model_states.pt")
    ))  # fmt: skip


def test_every_fixture_converted(tmp_path: Path) -> None:
    """Many fixtures hold nothing convert can write (an optimizer, a scheduler): a refusal is
    an answer; what it writes is in its schema."""
    counter = iter(range(1_000_000))
    sweep(
        "convert",
        lambda path: [path, tmp_path / f"out{next(counter)}.safetensors"],
        lambda path: True,
    )


def test_every_fixture_rescaled_dry_run() -> None:
    """``--dry-run`` writes nothing, so the committed fixtures are used as they are."""
    sweep(
        "rescale-step",
        lambda path: [path, "--world-size", "2", "--from-world-size", "1", "--dry-run"],
        lambda path: True,
    )


#: Fixtures that are damaged on purpose (repair reports them), besides REFUSED's DeepSpeed saves.
DAMAGED = ("frameworks/trainer_1proc/half_written",)


def test_every_fixture_repaired_dry_run() -> None:
    """Every fixture that is not damaged on purpose is intact to ``repair``: its recovery walk
    finds every tensor of a sound file (NumPy arrays in the pickle, zip64, legacy, views...).
    A refusal (a TorchScript archive, an index file, a layout repair does not take) is an
    answer; what it prints is in its schema."""
    sweep("repair", lambda path: [path, "--dry-run"], lambda path: True)
    damaged = []
    for path in inputs():
        if refused(path) or any(name(path).startswith(where) for where in DAMAGED):
            continue
        result = CliRunner().invoke(cli, ["repair", str(path), "--dry-run", "--json"])
        if result.exit_code != 2 and json.loads(result.stdout)["damaged"]:
            damaged.append(f"{name(path)}: {result.stdout[:300]}")
    assert not damaged, "\n".join(damaged[:10])


# --- one vocabulary ------------------------------------------------------------------------


@pytest.mark.parametrize("command", schema_enums.NAMED)
def test_the_schemas_name_formats_and_layouts_from_the_one_table(command: str) -> None:
    text = (SCHEMAS / f"{command}.schema.json").read_text()
    assert text == schema_enums.render(command), (
        f"docs/schemas/{command}.schema.json is out of date: run `{schema_enums.REGENERATE}`"
    )
    defs = json.loads(text)["$defs"]
    assert defs.get("format", {"enum": list(FORMATS)})["enum"] == list(FORMATS)
    assert defs.get("layout", {"enum": list(LAYOUTS)})["enum"] == list(LAYOUTS)
    assert "format" in defs or "layout" in defs  # convert names the source's layout only


def test_show_and_diff_name_a_deepspeed_directory_alike() -> None:
    path = FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"
    shown = json.loads(CliRunner().invoke(cli, ["show", str(path), "--json"]).stdout)
    diffed = json.loads(CliRunner().invoke(cli, ["diff", str(path), str(path), "--json"]).stdout)
    assert (shown["format"], shown["layout"]) == ("directory", "deepspeed")
    assert (diffed["a"]["format"], diffed["a"]["layout"]) == ("directory", "deepspeed")
