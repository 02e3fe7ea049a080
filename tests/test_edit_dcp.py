"""``ckpttool edit`` of torch.distributed.checkpoint directories (issue 30): the result stays a
DCP directory (the same data files, every tensor in its ranks' chunks) and loads with torch's
own DCP readers (``dcp_to_torch_save``, ``torch.distributed.checkpoint.load`` with no process
group) equal to the gathered reference the fixture generator saved beside it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpttool import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.edit_directory import edit
from tests.support.helpers import FIXTURES

DCP = FIXTURES / "dcp" / "checkpoint"
GATHERED = FIXTURES / "dcp" / "checkpoint.pth"  # the same state as full tensors, torch.save'd
DATA_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp"}


def _torch_load_dcp(directory: Path, tmp_path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "gathered_by_torch.pth"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _chunks(directory: Path) -> dict[str, int]:
    with open_checkpoint(directory) as ckpt:
        return {record.key: len(record.storage.chunks) for record in ckpt.tensors()}


def test_for_inference_drops_the_optimizer_and_torch_loads_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "inference"
    report = edit(DCP, out, for_inference=True)
    assert report.written and report.format == "dcp" and report.dropped == ("optimizer",)
    assert {p.name for p in out.iterdir()} == DATA_FILES
    loaded = _torch_load_dcp(out, tmp_path)
    reference = torch.load(GATHERED, weights_only=True)
    assert set(loaded) == set(reference) - {"optimizer"}
    assert (loaded["epoch"], loaded["step"], loaded["world_size"]) == (1, 1200, 2)
    assert set(loaded["model"]) == set(reference["model"])
    assert all(_same(loaded["model"][k], v) for k, v in reference["model"].items())
    # still sharded as the ranks saved it: the 2-D weights in two chunks, one in each file
    source_chunks = _chunks(DCP)
    assert _chunks(out) == {k: n for k, n in source_chunks.items() if k.startswith("model.")}
    assert sum(p.stat().st_size for p in out.iterdir()) < sum(
        p.stat().st_size for p in DCP.iterdir()
    )


def test_rename_and_cast_load_with_dcp_load_into_a_state_dict(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "bf16"
    report = edit(
        DCP, out, drop=["optimizer"], rename=[r"^model\.model\.=model.base."], dtype="bf16",
        keep_dtype=["*norm*"],
    )  # fmt: skip
    assert report.rules == ((r"^model\.model\.=model.base.", 11),)
    reference = torch.load(GATHERED, weights_only=True)["model"]
    expected = {}
    for key, value in reference.items():
        name = "base." + key[len("model.") :] if key.startswith("model.") else key
        expected[name] = value if "norm" in key else value.to(torch.bfloat16)
    state: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in expected.items()},
        "step": 0,
    }
    dcp.load(state, checkpoint_id=str(out))  # no process group: torch loads it alone
    assert state["step"] == 1200
    assert all(_same(state["model"][k], v) for k, v in expected.items())
    assert torch.distributed.is_initialized() is False


def test_in_place_replaces_the_directory_whole(tmp_path: Path) -> None:
    target = tmp_path / "step_1200"
    shutil.copytree(DCP, target)
    result = CliRunner().invoke(cli, ["edit", str(target), "--for-inference", "--in-place"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in target.iterdir()} == DATA_FILES
    assert "optimizer" not in _torch_load_dcp(target, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"step_1200", "gathered_by_torch.pth"}


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = edit(DCP, out, for_inference=True, dry_run=True)
    assert report.dropped == ("optimizer",) and not report.written and not out.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--rename", r"\.exp_avg_sq$=.exp_avg"], "would both be named"),
        (["--use-ema"], "--use-ema does not apply to a torch.distributed.checkpoint directory"),
        (["--map", "llama-meta-to-hf"], "--map does not apply"),
        (["--compact"], "--compact does not apply"),
    ],
    ids=["rename-collides", "use-ema", "map", "compact"],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, options: list[str], message: str
) -> None:
    source = tmp_path / "checkpoint"
    shutil.copytree(DCP, source)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    result = CliRunner().invoke(cli, ["edit", str(source), *options, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {source}: ") and message in lines[0]
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_an_existing_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = CliRunner().invoke(cli, ["edit", str(DCP), "--for-inference", "-o", str(out)])
    assert result.exit_code == 2 and "already exists" in result.output
    assert list(out.iterdir()) == []


def test_a_chunk_written_wrong_is_caught_on_read_back_and_nothing_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.formats.dcp import write

    original = write._write_item

    def wrong(files: Any, item: Any, out: Any) -> None:
        if item.cast is not None:
            dtype, cast = item.cast
            item = type(item)(item.fqn, item.span, item.chunk, item.storage,
                              (dtype, lambda values: bytes(len(cast(values)))))  # fmt: skip
        original(files, item, out)

    monkeypatch.setattr(write, "_write_item", wrong)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["edit", str(DCP), "--dtype", "bf16", "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert "its bytes read back differ: nothing was replaced" in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_value_the_writer_lost_is_caught_on_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.formats.dcp import write

    original = write._at
    monkeypatch.setattr(
        write,
        "_at",
        lambda root, path: write._ABSENT if path == ("step",) else original(root, path),
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["edit", str(DCP), "--for-inference", "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert "values differ from the edit's: nothing was replaced" in result.output
    assert list(tmp_path.iterdir()) == []


def test_other_files_in_the_directory_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "step_1200"
    shutil.copytree(DCP, target)
    (target / "train_config.yaml").write_text("lr: 0.001\n")
    (target / "notes").mkdir()
    (target / "notes" / "README").write_text("run 7\n")
    edit(target, in_place=True, for_inference=True)
    assert (target / "train_config.yaml").read_text() == "lr: 0.001\n"
    assert (target / "notes" / "README").read_text() == "run 7\n"
    assert "optimizer" not in _torch_load_dcp(target, tmp_path)


def test_dtype_casts_the_model_and_leaves_the_optimizer_state(tmp_path: Path) -> None:
    """Issue 49 item 3, in a DCP directory: the model cast, the optimizer's state as saved."""
    out = tmp_path / "bf16"
    report = edit(DCP, out, dtype="bf16")
    loaded = _torch_load_dcp(out, tmp_path)
    reference = torch.load(GATHERED, weights_only=True)
    for key, value in reference["model"].items():
        assert _same(loaded["model"][key], value.to(torch.bfloat16)), key
    moments = [
        (loaded["optimizer"]["state"][index][name], value)
        for index, state in reference["optimizer"]["state"].items()
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    ]
    assert moments and all(_same(after, before) for after, before in moments)
    assert report.not_cast and all(k.startswith("optimizer.") for k in report.not_cast)
    assert all(k.startswith("model.") for k in report.cast)
