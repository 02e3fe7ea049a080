"""rescale-step on framework directories (Trainer checkpoint-N/, accelerate save_state) and on
role-recognised single files, on the framework-written fixtures; with the frameworks installed,
the proof that they resume from the rescaled output at the right step and learning rate."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.rescale.directory import rescale_directory
from ckpttool.commands.rescale.run import rescale_step
from ckpttool.errors import OutputExistsError
from tests.test_json_schemas import assert_valid

FIXTURES = Path(__file__).parent / "fixtures" / "frameworks"
TRAINER_2 = FIXTURES / "trainer_2proc" / "output" / "checkpoint-4"
TRAINER_1 = FIXTURES / "trainer_1proc" / "output" / "checkpoint-4"
ACCELERATE_2 = FIXTURES / "accelerate_2proc" / "state"
ACCELERATE_1 = FIXTURES / "accelerate_1proc" / "state"


def _copy(source: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _root(path: Path) -> dict:
    with open_checkpoint(path) as ckpt:
        return dict(ckpt.root)


def test_trainer_two_processes_to_one(tmp_path: Path) -> None:
    source = _copy(TRAINER_2, tmp_path)
    before = _snapshot(source)
    report = rescale_directory(source, 1)
    output = tmp_path / "ckpt.ws1"
    assert report.written and report.output == output
    assert _snapshot(source) == before  # the source is untouched
    changes = {(c.file, c.key): (c.old, c.new) for c in report.changes}
    assert changes == {
        ("trainer_state.json", "global_step"): (4, 8),
        ("scheduler.pt", "last_epoch"): (4, 8),
        ("scheduler.pt", "_step_count"): (5, 9),
    }
    state = json.loads((output / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["epoch"] == pytest.approx(4 / 3)
    assert state["log_history"] == json.loads(before["trainer_state.json"])["log_history"]
    scheduler = _root(output / "scheduler.pt")
    assert (scheduler["last_epoch"], scheduler["_step_count"]) == (8, 9)
    # rank 0's RNG file becomes the one-process name; rank 1's is dropped
    names = sorted(p.name for p in output.iterdir())
    assert "rng_state.pth" in names and not any(n.startswith("rng_state_") for n in names)
    assert (output / "rng_state.pth").read_bytes() == before["rng_state_0.pth"]
    for name in ("model.safetensors", "optimizer.pt", "training_args.bin", "config.json"):
        assert (output / name).read_bytes() == before[name]


def test_trainer_one_process_to_two_inexact(tmp_path: Path) -> None:
    source = _copy(TRAINER_1, tmp_path)
    report = rescale_directory(source, 3, output=tmp_path / "out")
    assert (report.plan.old_step, report.plan.new_step, report.plan.repeated_batches) == (4, 1, 1)
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 1
    assert state["epoch"] == pytest.approx(state["epoch"])  # scaled with the floor
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert "rng_state_0.pth" in names and "rng_state.pth" not in names
    assert "rng_state_1.pth" not in names  # new ranks get none: Trainer keeps its seeded state


def test_accelerate_two_processes_to_one(tmp_path: Path) -> None:
    source = _copy(ACCELERATE_2, tmp_path)
    before = _snapshot(source)
    report = rescale_directory(source, 1)
    output = report.output
    assert [(c.file, c.key, c.old, c.new) for c in report.changes] == [
        ("random_states_0.pkl", "step", 2, 4)
    ]
    assert _root(output / "random_states_0.pkl")["step"] == 4
    assert not (output / "random_states_1.pkl").exists()
    # AcceleratedScheduler: 2 optimizer steps x 2 processes = 4 x 1 process: unchanged
    assert (output / "scheduler.bin").read_bytes() == before["scheduler.bin"]
    assert _snapshot(source) == before


def test_accelerate_one_process_to_two_duplicates_rank_zero(tmp_path: Path) -> None:
    report = rescale_directory(_copy(ACCELERATE_1, tmp_path), 2)
    for rank in (0, 1):
        assert _root(report.output / f"random_states_{rank}.pkl")["step"] == 2
    assert _root(report.output / "scheduler.bin")["last_epoch"] == 4


def test_dry_run_writes_nothing_and_existing_output_refused(tmp_path: Path) -> None:
    source = _copy(TRAINER_2, tmp_path)
    report = rescale_directory(source, 1, dry_run=True)
    assert not report.written and sorted(os.listdir(tmp_path)) == ["ckpt"]
    (tmp_path / "ckpt.ws1").mkdir()
    with pytest.raises(OutputExistsError):
        rescale_directory(source, 1)
    rescale_directory(source, 1, overwrite=True)
    assert (
        json.loads((tmp_path / "ckpt.ws1" / "trainer_state.json").read_text())["global_step"] == 8
    )


def test_in_place(tmp_path: Path) -> None:
    source = _copy(ACCELERATE_2, tmp_path)
    rescale_directory(source, 1, in_place=True)
    assert _root(source / "random_states_0.pkl")["step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("in_place", [False, True])
def test_crash_leaves_old_checkpoint_and_no_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    source = _copy(TRAINER_2, tmp_path)
    before = _snapshot(source)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "rename", crash)
    monkeypatch.setattr("ckpttool.io.atomic._exchange", lambda a, b: False)
    with pytest.raises(OSError, match="simulated"):
        rescale_directory(source, 1, in_place=in_place)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no output, no temp dir left
    assert _snapshot(source) == before


def test_cli_json_and_text(tmp_path: Path) -> None:
    source = _copy(TRAINER_2, tmp_path)
    result = CliRunner().invoke(
        cli, ["rescale-step", str(source), "--world-size", "1", "--dry-run", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["layout"] == "hf_trainer" and data["to"] == {"step": 8, "world_size": 1}
    assert {"file": "scheduler.pt", "key": "last_epoch", "old": 4, "new": 8} in data["changes"]
    result = CliRunner().invoke(cli, ["rescale-step", str(source), "--world-size", "1"])
    assert result.exit_code == 0, result.output
    assert "trainer_state.json: global_step 4 -> 8" in result.output
    assert "drop rng_state_1.pth" in result.output


def test_tutorial_step_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "step_checkpoint.pth"
    shutil.copy(FIXTURES / "tutorial" / "step_checkpoint.pth", path)
    report = rescale_step(path, 2, from_world_size=1)
    assert (report.plan.step_key, report.plan.old_step, report.plan.new_step) == ("step", 3, 1)
    assert _root(path)["step"] == 1


# -- the proof, with the frameworks themselves ------------------------------------------------


def test_accelerate_load_state_reads_rescaled_folder(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from accelerate import Accelerator

    from tests.fixtures.frameworks.models import llama_model, prepare_accelerate_run

    report = rescale_directory(_copy(ACCELERATE_2, tmp_path), 1)
    accelerator = Accelerator(cpu=True)
    model = llama_model()
    _, _, _, scheduler, _ = prepare_accelerate_run(accelerator, model)
    accelerator.load_state(str(report.output))
    assert accelerator.step == 4  # 2 batches on each of 2 processes = 4 on one
    assert scheduler.scheduler.last_epoch == 4


def _resume_trainer(
    checkpoint: Path, output_dir: Path, max_steps: int, warmup_steps: int = 2
) -> list[dict]:
    from transformers import Trainer, default_data_collator

    from tests.fixtures.frameworks.models import TokenDataset, llama_model
    from tests.fixtures.frameworks.write_hf import training_arguments

    args = training_arguments(str(output_dir))
    args.max_steps = max_steps
    args.warmup_steps = warmup_steps
    args.save_strategy = "no"
    trainer = Trainer(
        model=llama_model().train(), args=args, train_dataset=TokenDataset(),
        data_collator=default_data_collator,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_resumes_rescaled_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    report = rescale_directory(_copy(TRAINER_2, tmp_path), 1)
    # 8 steps x 2 processes of the saved run = 16 steps on one process
    # the saved run: 8 steps on 2 processes, 2 of them warm-up; the same schedule on one process
    # is 16 steps, 4 of warm-up, as the report says
    assert "resume with max_steps=16 (saved 8) and warmup_steps=4 (saved 2)" in " ".join(
        report.notes
    )
    logs = _resume_trainer(report.output, tmp_path / "run", max_steps=16, warmup_steps=4)
    new_logs = [entry for entry in logs if entry["step"] > 4]
    assert new_logs[0]["step"] == 9  # 4 steps x 2 processes = 8 one-process steps were done
    assert new_logs[-1]["step"] == 16
    # every resumed step, the first included, runs at the rate of the rescaled schedule: Trainer
    # logs at step k the rate it used for it, lambda(k - 1) of "linear" with warm-up 4, total 16
    by_step = {entry["step"]: entry["learning_rate"] for entry in new_logs}
    assert by_step == {k: pytest.approx(1e-3 * (16 - (k - 1)) / 12) for k in range(9, 17)}


def test_trainer_resumes_an_unchanged_checkpoint_on_its_own_process_count(tmp_path: Path) -> None:
    """The baseline: the 1-process checkpoint-4 resumed on 1 process goes on at step 5 with the
    saved run's schedule (linear, warm-up 2, 8 steps)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    logs = _resume_trainer(_copy(TRAINER_1, tmp_path), tmp_path / "run", max_steps=8)
    by_step = {entry["step"]: entry["learning_rate"] for entry in logs if entry["step"] > 4}
    assert by_step == {k: pytest.approx(1e-3 * (8 - (k - 1)) / 6) for k in range(5, 9)}


def test_trainer_without_rescale_repeats_data(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    source = _copy(TRAINER_2, tmp_path)
    logs = _resume_trainer(source, tmp_path / "run", max_steps=16)
    new_logs = [entry for entry in logs if entry["step"] > 4]
    assert new_logs[0]["step"] == 5  # resumes 4 one-process steps (8 samples) too early


# -- where a Trainer checkpoint goes: a place Trainer resumes from ------------------------------


def test_trainer_checkpoint_goes_to_a_sibling_run_that_get_last_checkpoint_finds(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    run = _copy(TRAINER_2.parent, tmp_path, "output")  # the run's output_dir, checkpoint-4 and -8
    before = sort_checkpoints(str(run))
    report = rescale_directory(run / "checkpoint-4", 1)
    # checkpoint-<new global_step> in a run directory of its own: what Trainer itself would have
    # written on one process, found by auto-resume, out of reach of the saved run's rotation
    assert report.output == tmp_path / "output.ws1" / "checkpoint-8" and report.written
    assert get_last_checkpoint(str(tmp_path / "output.ws1")) == str(report.output)
    assert report.resume_from_checkpoint == str(report.output)
    assert (
        f'resume with trainer.train(resume_from_checkpoint="{report.output}"), or with '
        f"output_dir={str(tmp_path / 'output.ws1')!r} and resume_from_checkpoint=True"
    ) in " ".join(report.notes)
    assert sort_checkpoints(str(run)) == before
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-8")
    assert json.loads((report.output / "trainer_state.json").read_text())["global_step"] == 8
    assert sorted(os.listdir(tmp_path)) == ["output", "output.ws1"]  # no temp dir left


def test_an_output_in_the_run_that_trainer_would_rotate_but_never_resume_is_refused(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    run = _copy(TRAINER_2.parent, tmp_path, "output")
    (run / "checkpoint-4.ws1").mkdir()  # what the rule is about, checked on transformers itself
    assert str(run / "checkpoint-4.ws1") in sort_checkpoints(str(run))
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-8")
    (run / "checkpoint-4.ws1").rmdir()
    result = CliRunner().invoke(
        cli, ["rescale-step", str(run / "checkpoint-4"), "--world-size", "1",
              "-o", str(run / "checkpoint-4.ws1")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {run / 'checkpoint-4.ws1'}: in the run's output_dir, Trainer's rotation "
        "(save_total_limit) counts a checkpoint-* folder and may delete it, while "
        "get_last_checkpoint never resumes from one not named checkpoint-<N>; write it to "
        f"another run directory (the default: {tmp_path / 'output.ws1' / 'checkpoint-8'})\n"
    )
    assert sorted(os.listdir(run)) == ["checkpoint-4", "checkpoint-8"]
    result = CliRunner().invoke(
        cli, ["rescale-step", str(run / "checkpoint-4"), "--world-size", "1", "--dry-run", "--json"]
    )
    data = json.loads(result.stdout)
    assert_valid("rescale-step", data)
    assert data["resume_from_checkpoint"] == str(tmp_path / "output.ws1" / "checkpoint-8")


def test_show_lists_the_rescaled_checkpoints_a_trainer_output_dir_holds(tmp_path: Path) -> None:
    run = _copy(TRAINER_2.parent, tmp_path, "output")
    shutil.copytree(run / "checkpoint-4", run / "checkpoint-4.ws2")  # as an older ckpttool wrote
    (run / "checkpoint-notes").mkdir()  # not a checkpoint: not listed
    report = rescale_directory(run / "checkpoint-8", 1)
    result = CliRunner().invoke(cli, ["show", str(report.output.parent)])
    assert result.exit_code == 0, result.output
    assert "checkpoint-16" in result.output and "note:" not in result.output
    result = CliRunner().invoke(cli, ["show", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert [(c["name"], c["step"], c["resumable"]) for c in json.loads(result.stdout)["checkpoints"]] == [
        ("checkpoint-4", 4, True), ("checkpoint-4.ws2", 4, False), ("checkpoint-8", 8, True),
    ]  # fmt: skip
    text = CliRunner().invoke(cli, ["show", str(run)]).stdout
    assert text.splitlines()[-1] == (
        "note: checkpoint-4.ws2: not checkpoint-<N>, so Trainer's get_last_checkpoint never "
        "resumes from it, but its rotation (save_total_limit) counts it and may delete it"
    )
