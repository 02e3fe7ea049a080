"""Issue 49, nothing lost and no quiet wrong answer: ``verify``, ``show`` and ``repair`` on
files that the framework wrote and that were then torn, cut or left beside the weights. Each
test names the wrong answer the old code gave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.repair import repair_file
from ckpttool.commands.verify import verify, verify_file
from tests.test_repair import RESUME, _cut, _safetensors, _same_bits

FRAMEWORKS = Path(__file__).parent / "fixtures" / "frameworks"
HF_MODEL = FRAMEWORKS / "hf_model"
TRAINER_OUTPUT = FRAMEWORKS / "trainer_1proc" / "output"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(arg) for arg in args])


def _torn_torch_save(path: Path, state: dict[str, torch.Tensor]) -> None:
    """What an interrupted ``torch.save(state, path)`` leaves: its first half."""
    torch.save(state, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ------------------------------------------------------------------------------- verify


def test_verify_of_a_model_directory_checks_torn_files_beside_its_weights(tmp_path: Path) -> None:
    """Old: OK, exit 0: a ``pytorch_model.bin`` or ``.pth`` the layout does not load was
    neither checked nor named."""
    model = tmp_path / "model"
    shutil.copytree(HF_MODEL, model)
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    _torn_torch_save(model / "pytorch_model.bin", state)
    _torn_torch_save(model / "extra.pth", state)
    result = verify_file(model)
    assert [p.split(": ", 1)[0] for p in result.problems] == ["extra.pth", "pytorch_model.bin"]
    assert any(
        line.startswith("also verified, though the Hugging Face model directory does not load")
        and line.endswith("extra.pth, pytorch_model.bin")
        for line in result.checked
    )
    assert run("verify", model).exit_code == 1
    (model / "extra.pth").unlink()
    torch.save(state, model / "pytorch_model.bin")  # whole: checked, and good
    assert verify_file(model).ok


def test_verify_of_a_trainer_output_dir_walks_its_checkpoints(tmp_path: Path) -> None:
    """Old: ``verify output/`` refused (exit 2) what ``verify`` of its parent walked."""
    output = tmp_path / "output"
    shutil.copytree(TRAINER_OUTPUT, output)
    results = verify([output])
    assert [r.path for r in results] == [str(output / "checkpoint-4"), str(output / "checkpoint-8")]
    assert all(r.ok for r in results)
    assert run("verify", output).exit_code == 0
    (output / "checkpoint-8" / "trainer_state.json").unlink()
    result = run("verify", output)
    assert result.exit_code == 1 and "checkpoint-8: PROBLEMS" in result.output


# --------------------------------------------------------------------------------- show


def test_show_of_a_run_directory_marks_a_checkpoint_with_torn_weights_incomplete(
    tmp_path: Path,
) -> None:
    """Old: ``complete: yes`` for a checkpoint whose ``model.safetensors`` was cut short."""
    output = tmp_path / "output"
    shutil.copytree(TRAINER_OUTPUT, output)
    weights = output / "checkpoint-8" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    result = run("show", output, "--json")
    assert result.exit_code == 0, result.output
    listing = {c["name"]: c for c in json.loads(result.output)["checkpoints"]}
    assert listing["checkpoint-4"]["complete"] and listing["checkpoint-4"]["missing"] == []
    assert not listing["checkpoint-8"]["complete"]
    (why,) = listing["checkpoint-8"]["missing"]
    assert why.startswith("damaged: model.safetensors: tensors extend")
    text = run("show", output).output
    assert "checkpoint-8  8       no" in text


# ------------------------------------------------------------------------------- repair


def test_fill_from_a_model_directory_finds_the_tensors_its_files_hold(tmp_path: Path) -> None:
    """Old: every lost tensor stayed lost, 'DIR has no tensor ...', though DIR holds it (as
    'model.<key>': the directory's weights section)."""
    cut = _cut(HF_MODEL / "model.safetensors", tmp_path, 6000, "model.safetensors")
    report = repair_file(cut, tmp_path / "repaired.safetensors", fill_from=HF_MODEL)
    assert report.lost == () and report.filled and report.exit_code == 0
    got, want = (
        _safetensors(tmp_path / "repaired.safetensors"),
        _safetensors(HF_MODEL / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    assert all(_same_bits(got[key], want[key]) for key in want)


def test_repair_of_a_cut_resume_file_says_how_much_optimizer_state_it_keeps(
    tmp_path: Path,
) -> None:
    """Old: the repaired resume file's optimizer covered a few of the parameters, and the
    report listed the keys but never said so."""
    cut = _cut(RESUME, tmp_path, RESUME.stat().st_size * 64 // 100, "cut.pth")  # in the moments
    report = repair_file(cut)
    written = torch.load(report.output, weights_only=True)["optimizer"]
    params = sum(len(g["params"]) for g in written["param_groups"])
    kept = len(written["state"])
    assert 0 < kept < params
    (line,) = [d for d in report.damage if d.startswith("optimizer: ")]
    assert line.startswith(
        f"optimizer: the repaired file keeps the optimizer state of {kept} of the {params} "
        f"parameters; {params - kept} entries lost or left out"
    )
    assert "--fill-from" in line and report.exit_code == 1
    assert line in run("repair", cut, "--dry-run").output


def test_a_cut_file_s_message_names_repair(tmp_path: Path) -> None:
    """Old: 'use the previous checkpoint' and nothing about salvaging the rest."""
    zip_cut = _cut(RESUME, tmp_path, RESUME.stat().st_size // 2, "cut.pth")
    shown = run("show", zip_cut)
    assert shown.exit_code == 2 and "ckpttool repair" in shown.output
    safetensors_cut = _cut(HF_MODEL / "model.safetensors", tmp_path, 6000, "model.safetensors")
    (result,) = verify([safetensors_cut])
    assert any("ckpttool repair" in problem for problem in result.problems)
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(4096.0)}, legacy, _use_new_zipfile_serialization=False)
    legacy_cut = _cut(legacy, tmp_path, legacy.stat().st_size // 2, "legacy_cut.pt")
    shown = run("show", legacy_cut)
    assert shown.exit_code == 2 and "ckpttool repair salvages" in shown.output


# ------------------------------------------------------- leftovers of interrupted writes


STATE_DICT = Path(__file__).parent / "fixtures" / "ckpttool" / "pretrain_32.pth"


def test_verify_of_a_folder_names_orphan_temp_files_staged_directories_and_stray_backups(
    tmp_path: Path,
) -> None:
    """Old: exit 0 with the stray backup reported OK as a checkpoint, the staged directory
    verified as a broken model directory, and the temp file whose target is gone not named."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(STATE_DICT, folder / "pretrain_32.pth")
    (folder / "pretrain_32.pth.bak").hardlink_to(folder / "pretrain_32.pth")  # killed --backup
    orphan = folder / ".gone.pth.k2j3.ckpttool-tmp"
    orphan.write_bytes(b"PK\x03\x04partial")
    staged = folder / ".out.a8b9.ckpttool-tmp"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"partial")
    shutil.copy(STATE_DICT, folder / "kept.pth")
    torch.save({"w": torch.zeros(2)}, folder / "kept.pth.bak")  # a finished backup: the user's
    result = run("verify", "--json", folder)
    assert result.exit_code == 1, result.output
    entries = {Path(f["path"]).name: f for f in json.loads(result.output)["files"]}
    assert sorted(entries) == [
        "kept.pth",
        "kept.pth.bak",
        "pretrain_32.pth",
        "pretrain_32.pth.bak",
        "run",
    ]
    (stray,) = entries["pretrain_32.pth.bak"]["problems"]
    assert stray.startswith("stray backup: a second name of pretrain_32.pth (the same file)")
    assert entries["kept.pth.bak"]["ok"] and entries["pretrain_32.pth"]["ok"]
    assert entries["run"]["leftover_temp_files"] == [str(orphan), str(staged)]


def test_verify_of_a_model_directory_names_a_staged_directory_inside_it(tmp_path: Path) -> None:
    """Old: OK: only temp files named after a member were seen."""
    model = tmp_path / "model"
    shutil.copytree(HF_MODEL, model)
    staged = model / ".out.x1.ckpttool-tmp"  # a staged convert output, say
    staged.mkdir()
    result = verify_file(model)
    assert result.leftovers == [str(staged)] and not result.ok
    assert run("verify", model).exit_code == 1


def test_repair_of_a_directory_exits_1_for_damage_it_leaves_even_when_it_changed_something(
    tmp_path: Path,
) -> None:
    """Old: exit 0 once the index was rewritten, though a temp file it did not remove stayed."""
    from ckpttool.commands.repair import repair

    model = tmp_path / "model"
    shutil.copytree(FRAMEWORKS / "hf_sharded", model)
    (model / "model.safetensors.index.json").unlink()
    (model / "model.safetensors.index.json.tmp").write_bytes(b"{")
    report = repair(model)
    assert report.written and [a.action for a in report.actions] == ["rewrite index"]
    assert report.unrepaired == (
        "model.safetensors.index.json.tmp: leftover temp file of a save interrupted before it "
        "renamed its temp file",
    )
    assert report.exit_code == 1
    result = run("repair", model)  # the index is right now; the temp file still stays
    assert result.exit_code == 1 and "damage (stays): model.safetensors.index.json.tmp" in (
        result.output
    )
    cleaned = repair(model, clean=True)
    assert cleaned.unrepaired == () and cleaned.exit_code == 0
