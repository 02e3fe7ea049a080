"""Nothing lost and no quiet wrong answer (issue 49): every registered layout's fixture ×
every command that takes it, intact and damaged, against the invariants of
docs/development.md ("Invariants").

The layouts and their fixtures are :data:`tests.support.matrix.TABLE`; a layout a registry
adds joins every test here by being registered (``test_every_registered_layout_has_a_fixture``
fails until the table names a fixture of it). Commands run in-process through click's
``CliRunner`` (what a user runs, exit code and all) on copies in ``tmp_path``.

:data:`KNOWN` lists the cases that fail today for a defect another item of issue 49 fixes:
strict xfails, so that the fix's merge fails here until its entry is deleted.
"""

from __future__ import annotations

import json
import re
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.support import matrix
from tests.support.matrix import TABLE, Fixture

#: (layout, check) -> the item of issue 49 whose fix makes it pass. Delete an entry when its
#: fix lands (a strict xfail that passes fails). A check is a test's name for it ("convert",
#: "verify:deleted"...: see each test's ``cases``/``damaged_cases`` call).
KNOWN: dict[tuple[str, str], str] = {}  # (empty: every case of issue 49 holds)

#: Layouts a command refuses as documented (exit 2, this message): not a loss, a refusal.
REFUSED: dict[tuple[str, str], str] = {
    **{
        ("edit", layout): "edit does not rewrite"
        for layout in (
            "torchtune", "peft_adapter", "sentence_transformers", "diffusers_model",
            "diffusers_ema", "diffusers_pipeline", "deepspeed", "megatron_legacy", "rank_set",
            # a framework's DCP directory: refused by the framework, no longer edited as bare
            # DCP (nothing cast, exit 0, or "not a tensor of this checkpoint")
            "lightning_sharded", "torchtitan", "megatron_torch_dist",
        )
    },
    ("edit", "checkpoint_parts"): "edit does not rewrite a folder of checkpoint files",
    ("edit", "gguf"): "edit rewrites torch.save files",
    ("repair", "gguf"): "not a file ckpttool can recover",
}  # fmt: skip

WITH_TENSORS = [f for f in TABLE if f.tensors and not f.collection]
DAMAGES = ("truncated", "deleted")


def cases(fixtures: list[Fixture], check: str) -> list[Any]:
    """One pytest param per fixture, marked xfail where :data:`KNOWN` says so."""
    params = []
    for fixture in fixtures:
        reason = KNOWN.get((fixture.layout, check))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(fixture, id=fixture.id, marks=marks))
    return params


def damaged_cases(fixtures: list[Fixture], check: str) -> list[Any]:
    """One param per fixture and way to damage it (a deleted file only where it has several)."""
    params = []
    for fixture in fixtures:
        for damage in DAMAGES:
            if damage == "deleted" and not _several_files(fixture):
                continue
            reason = KNOWN.get((fixture.layout, f"{check}:{damage}"))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(fixture, damage, id=f"{fixture.id}-{damage}", marks=marks))
    return params


def _several_files(fixture: Fixture) -> bool:
    if fixture.build is not None or not fixture.records_files:
        return False
    return len(matrix.data_files(matrix.FIXTURES / fixture.path)) > 1


def run(*args: Any, inputs: tuple[Path, ...] = ()) -> Result:
    """The CLI on ``args``: no traceback, a documented exit code, an ``Error:`` line with
    exit 2, and every path of ``inputs`` byte for byte as it was."""
    before = {path: matrix.tree_hash(path) for path in inputs}
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{args}: raised {result.exception!r}\n{result.output}"
    )
    assert "Traceback" not in result.output, result.output
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    if result.exit_code == 2:
        assert re.search(r"^Error: ", result.output, re.M), result.output
    for path, hashes in before.items():
        assert matrix.tree_hash(path) == hashes, f"{args}: changed {path}"
    return result


def refused(result: Result, command: str, fixture: Fixture) -> bool:
    """Whether ``command`` refuses ``fixture``'s layout as :data:`REFUSED` says it does (then it
    must have, with exit 2 and that message)."""
    message = REFUSED.get((command, fixture.layout))
    if message is None:
        return False
    assert result.exit_code == 2 and message in result.output, result.output
    return True


def names(output: str, victim: Path) -> bool:
    """Whether ``output`` names the file ``victim``: by its name, or by a glob that matches it
    (DeepSpeed's ``*_model_states.pt``)."""
    globs = re.findall(r"[^\s:()]*\*[^\s:()]*", output)
    return victim.name in output or any(fnmatch(victim.name, g.rsplit("/", 1)[-1]) for g in globs)


def damage(path: Path, how: str) -> Path:
    """Damage the copy at ``path``; the file truncated or deleted."""
    victim = matrix.truncate_one(path) if how == "truncated" else matrix.delete_one(path)
    assert victim is not None
    return victim


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights in the default view, as ckpttool's library loads them."""
    import ckpttool

    return dict(ckpttool.load_state_dict(str(path)))


# --- the table against the registries ---------------------------------------------------------


def test_every_registered_layout_has_a_fixture() -> None:
    missing = matrix.registered_layouts() - {f.layout for f in TABLE}
    assert not missing, (
        f"registered layouts without a fixture in tests/support/matrix.py: {missing}"
    )


def test_the_table_names_registered_layouts_only() -> None:
    assert {f.layout for f in TABLE} <= matrix.registered_layouts()


@pytest.mark.parametrize("fixture", cases(list(TABLE), "detected"))
def test_each_fixture_is_detected_as_its_layout(fixture: Fixture, tmp_path: Path) -> None:
    path = fixture.copy_to(tmp_path)
    result = run("show", "--json", path, inputs=(path,))
    if fixture.refused is not None:  # refused by name: the format ckpttool reads no values of
        assert result.exit_code == 2 and fixture.refused in result.output, result.output
        return
    shown = json.loads(result.stdout)
    assert fixture.layout in (shown["format"], shown["layout"]), shown


# --- show and verify ------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", cases(list(TABLE), "intact"))
def test_show_and_verify_of_an_intact_fixture_exit_0(fixture: Fixture, tmp_path: Path) -> None:
    path = fixture.copy_to(tmp_path)
    shown = run("show", path, inputs=(path,))
    verified = run("verify", path, inputs=(path,))
    if fixture.refused is not None:  # show refuses it, verify reports it unreadable
        assert shown.exit_code == 2 and fixture.refused in shown.output, shown.output
        assert verified.exit_code == 1 and fixture.refused in verified.output, verified.output
    elif fixture.collection:  # a run directory: show lists its checkpoints, verify checks each
        assert shown.exit_code == 0, shown.output
        assert verified.exit_code == 0, verified.output
        assert ": OK (" in verified.output, verified.output  # each of its checkpoints checked
    else:
        assert shown.exit_code == 0, shown.output
        assert verified.exit_code == 0, verified.output


def verify_and_show_cases() -> list[Any]:
    """verify of every layout's damaged copies, show of every layout's but a run directory's
    (its show lists its checkpoints by the files present: one being written is incomplete as
    a matter of course; its checkpoints are layouts of the table)."""
    return [
        pytest.param(command, *param.values, id=f"{command}-{param.id}", marks=param.marks)
        for command, fixtures in (
            ("verify", list(TABLE)),
            ("show", [f for f in TABLE if not f.collection]),
        )
        for param in damaged_cases(fixtures, command)
    ]


@pytest.mark.parametrize(("command", "fixture", "how"), verify_and_show_cases())
def test_verify_and_show_of_a_damaged_copy_fail_naming_the_file(
    command: str, fixture: Fixture, how: str, tmp_path: Path
) -> None:
    path = fixture.copy_to(tmp_path)
    victim = damage(path, how)
    result = run(command, path, inputs=(path,))
    if fixture.collection and result.exit_code == 2 and "name one of them" in result.output:
        return  # verify refuses a run directory whole: nothing read, nothing called clean
    # verify: 1, a problem found; show: 1 for a directory missing a file, 2 for a torn file
    assert result.exit_code == 1 if command == "verify" else result.exit_code != 0, result.output
    assert names(result.output, victim), result.output


# --- diff -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", cases(WITH_TENSORS, "diff-same"))
def test_diff_with_an_identical_copy_exits_0(fixture: Fixture, tmp_path: Path) -> None:
    a = fixture.copy_to(tmp_path / "a")
    b = fixture.copy_to(tmp_path / "b")
    result = run("diff", a, b, "--rtol", 0, "--atol", 0, inputs=(a, b))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("fixture", cases(WITH_TENSORS, "diff-changed"))
def test_diff_with_a_changed_copy_exits_1_and_names_both(fixture: Fixture, tmp_path: Path) -> None:
    a = fixture.copy_to(tmp_path / "a")
    b = fixture.copy_to(tmp_path / "b")
    tensor, field = matrix.change_tensor_and_field(b)
    assert tensor, "the matrix found no tensor to change"
    result = run("diff", a, b, "--rtol", 0, "--atol", 0, "--json", inputs=(a, b))
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert any(t["status"] == "differ" for t in report["tensors"]), report["summary"]
    if field is not None:
        changed = [f["key"] for f in report["fields"] if f["status"] != "same"]
        assert any(key == field or key.endswith("." + field) for key in changed), changed


#: The layouts whose fixture keeps a non-tensor field in a pickled file (the matrix's
#: :func:`~tests.support.matrix.remove_field` deletes one; DCP's are not rewritten here).
PICKLED_FIELDS = (
    "lightning_sharded", "accelerate", "hf_trainer", "deepspeed", "megatron_torch_dist",
    "megatron_legacy", "torch-zip",
)  # fmt: skip


@pytest.mark.parametrize(
    "fixture", cases([f for f in WITH_TENSORS if f.layout in PICKLED_FIELDS], "diff-field-gone")
)
def test_diff_with_a_copy_missing_a_field_exits_1_and_names_it(
    fixture: Fixture, tmp_path: Path
) -> None:
    """Two checkpoints of one kind: a field only one holds is a difference, not a note."""
    a = fixture.copy_to(tmp_path / "a")
    b = fixture.copy_to(tmp_path / "b")
    field = matrix.remove_field(b)
    assert field is not None, "the fixture keeps no pickled field: drop it from PICKLED_FIELDS"
    result = run("diff", a, b, "--json", inputs=(a, b))
    assert result.exit_code == 1, result.output
    changed = [f["key"] for f in json.loads(result.stdout)["fields"] if f["status"] != "same"]
    assert any(key == field or key.endswith("." + field) for key in changed), changed


@pytest.mark.parametrize("fixture", cases(WITH_TENSORS, "diff-weights-file"))
def test_diff_against_its_weights_file_exits_0_naming_what_was_not_compared(
    fixture: Fixture, tmp_path: Path
) -> None:
    """README's "Check a weights file against its resume file": what only the checkpoint's
    kind holds (an optimizer, counters, a config) is named in a note, not compared; what both
    hold (the weights) compared equal: exit 0."""
    src = fixture.copy_to(tmp_path / "in")
    out = tmp_path / "weights.safetensors"
    assert run("convert", src, out, inputs=(src,)).exit_code == 0
    result = run("diff", src, out, "--rtol", 0, "--atol", 0, inputs=(src, out))
    assert result.exit_code == 0, result.output
    if len(shown_tensors(src)) > len(weights(out)):  # it holds more than its weights
        assert re.search(r"^note: not compared: A's ", result.stderr, re.M), result.stderr


# --- convert, edit, repair, average, merge --------------------------------------------------


def shown_tensors(path: Path) -> dict[str, str]:
    """Every tensor ``show`` lists, by key: its dtype."""
    shown = json.loads(run("show", "--json", path).stdout)
    return {t["key"]: t["dtype"] for t in shown["tensors"]}


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("fixture", cases(WITH_TENSORS, "convert"))
def test_convert_writes_every_weight_and_it_loads(fixture: Fixture, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = fixture.copy_to(tmp_path / "in")
    out = tmp_path / "out.safetensors"
    result = run("convert", src, out, inputs=(src,))
    assert result.exit_code == 0, result.output
    loaded = load_file(str(out))  # safetensors' own loader reads it
    assert loaded
    assert_same_weights(weights(out), weights(src))


@pytest.mark.parametrize("fixture", cases(WITH_TENSORS, "edit-dtype"))
def test_edit_dtype_leaves_integers_and_optimizer_state_alone(
    fixture: Fixture, tmp_path: Path
) -> None:
    src = fixture.copy_to(tmp_path / "in")
    out = tmp_path / ("out" + (src.suffix if src.is_file() else ""))
    result = run("edit", src, "--dtype", "bf16", "-o", out, inputs=(src,))
    if refused(result, "edit", fixture):
        return
    assert result.exit_code == 0, result.output
    before, after = shown_tensors(src), shown_tensors(out)
    assert sorted(after) == sorted(before)
    floating = {"float64", "float32", "float16", "bfloat16"}
    for key, dtype in before.items():
        if dtype not in floating or any("optim" in part for part in key.split(".")):
            assert after[key] == dtype, (key, dtype, after[key])


@pytest.mark.parametrize(("fixture", "how"), damaged_cases(WITH_TENSORS, "repair"))
def test_repair_of_a_damaged_copy_exits_1_and_verify_still_fails(
    fixture: Fixture, how: str, tmp_path: Path
) -> None:
    src = fixture.copy_to(tmp_path / "in")
    damage(src, how)
    out = ("-o", tmp_path / ("out" + src.suffix)) if src.is_file() else ()
    result = run("repair", src, *out, inputs=(src,) if src.is_file() else ())
    if refused(result, "repair", fixture):
        return
    assert result.exit_code == 1, result.output
    verified = run("verify", src)
    assert verified.exit_code == 1, verified.output


#: The commands that combine checkpoints, with the options that make them a plain mean.
COMBINES = {"average": (), "merge": ("--method", "linear")}


@pytest.mark.parametrize(
    ("command", "fixture"),
    [
        pytest.param(command, *param.values, id=f"{command}-{param.id}", marks=param.marks)
        for command in COMBINES
        for param in cases(WITH_TENSORS, command)
    ],
)
def test_average_and_merge_of_a_checkpoint_with_itself_give_its_weights(
    command: str, fixture: Fixture, tmp_path: Path
) -> None:
    src = fixture.copy_to(tmp_path / "in")
    adapter = (src / "adapter_config.json").is_file() and fixture.layout == "peft_adapter"
    out = tmp_path / ("out" if adapter else "out.safetensors")  # adapters combine into a folder
    result = run(command, src, src, *COMBINES[command], "-o", out, inputs=(src,))
    assert result.exit_code == 0, result.output
    if adapter:  # one adapter of summed rank: its factors differ, its deltas must not
        got, expected = lora_deltas(out), lora_deltas(src)
        assert sorted(got) == sorted(expected)
        for module, delta in expected.items():
            torch.testing.assert_close(got[module], delta, rtol=1e-5, atol=1e-6)
    else:
        assert_same_weights(weights(out), weights(src))


def lora_deltas(adapter: Path) -> dict[str, torch.Tensor]:
    """Each LoRA module's delta ``scale * B @ A`` in float64, by module name, with the scale
    PEFT gives it (``lora_alpha / r``, or the module's entry of ``alpha_pattern`` and
    ``rank_pattern``, matched as PEFT matches them: the name or its dotted suffix)."""
    import json
    import re

    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = weights(adapter)

    def pattern(name: str, key: str, default: float) -> float:
        found = [v for p, v in config.get(key, {}).items() if re.fullmatch(rf"(.*\.)?{p}", name)]
        return float(found[0]) if found else float(default)

    deltas = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = pattern(module, "rank_pattern", config["r"])
        alpha = pattern(module, "alpha_pattern", config["lora_alpha"])
        scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        deltas[module] = scale * (b.double() @ a.double())
    return deltas


#: The layouts ``convert`` writes as a model directory (DST a directory): their consumer is
#: transformers' ``from_pretrained``.
MODEL_DIRECTORIES = [f for f in WITH_TENSORS if f.layout in ("hf_model", "hf_trainer")]


@pytest.mark.parametrize("fixture", cases(MODEL_DIRECTORIES, "from-pretrained"))
def test_a_converted_model_directory_loads_in_from_pretrained_in_its_dtype(
    fixture: Fixture, tmp_path: Path
) -> None:
    import transformers

    src = fixture.copy_to(tmp_path / "in")
    out = tmp_path / "out"
    result = run("convert", src, f"{out}/", "--dtype", "bf16", inputs=(src,))
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype="auto"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.bfloat16  # config.json says the dtype the weights are in
    expected = weights(src)
    loaded = model.state_dict()
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor.to(torch.bfloat16)), key


# --- the damaged-input column: diff, convert, average, merge --------------------------------


def damaged_column_cases() -> list[Any]:
    """Every command that reads a checkpoint's tensors into a verdict or an output, of every
    layout's damaged copies."""
    return [
        pytest.param(command, *param.values, id=f"{command}-{param.id}", marks=param.marks)
        for command in ("diff", "convert", *COMBINES)
        for param in damaged_cases(WITH_TENSORS, command)
    ]


@pytest.mark.parametrize(("command", "fixture", "how"), damaged_column_cases())
def test_a_damaged_copy_fails_naming_it_and_nothing_is_written(
    command: str, fixture: Fixture, how: str, tmp_path: Path
) -> None:
    """Of a damaged copy (a data file cut to half, or deleted), ``diff`` against the intact
    fixture, ``convert``, ``average`` and ``merge`` exit non-zero (1: a difference found, 2:
    an error) naming the damaged file, or for a ``diff`` the tensors it lost; no output is
    written and the inputs are untouched."""
    src = fixture.copy_to(tmp_path / "in")
    intact = fixture.copy_to(tmp_path / "intact")
    victim = damage(src, how)
    adapter = fixture.layout == "peft_adapter"
    out = tmp_path / ("out" if adapter else "out.safetensors")
    if command == "diff":
        args: tuple[Any, ...] = ("diff", src, intact, "--json")
    elif command == "convert":
        args = ("convert", src, out)
    else:
        args = (command, src, intact, *COMBINES[command], "-o", out)
    result = run(*args, inputs=(src, intact))
    assert result.exit_code in (1, 2), result.output
    if command == "diff" and result.exit_code == 1:  # read, and compared: what it lost
        report = json.loads(result.stdout)
        lost = [t["key"] for t in report["tensors"] if t["status"] == "only_b"]
        assert lost or names(result.output, victim), report["summary"]
    else:
        assert result.exit_code == 2 and names(result.output, victim), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "intact"]
