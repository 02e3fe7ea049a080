"""convert and diff on DeepSpeed ZeRO checkpoints (tests/fixtures/deepspeed, written by DeepSpeed).

``convert`` must give, tensor for tensor and bit for bit, the state dict DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` gives: checked against the frozen manifest and
against the installed DeepSpeed, live, on every ZeRO-1/2/3 case and tag (padding, group
boundaries, the frozen parameter, the tied ``head.weight``, the buffer). Consolidation reads the
fp32 partitions' bytes and nothing else of the optimizer files (never the Adam moments), one
tensor's range at a time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.convert.run import convert
from ckpttool.commands.diff.run import DIFFER, IDENTICAL, diff
from ckpttool.errors import CkptError
from ckpttool.frameworks.deepspeed.consolidate import ZeroWeights, open_zero_weights
from ckpttool.model.records import TensorRecord, walk

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
ZERO_CASES = [name for name, case in MANIFEST["cases"].items() if case["stage"] in (1, 2, 3)]
TAGS = ("global_step2", "global_step4")


def save_dir(case: str) -> Path:
    return FIXTURES / case / "checkpoints"


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(as_bytes(tensor)).hexdigest()


def written(report: Any) -> dict[str, torch.Tensor]:
    """Every name zero_to_fp32 gives, read from the written safetensors (aliases resolved)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in report.outputs:
        if path.suffix == ".safetensors":
            tensors.update(load_file(path))
    for alias, stored in report.aliases.items():
        tensors[alias] = tensors[stored]
    return tensors


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("tag", [None, *TAGS])
@pytest.mark.parametrize("case", ZERO_CASES)
def test_convert_equals_zero_to_fp32(case: str, tag: str | None, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    source = save_dir(case) if tag is None else save_dir(case) / tag
    report = convert(source, tmp_path / "model.safetensors")
    assert report.verified
    got = written(report)
    frozen = MANIFEST["cases"][case]["deepspeed"]
    expected = frozen["fp32_latest"] if tag is None else frozen["tags"][tag]["fp32"]
    assert sorted(got) == sorted(expected)
    for name, entry in expected.items():
        want = (f"torch.{entry['dtype']}", entry["shape"])
        assert (str(got[name].dtype), list(got[name].shape)) == want, name
        assert sha256(got[name]) == entry["sha256"], name
    live = get_fp32_state_dict_from_zero_checkpoint(str(save_dir(case)), tag=tag)
    assert list(live) == list(expected)  # the manifest's order is DeepSpeed's
    for name, tensor in live.items():
        assert as_bytes(tensor) == as_bytes(got[name]), name
    assert report.aliases == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("case", ["stage2_bf16_2proc", "stage3_fp32_2proc"])
def test_consolidated_view_keeps_deepspeeds_order_and_kinds(case: str) -> None:
    frozen = MANIFEST["cases"][case]["deepspeed"]["fp32_latest"]
    with open_zero_weights(save_dir(case)) as ckpt:
        weights: ZeroWeights = ckpt.details["zero"]
        assert list(ckpt.root) == list(frozen)
        assert weights.buffers == ["position_bias"]
        assert weights.frozen == ["frozen_scale"]
        assert weights.aliases == {"head.weight": "embed.weight"}
        assert weights.dp_world_size == 2 and weights.stage == int(case[5])
        # under bf16 DeepSpeed keeps the frozen parameter in its saved dtype, the rest fp32
        assert {name: r.dtype for name, r in ckpt.root.items()} == {
            name: entry["dtype"] for name, entry in frozen.items()
        }


def test_convert_casts_and_shards_like_convert_does(tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    case = "stage3_fp32_2proc"
    report = convert(save_dir(case), tmp_path / "out", dtype="bf16", max_shard_size=400)
    assert report.outputs[-1].name == "model.safetensors.index.json" and len(report.outputs) > 2
    got = written(report)
    for name, tensor in get_fp32_state_dict_from_zero_checkpoint(str(save_dir(case))).items():
        assert as_bytes(tensor.to(torch.bfloat16)) == as_bytes(got[name]), name


def test_the_door_opens_the_weights_view() -> None:
    """``open_checkpoint(path, view=...)`` is the one door: a ZeRO directory's weights view is
    its consolidated fp32 weights; without the view, or where there is none (ZeRO-0), the
    directory's merged tree."""
    from ckpttool.frameworks.base import WEIGHTS_VIEW, view_facts

    case = save_dir("stage2_fp32_2proc")
    with open_checkpoint(case, view=WEIGHTS_VIEW) as view, open_zero_weights(case) as direct:
        assert list(view.root) == list(direct.root)
        facts = view_facts(view)
        assert facts is not None and facts.layout == "deepspeed"
        assert facts.counters is not None and facts.counters["global_steps"] == 4
    with open_checkpoint(case) as merged:
        assert view_facts(merged) is None and merged.details["layout"] == "deepspeed"
    with open_checkpoint(save_dir("stage0_fp32_2proc"), view=WEIGHTS_VIEW) as stage0:
        assert view_facts(stage0) is None and stage0.details["layout"] == "deepspeed"


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths DeepSpeed's detection lists (each call of ``files._scan``), from now on."""
    from ckpttool.frameworks.deepspeed import files

    scans: list[str] = []
    original = files._scan

    def counted(path: str) -> Any:
        scans.append(path)
        return original(path)

    monkeypatch.setattr(files, "_scan", counted)
    return scans


def test_convert_and_diff_probe_a_deepspeed_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection happens once, in the door: the view is opened from what it found."""
    scans = _count_scans(monkeypatch)
    convert(save_dir("stage2_fp32_2proc"), tmp_path / "out.safetensors")
    assert scans == [str(save_dir("stage2_fp32_2proc"))]
    scans.clear()
    diff(save_dir("stage2_fp32_2proc"), save_dir("stage3_fp32_2proc"))
    assert scans == [str(save_dir("stage2_fp32_2proc")), str(save_dir("stage3_fp32_2proc"))]


def _moment_storages(path: Path) -> set[str]:
    """Storage keys of every Adam moment in one optimizer-state file."""
    keys = set()
    with open_checkpoint(path) as ckpt:
        for key, value in walk(ckpt.root):
            if isinstance(value, TensorRecord) and key.rsplit(".", 1)[-1] in (
                "exp_avg",
                "exp_avg_sq",
            ):
                assert value.storage is not None
                keys.add(value.storage.key)
    return keys


@pytest.mark.parametrize("case", ["stage2_fp32_2proc", "stage3_bf16_2proc", "stage1_fp32_1proc"])
def test_consolidation_reads_only_fp32_partitions_one_tensor_at_a_time(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[tuple[str, str, int, int]] = []
    original = Checkpoint.read_storage

    def recording(self: Checkpoint, storage: Any, start: int, stop: int, key: str = "") -> Any:
        reads.append((Path(self.name).name, storage.key, start, stop))
        return original(self, storage, start, stop, key)

    monkeypatch.setattr(Checkpoint, "read_storage", recording)
    report = convert(save_dir(case), tmp_path / "model.safetensors", verify=False)
    tag = save_dir(case) / MANIFEST["cases"][case]["deepspeed"]["latest"]
    optim_files = sorted(tag.glob("*_optim_states.pt"))
    assert optim_files
    for path in optim_files:
        moments = _moment_storages(path)
        assert moments
        touched = {key for name, key, _, _ in reads if name == path.name}
        assert touched and not touched & moments, path.name
    shapes = [r["shape"] for r in MANIFEST["cases"][case]["deepspeed"]["fp32_latest"].values()]
    largest = max(int(np.prod(shape)) * 4 for shape in shapes)
    file_reads = [stop - start for name, _, start, stop in reads if name.endswith(".pt")]
    assert max(file_reads) <= largest
    # every byte read once: the rank files' reads add up to the tensors written
    assert sum(file_reads) == report.tensor_bytes


@pytest.mark.parametrize(
    ("damaged", "names"),
    [
        ("optim_missing", "global_step4: the optimizer states record 2 data-parallel partitions"),
        ("optim_truncated", "zero_pp_rank_1_mp_rank_00_optim_states.pt: corrupt or truncated"),
        ("optim_empty", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt: the file is empty"),
        ("model_states_missing_z3", "global_step4: ZeRO-3 writes one model-states file per rank"),
        ("model_states_empty_z3", "zero_pp_rank_1_mp_rank_00_model_states.pt: the file is empty"),
        ("latest_dangling", "latest: names tag 'global_step9'"),
        ("latest_missing", "no 'latest' file (DeepSpeed writes it last"),
    ],
)
def test_damaged_checkpoint_is_one_line_error_and_nothing_written(
    damaged: str, names: str, tmp_path: Path
) -> None:
    source = FIXTURES / "damaged" / damaged / "checkpoints"
    target = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(source), str(target)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith("Error: ") and "\n" not in line and names in line, line
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_diff_two_tags_compares_weights_and_counters() -> None:
    """The fp32 view's weights, and the files as stored: the module's own copies, the
    optimizer states, the counters and client state (#49: the view is not all they hold)."""
    report = diff(save_dir("stage2_fp32_2proc") / "global_step2", save_dir("stage2_fp32_2proc"))
    fields = {entry.key: (entry.a, entry.b) for entry in report.fields}
    assert {
        "model_states.global_steps": (2, 4),
        "model_states.global_samples": (8, 16),
        "model_states.lr_scheduler.last_batch_iteration": (1, 3),
        "model_states.losses.3": (None, pytest.approx(2.5376148223876953)),
    }.items() <= fields.items()
    statuses = {entry.key: entry.status for entry in report.tensors}
    assert statuses["position_bias"] == statuses["frozen_scale"] == IDENTICAL
    assert statuses["embed.weight"] == statuses["fc1.weight"] == DIFFER
    assert statuses["model_states.module.fc1.weight"] == DIFFER
    assert statuses["model_states.module.frozen_scale"] == IDENTICAL
    assert not report.equal


def test_diff_tag_against_its_converted_weights(tmp_path: Path) -> None:
    source = save_dir("stage3_bf16_2proc")
    converted = convert(source, tmp_path / "model.safetensors").outputs[0]
    report = diff(source, converted)
    assert report.equal and not report.fields
    assert {entry.status for entry in report.tensors} == {IDENTICAL}
    # the tag's files hold more than the weights file's kind does: named, not compared
    assert any(
        note.startswith("not compared: A's files beyond its weights view") for note in report.notes
    ), report.notes
    result = CliRunner().invoke(cli, ["diff", str(source / "global_step2"), str(converted)])
    assert result.exit_code == 1  # another tag: the weights differ


def test_stage0_is_not_consolidated(tmp_path: Path) -> None:
    """ZeRO-0 keeps no fp32 partitions; DeepSpeed's zero_to_fp32 fails on it too."""
    assert "error" in MANIFEST["cases"]["stage0_fp32_2proc"]["deepspeed"]["fp32_latest"]
    with pytest.raises(CkptError):
        open_zero_weights(save_dir("stage0_fp32_2proc"))


@pytest.mark.parametrize("case", ["stage0_fp32_2proc", "stage0_bf16_1proc"])
def test_stage0_converts_the_modules_weights(tmp_path: Path, case: str) -> None:
    """ZeRO-0 has no partitions: convert takes the module's state dict from the model-states
    file (what ``engine.module.state_dict()`` saved), under the module's own names."""
    tag = save_dir(case) / (save_dir(case) / "latest").read_text().strip()
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    out = tmp_path / "model.safetensors"
    convert(save_dir(case), out)
    got = load_file(out)
    # the tied head is stored once: its values are the embedding's
    assert set(got) == set(module) - {"head.weight"}
    for name, tensor in got.items():
        assert tensor.dtype == module[name].dtype
        assert as_bytes(tensor) == as_bytes(module[name]), name
