"""diff: which part of each side is compared and under which keys (per-side sections, automatic
prefix alignment), and a key whose type changed between a field and a tensor."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.diff.run import (
    DIFFER,
    IDENTICAL,
    ONLY_A,
    ONLY_B,
    TYPE_CHANGED,
    DiffReport,
    FieldDiff,
    diff,
)
from ckpttool.errors import InputError
from tests.support.dcp_cases import DCP, DCP_PTH, DCP_SAFETENSORS
from tests.support.helpers import FIXTURES

NUM_MODEL = 12  # tensors of the DCP fixture's model (tied pair included)


@pytest.fixture(scope="module")
def model() -> dict[str, torch.Tensor]:
    """The DCP fixture's model as one state dict (checkpoint.pth holds the same state)."""
    return dict(torch.load(DCP_PTH, weights_only=True)["model"])


def save(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


def statuses(report: DiffReport) -> dict[str, int]:
    return {status: n for status, n in report.counts().items() if n}


# --- a key whose type changed -----------------------------------------------------------------


def tutorial(loss: Any, model: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The PyTorch tutorial's "general checkpoint"."""
    return {"epoch": 5, "model_state_dict": model, "optimizer_state_dict": {}, "loss": loss}


def test_a_float_that_became_a_tensor_is_one_field_change(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    as_float = save(tmp_path / "float.pt", tutorial(2.5, model))
    as_tensor = save(tmp_path / "tensor.pt", tutorial(torch.tensor(2.5), model))
    report = diff(as_float, as_tensor)
    assert len(report.fields) == 1
    change = report.fields[0]
    assert (change.key, change.status, change.a, change.b) == ("loss", TYPE_CHANGED, 2.5, 2.5)
    assert change.a_tensor is None and change.b_tensor is not None
    assert (change.b_tensor.dtype, change.b_tensor.shape) == ("float32", ())
    assert statuses(report) == {IDENTICAL: NUM_MODEL}  # no "loss only in B" row
    assert not report.equal  # a type change is a change
    back = diff(as_tensor, as_float).fields
    assert back == [FieldDiff("loss", TYPE_CHANGED, 2.5, 2.5, a_tensor=change.b_tensor)]


def test_a_type_change_reads_no_value_with_quick_or_more_than_one_element(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    as_float = save(tmp_path / "float.pt", tutorial(2.5, model))
    as_tensor = save(tmp_path / "tensor.pt", tutorial(torch.tensor(2.5), model))
    quick = diff(as_float, as_tensor, quick=True).fields
    assert [(f.status, f.b, f.b_tensor is not None) for f in quick] == [(TYPE_CHANGED, None, True)]
    as_vector = save(tmp_path / "vector.pt", tutorial(torch.ones(3), model))
    vector = diff(as_float, as_vector).fields
    assert [(f.status, f.a, f.b) for f in vector] == [(TYPE_CHANGED, 2.5, None)]


def test_a_field_and_a_tensor_under_different_keys_stay_apart(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    a = save(tmp_path / "a.pt", {**tutorial(2.5, model), "loss": 2.5})
    b = save(tmp_path / "b.pt", {**tutorial(2.5, model), "loss": None, "val_loss": torch.ones(())})
    report = diff(a, b)
    assert report.fields == [FieldDiff("loss", "changed", 2.5, None)]
    assert [(t.key, t.status) for t in report.tensors if t.status != IDENTICAL] == [
        ("val_loss", ONLY_B)
    ]


# --- a section per side -----------------------------------------------------------------------


def test_a_section_per_side(tmp_path: Path, model: dict[str, torch.Tensor]) -> None:
    general = save(tmp_path / "tutorial.pt", tutorial(2.5, model))
    plain = save(tmp_path / "plain.pth", model)
    report = diff(general, plain, section_a="model_state_dict")
    assert report.equal and statuses(report) == {IDENTICAL: NUM_MODEL}
    assert (report.a.section, report.a.auto_section, report.b.section) == (
        "model_state_dict", False, None
    )  # fmt: skip
    assert report.notes == []
    assert diff(plain, general, section_b="model_state_dict").equal
    # --section names both sides; a per-side option overrides it for that side
    both = diff(general, general, section="model_state_dict", section_b="optimizer_state_dict")
    assert both.b.section == "optimizer_state_dict" and both.counts()[ONLY_A] == NUM_MODEL


def test_a_shared_section_one_side_lacks_says_how_to_name_one_side(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    general = save(tmp_path / "tutorial.pt", tutorial(2.5, model))
    plain = save(tmp_path / "plain.pth", model)
    with pytest.raises(InputError) as error:
        diff(general, plain, section="model_state_dict")
    assert str(error.value) == (
        f"{plain}: no section 'model_state_dict' in this checkpoint (--section applies to both "
        "files; to compare A's 'model_state_dict' with all of B, use --section-a model_state_dict)"
    )
    with pytest.raises(InputError, match=r"no section 'nothing' in this checkpoint$"):
        diff(general, plain, section="nothing")  # neither has it: no hint
    with pytest.raises(InputError, match=r"^.*tutorial\.pt: no section 'nothing'"):
        diff(general, plain, section_a="nothing")


# --- automatic alignment under one extra prefix -----------------------------------------------


def test_the_model_subtree_of_a_dict_aligns_with_a_plain_state_dict(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    # "weights" is no model-part name ckpttool knows: the keys themselves align it
    nested = save(tmp_path / "nested.pth", {"weights": model, "step": 7})
    plain = save(tmp_path / "plain.pth", model)
    report = diff(nested, plain)
    assert report.equal and statuses(report) == {IDENTICAL: NUM_MODEL}
    assert (report.a.section, report.a.auto_section, report.a.prefix) == ("weights", True, None)
    assert report.fields == []  # step is outside the compared part, as for a resume file
    assert report.notes == [
        "B's tensor keys are A's under 'weights.': comparing A's 'weights' section with all of B "
        "(use --section-a/--section-b to choose)"
    ]
    reverse = diff(plain, nested)
    assert (
        reverse.equal
        and reverse.b.section == "weights"
        and reverse.notes
        == [
            "A's tensor keys are B's under 'weights.': comparing all of A with B's 'weights' "
            "section (use --section-a/--section-b to choose)"
        ]
    )


def test_a_dict_whose_model_part_is_named_by_its_role_compares_that_part(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    nested = save(tmp_path / "nested.pth", {"model": model, "step": 7})
    report = diff(nested, save(tmp_path / "plain.pth", model))
    assert report.equal and statuses(report) == {IDENTICAL: NUM_MODEL}
    assert (report.a.section, report.a.auto_section) == ("model", True)
    assert report.notes == [
        "A (training checkpoint) and B (plain state dict) are different kinds: comparing A's "
        "'model' section with all of B (use --section-a/--section-b to choose)",
        "not compared: A's step (outside its 'model' section): the other side holds nothing "
        "under those names",
    ]


def test_the_tutorial_checkpoint_aligns_with_its_plain_model(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    momentum = {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}
    general = save(tmp_path / "tutorial.pt", {**tutorial(2.5, model), "optimizer_state_dict": momentum})  # fmt: skip
    report = diff(general, save(tmp_path / "plain.pth", model))
    assert report.equal and report.a.section == "model_state_dict" and report.a.auto_section
    assert "are different kinds: comparing A's 'model_state_dict' section" in report.notes[0]


def test_flat_module_prefixed_keys_align_by_removing_the_prefix(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    ddp = save(tmp_path / "ddp.pth", {f"module.{key}": value for key, value in model.items()})
    report = diff(save(tmp_path / "plain.pth", model), ddp)
    assert report.equal and statuses(report) == {IDENTICAL: NUM_MODEL}
    assert (report.b.section, report.b.prefix, report.a.prefix) == (None, "module.", None)
    assert report.notes == ["B's tensor keys are A's with the prefix 'module.': compared without it"]  # fmt: skip
    first = report.tensors[0]
    assert first.key == "model.embed_tokens.weight"
    assert first.b is not None and first.b.key == "module.model.embed_tokens.weight"


def test_a_two_rank_dcp_checkpoint_aligns_with_the_same_model_as_one_file(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    """The fixture's 2-rank DCP directory (a resume layout: its ``model`` is taken) against the
    same model saved by a DDP-wrapped module, then a DCP ``{model, step}`` of the same tensors
    against the plain file."""
    ddp = save(tmp_path / "ddp.pth", {f"module.{key}": value for key, value in model.items()})
    report = diff(DCP, ddp)
    assert report.equal and statuses(report) == {IDENTICAL: NUM_MODEL}
    assert (report.a.format, report.a.section, report.b.prefix) == ("dcp", "model", "module.")
    assert report.notes[-2] == "B's tensor keys are A's with the prefix 'module.': compared without it"  # fmt: skip
    assert report.notes[-1].startswith("not compared: A's optimizer, epoch, step")
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "model_step"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": one process
        dcp.save({"model": model, "step": 1200}, checkpoint_id=directory)
    plain = save(tmp_path / "plain.pth", model)
    report = diff(directory, plain)
    assert report.equal and statuses(report) == {IDENTICAL: NUM_MODEL}
    assert report.a.section == "model" and report.a.auto_section
    assert "are different kinds: comparing A's 'model' section" in report.notes[0]


def test_alignment_resolves_aliases_under_the_prefix(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    """save_model's file drops the tied embedding and names it in its metadata."""
    nested = save(tmp_path / "nested.pth", {"model": model, "step": 7})
    report = diff(nested, DCP_SAFETENSORS)
    assert report.equal and report.a.section == "model"
    assert any("metadata names it an alias" in note for note in report.notes)


def test_keys_that_match_only_in_part_are_not_aligned(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    plain = save(tmp_path / "plain.pth", model)
    partial = dict(model)
    partial.pop("model.norm.weight")
    partial["model.extra.weight"] = torch.zeros(2)
    prefixed = save(tmp_path / "prefixed.pth", {f"model.{k}": v for k, v in partial.items()})
    report = diff(prefixed, plain)
    assert statuses(report) == {ONLY_A: NUM_MODEL, ONLY_B: NUM_MODEL}
    assert report.notes == [] and report.a.prefix is None
    # a side that shares some keys with the other is never re-keyed
    mixed = {**model, "model.model.norm.weight": torch.ones(8)}
    shared = diff(save(tmp_path / "mixed.pth", mixed), plain)
    assert statuses(shared) == {IDENTICAL: NUM_MODEL, ONLY_A: 1} and shared.notes == []
    # flat keys of which only some carry the prefix are not one subtree: not aligned either
    flat = {**{f"model.{k}": v for k, v in model.items()}, "other": torch.ones(1)}
    assert diff(save(tmp_path / "flat.pth", flat), plain).counts()[ONLY_B] == NUM_MODEL


def test_two_candidate_prefixes_are_not_guessed(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    two = save(tmp_path / "two.pth", {"model": model, "net": model})  # two model-part names
    report = diff(two, save(tmp_path / "plain.pth", model))
    assert statuses(report) == {ONLY_A: 2 * NUM_MODEL, ONLY_B: NUM_MODEL}
    assert report.notes == [
        "the keys of one side are the other's under more than one prefix (A's 'model.', "
        "A's 'net.'): not aligned (use --section-a/--section-b to choose)"
    ]
    chosen = diff(two, tmp_path / "plain.pth", section_a="net")
    assert chosen.equal
    # a model and its EMA: the model is the model part, as an ML engineer reads the file
    with_ema = save(tmp_path / "ema.pth", {"model": model, "ema": model})
    assert diff(with_ema, tmp_path / "plain.pth").a.section == "model"


def test_aligned_keys_are_compared_like_any_others(
    tmp_path: Path, model: dict[str, torch.Tensor]
) -> None:
    """Aligned keys are compared like any others: a changed value still differs."""
    changed = dict(model)
    changed["model.norm.weight"] = changed["model.norm.weight"] + 1
    report = diff(
        save(tmp_path / "nested.pth", {"model": changed}), save(tmp_path / "p.pth", model)
    )
    assert statuses(report) == {IDENTICAL: NUM_MODEL - 1, DIFFER: 1} and not report.equal


def test_many_candidate_prefixes_cost_linear_time_and_make_a_short_note() -> None:
    """9,000 one-tensor groups (``g0.w``, ``g1.w``, ...) each pair with a one-tensor side: the
    search stops at the second candidate instead of listing 9,000 in a note."""
    from ckpttool.commands.diff.match import extra_prefixes, match_tensors
    from ckpttool.model.records import StorageRecord, TensorRecord

    def record(key: str, index: int) -> TensorRecord:
        storage = StorageRecord(str(index), "float32", 4, "cpu", f"archive/data/{index}", 16)
        return TensorRecord(key, "float32", (4,), (1,), 0, storage)

    many = {f"g{i}.w": record(f"g{i}.w", i) for i in range(9000)}
    calls = {"n": 0}

    def counting(*args: Any) -> Any:
        calls["n"] += 1
        return match_tensors(*args)

    import ckpttool.commands.diff.match

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpttool.commands.diff.match, "match_tensors", counting)
        found = extra_prefixes(many, {"w": record("w", -1)}, {}, {})
    assert found == ["g0.", "g1."] and calls["n"] == 2
    # a large group still pairs when it is the only candidate
    big = {f"model.layer{i}": record(f"model.layer{i}", i) for i in range(9000)}
    other = {f"layer{i}": record(f"layer{i}", -i) for i in range(9000)}
    assert extra_prefixes({**big, "model": record("model", 0)}, other, {}, {}) == ["model."]


def _resume_dicts(epoch_b: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Issue 49 item 7: a run's resume dict with its ``scheduler`` (labelled "resume
    checkpoint") and the same run's dict without one ("MiniMind-style"), written by a real
    AdamW and StepLR; B's ``epoch`` is ``epoch_b``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    for _ in range(3):
        net(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    common = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}
    with_scheduler = {**common, "scheduler": scheduler.state_dict(), "epoch": 1}
    return with_scheduler, copy.deepcopy({**common, "epoch": epoch_b})


def test_resume_files_labelled_apart_compare_everything_both_hold(tmp_path: Path) -> None:
    """Two resume dicts whose labels differ: not "identical" (it was, exit 0): the epoch and the
    scheduler only A holds are reported, the optimizer states are compared too."""
    a, b = _resume_dicts(epoch_b=0)
    report = diff(save(tmp_path / "a.pth", a), save(tmp_path / "b.pth", b))
    assert not report.equal
    changed = {entry.key: (entry.status, entry.a, entry.b) for entry in report.fields}
    assert changed["epoch"] == ("changed", 1, 0)
    assert changed["scheduler.last_epoch"] == ("only_a", 3, None)
    # the model's 4 tensors and AdamW's 3 states of each of its 4 parameters
    assert statuses(report) == {IDENTICAL: 4 + 12}
    assert any(e.key == "optimizer.state.0.exp_avg_sq" for e in report.tensors)
    assert (report.a.num_tensors, report.b.num_tensors) == (16, 16)
    assert report.notes[-1] == (
        "also compared, under the files' own keys: what both hold outside those sections "
        "(A: optimizer, step, scheduler, epoch; B: optimizer, step, epoch)"
    )


def test_resume_files_labelled_apart_differ_in_an_optimizer_state(tmp_path: Path) -> None:
    a, b = _resume_dicts(epoch_b=1)
    del a["scheduler"]["last_epoch"]  # the scheduler: A's alone, reported as such
    b["optimizer"]["state"][0]["exp_avg"] = b["optimizer"]["state"][0]["exp_avg"] + 1
    report = diff(save(tmp_path / "a.pth", a), save(tmp_path / "b.pth", b))
    assert not report.equal
    assert {e.key: e.status for e in report.tensors}["optimizer.state.0.exp_avg"] == DIFFER
    assert all(entry.key.startswith("scheduler.") for entry in report.fields)


def test_resume_files_labelled_apart_equal_outside_the_model_exit_0(tmp_path: Path) -> None:
    """The same run with an empty ``scheduler`` in one and none in the other: exit 0 only
    because every tensor and field both hold was compared equal."""
    a, b = _resume_dicts(epoch_b=1)
    a["scheduler"] = {}
    report = diff(save(tmp_path / "a.pth", a), save(tmp_path / "b.pth", b))
    assert report.equal and statuses(report) == {IDENTICAL: 16}


def test_fields_one_side_holds_are_summed_up_by_entry_unless_all() -> None:
    """Issue 49 item 13: a model directory against a Trainer checkpoint printed every field of
    the optimizer, scheduler, RNG, trainer state and training arguments as "(absent) -> ..."
    (233 lines). Now one line per entry and side; ``--all`` and ``--json`` list them all."""
    model = FIXTURES / "frameworks" / "hf_model"
    trainer = FIXTURES / "frameworks" / "trainer_1proc" / "output" / "checkpoint-8"
    runner = CliRunner()
    data = json.loads(runner.invoke(cli, ["diff", str(model), str(trainer), "--quick", "--json"]).stdout)  # fmt: skip
    only_b: dict[str, int] = {}
    for entry in data["fields"]:
        if entry["status"] == "only_b":
            entry_name = entry["key"].split(".")[0]
            only_b[entry_name] = only_b.get(entry_name, 0) + 1
    assert only_b["optimizer"] > 3 and only_b["training_args"] > 3
    text = runner.invoke(cli, ["diff", str(model), str(trainer), "--quick"])
    assert text.exit_code == 1 and "(absent)" not in text.stdout
    for entry_name, count in only_b.items():
        assert f"{entry_name}: {count} fields only in B (--all or --json lists them)" in text.stdout
    everything = runner.invoke(cli, ["diff", str(model), str(trainer), "--quick", "--all"])
    assert everything.stdout.count("(absent)") == sum(only_b.values())
