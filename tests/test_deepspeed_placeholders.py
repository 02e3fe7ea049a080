"""A DeepSpeed ZeRO-3 rank's ``model_states.pt`` read alone (issue 49 item 2): its ``module``
holds a 0-element placeholder for every partitioned parameter, the real shapes in
``param_shapes``. ``convert`` wrote them as empty tensors and said "verified", exit 0;
``load_state_dict`` returned them; ``show`` said "(0 parameters)". Now no command writes,
returns or edits them as the weights (one line naming the folder whose files hold the values),
and ``show`` gives the real shapes. The fixtures are DeepSpeed's own saves
(tests/fixtures/deepspeed/README.md); DeepSpeed's ``param_shapes`` is the oracle of the shapes."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpttool
from ckpttool.cli import cli
from ckpttool.commands.edit import edit_file
from ckpttool.commands.show import build_report
from ckpttool.errors import InputError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
RANK_FILES = [
    FIXTURES / "stage3_fp32_1proc/checkpoints/global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt",
    FIXTURES / "stage3_bf16_2proc/checkpoints/global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt",
]  # fmt: skip
IDS = ["fp32_1proc_rank0", "bf16_2proc_rank1"]


def _real_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes DeepSpeed recorded (``param_shapes``, ``frozen_param_shapes``, tied
    aliases: ``shared_params``, which rank 0's file of the tag alone fills), by the
    placeholder's key: torch.load of DeepSpeed's own files is the oracle."""
    saved = torch.load(path, weights_only=False, map_location="cpu")
    rank_0 = path.with_name(re.sub(r"zero_pp_rank_\d+_", "zero_pp_rank_0_", path.name))
    shared = torch.load(rank_0, weights_only=False, map_location="cpu")["shared_params"]
    real = {k: tuple(v) for group in saved["param_shapes"] for k, v in group.items()}
    real.update({k: tuple(v) for k, v in (saved.get("frozen_param_shapes") or {}).items()})
    real.update({a: real[o] for a, o in shared.items()})
    module = saved["module"]
    assert all(module[name].numel() == 0 for name in real)  # ZeRO-3: placeholders, all of them
    return {f"module.{name}": shape for name, shape in real.items()}


@pytest.mark.parametrize("rank_file", RANK_FILES, ids=IDS)
def test_convert_refuses_in_one_line_naming_the_folder(tmp_path: Path, rank_file: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(rank_file), str(out)])
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and "Traceback" not in result.output
    assert f"{len(_real_shapes(rank_file))} tensor(s) hold 0 elements" in error[0]
    assert f"ckpttool convert {rank_file.parent} OUT" in error[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # the folder the message names converts: the real weights
    folder_out = tmp_path / "folder.safetensors"
    assert CliRunner().invoke(cli, ["convert", str(rank_file.parent), str(folder_out)]).exit_code == 0  # fmt: skip
    assert all(t.numel() > 0 for t in ckpttool.load_state_dict(folder_out, section=None).values())


@pytest.mark.parametrize("rank_file", RANK_FILES, ids=IDS)
def test_load_state_dict_and_get_tensor_refuse_placeholders(rank_file: Path) -> None:
    with pytest.raises(InputError, match=r"hold 0 elements standing for the real ones"):
        ckpttool.load_state_dict(rank_file)
    with ckpttool.open(rank_file) as handle:
        with pytest.raises(InputError, match="read its folder instead"):
            handle.get_tensor("module.fc1.weight")
        assert handle.get_tensor("module.position_bias").numel() == 6  # a buffer: stored whole


@pytest.mark.parametrize("rank_file", RANK_FILES, ids=IDS)
def test_show_gives_the_real_shapes_and_where_the_values_are(rank_file: Path) -> None:
    real = _real_shapes(rank_file)
    with ckpttool.open(rank_file) as handle:
        report = build_report(handle.checkpoint)
    notes = {info.record.key: info.notes for info in report.tensors}
    for key, shape in real.items():
        assert notes[key][0] == f"placeholder of {list(shape)}: 0 elements stored", key
    tied = {"module.head.weight"}  # shared_params: one storage with embed.weight
    stored = sum(
        info.record.numel for info in report.tensors
        if info.record.key.startswith("module.") and info.record.key not in real
    )  # fmt: skip
    expected = stored + sum(math.prod(s) for k, s in real.items() if k not in tied)
    assert report.num_parameters == expected > 0
    assert report.warnings[0].endswith(f"ckpttool show {rank_file.parent})")


def test_alone_the_message_says_the_partitions_are_not_beside_it(tmp_path: Path) -> None:
    alone = tmp_path / RANK_FILES[0].name
    shutil.copyfile(RANK_FILES[0], alone)
    with pytest.raises(InputError, match=r"tag folder, which are not beside it$"):
        ckpttool.load_state_dict(alone)


@pytest.mark.parametrize("operation", [{"dtype": "bf16"}, {"for_inference": True}])
def test_edit_refuses_to_make_weights_of_placeholders(tmp_path: Path, operation: dict) -> None:
    out = tmp_path / "edited.pt"
    with pytest.raises(InputError, match="read its folder instead"):
        edit_file(RANK_FILES[0], out, **operation)
    assert not out.exists()


def test_diff_refuses_placeholders_it_would_call_identical() -> None:
    """Two ranks' files hold the same placeholders: "identical" would be a quiet wrong answer."""
    rank_0 = RANK_FILES[1].with_name("zero_pp_rank_0_mp_rank_00_model_states.pt")
    result = CliRunner().invoke(cli, ["diff", str(rank_0), str(RANK_FILES[1])])
    assert result.exit_code == 2 and "read its folder instead" in result.output


@pytest.mark.parametrize(
    "rank_file",
    sorted(FIXTURES.glob("stage3_*/checkpoints/*/zero_pp_rank_*_model_states.pt")),
    ids=lambda p: str(p.relative_to(FIXTURES)),
)
def test_every_zero3_rank_file_is_refused_as_weights(rank_file: Path) -> None:
    with pytest.raises(InputError, match=f"{len(_real_shapes(rank_file))} tensor"):
        ckpttool.load_state_dict(rank_file)
