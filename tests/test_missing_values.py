"""Tensors a file holds no values of: DTensor shards (one rank's FSDP2 file) and meta tensors.

``show`` describes them; ``convert`` refuses to write fewer tensors than were selected unless
asked to leave them out (``skip_missing_values``). The FSDP2 files are the real ones under
tests/fixtures/frameworks/fsdp2_2proc/ (written by ``fully_shard`` under torchrun).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.convert.run import convert
from ckpttool.commands.show import show
from ckpttool.errors import EXIT_ERROR, InputError
from tests.support.helpers import FIXTURES

FSDP2 = FIXTURES / "frameworks/fsdp2_2proc"
RANK0 = FSDP2 / "model_world_size_2_rank_0.pt"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "frameworks/manifest.json").read_text())
RANK_FILES = MANIFEST["cases"]["fsdp2_2proc"]["files"]
SHARDS = ["embed.weight", "norm.weight", "norm.bias", "proj.weight", "proj.bias"]


@pytest.mark.parametrize("name", sorted(RANK_FILES))
def test_a_dtensor_record_knows_its_global_shape_piece_and_placements(name: str) -> None:
    expected = RANK_FILES[name]["tensors"]
    with open_checkpoint(FIXTURES / "frameworks" / name) as ckpt:
        records = {r.key: r for r in ckpt.tensors()}
    assert list(records) == list(expected)
    for key, entry in expected.items():
        record = records[key]
        assert (record.dtype, list(record.shape)) == (entry["dtype"], entry["shape"])
        if "dtensor" not in entry:
            assert record.dtensor is None and not record.is_meta
            continue
        assert record.is_meta and record.dtensor is not None
        assert list(record.dtensor.placements) == entry["dtensor"]["placements"]
        assert list(record.dtensor.local.shape) == entry["dtensor"]["local"]["shape"]
        assert record.dtensor.local.storage is not None  # the piece's bytes are in the file


def test_convert_refuses_dtensor_shards_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    with pytest.raises(InputError) as raised:
        convert(RANK0, out)
    message = str(raised.value)
    assert raised.value.exit_code == EXIT_ERROR
    assert message.startswith(f"{RANK0}: 5 of the 6 tensors selected have no values")
    assert "5 are DTensor shards" in message
    assert "'embed.weight': global [8, 4], DTensor Shard(dim=0), local [4, 4]" in message
    assert "one rank's piece" in message and "--skip-missing-values" in message
    assert list(tmp_path.iterdir()) == []


def test_skip_missing_values_writes_the_rest_and_says_what_was_left_out(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    report = convert(RANK0, out, skip_missing_values=True)
    assert list(st.load_file(out)) == ["positions"]
    assert report.tensors == 1
    (note,) = [n for n in report.notes if n.startswith("left out")]
    assert note.startswith(
        "left out 5 tensor(s) without values (--skip-missing-values): embed.weight, "
        "norm.weight, norm.bias, proj.weight, proj.bias; 5 are DTensor shards"
    )


def test_convert_refuses_meta_tensors_naming_the_cause(tmp_path: Path) -> None:
    source = tmp_path / "meta.pth"
    torch.save({"w": torch.empty(2, 3, device="meta"), "b": torch.ones(2)}, source)
    with pytest.raises(InputError, match=r"1 of the 2 tensors selected has no values") as raised:
        convert(source, tmp_path / "out.safetensors")
    assert "1 is a meta tensor saved without data (e.g. 'w'" in str(raised.value)
    assert not (tmp_path / "out.safetensors").exists()
    report = convert(source, tmp_path / "out.safetensors", skip_missing_values=True)
    assert list(st.load_file(report.outputs[0])) == ["b"]


def test_with_every_tensor_left_out_the_error_still_says_why(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no tensors to convert: left out 5 tensor"):
        convert(RANK0, tmp_path / "out.safetensors", pattern="*.*", skip_missing_values=True)


def test_show_describes_dtensor_shards() -> None:
    report = show(RANK0)
    notes = {info.record.key: info.notes for info in report.tensors}
    assert notes["embed.weight"] == ["DTensor Shard(dim=0), local [4, 4]"]
    assert notes["proj.weight"] == ["DTensor Shard(dim=0), local [3, 4]"]
    assert notes["positions"] == []
    (warning,) = [w for w in report.warnings if "DTensor" in w]
    assert warning.startswith("of the tensors listed, 5 are DTensor shards (FSDP2 or tensor")
    assert "this file holds one rank's piece of each" in warning


def test_show_json_gives_each_shards_piece() -> None:
    from ckpttool.render.show import render_json

    tensors = {t["key"]: t for t in render_json(show(RANK0))["tensors"]}
    assert tensors["proj.bias"]["dtensor"] == {
        "placements": ["Shard(dim=0)"],
        "local_shape": [3],
        "local_storage": "6",
        "mesh_shape": [2],
        "mesh_dim_names": None,
        "coordinate": [0],
    }
    assert "dtensor" not in tensors["positions"]
    assert tensors["proj.bias"]["shape"] == [5] and tensors["proj.bias"]["location"] == "cpu"


def test_stats_say_a_shard_has_no_values_of_its_own() -> None:
    report = show(RANK0, stats=True)
    unavailable = {i.record.key: i.stats_unavailable for i in report.tensors}
    assert unavailable["norm.bias"] == (
        "a DTensor shard: this file holds one rank's piece, not the tensor"
    )
    assert unavailable["positions"] is None


def test_verify_counts_each_shards_piece_as_stored() -> None:
    from ckpttool.commands.verify import verify

    (result,) = verify([RANK0])
    assert not result.problems
    # the five pieces are the DTensors' bytes; the one record left is the device mesh's rank map
    assert "note: 1 storage record no tensor uses" in result.checked


def test_a_hostile_dtensor_state_is_read_as_data_or_not_at_all() -> None:
    from ckpttool.model.records import OpaqueObject, StorageRecord, TensorRecord
    from ckpttool.pickle.emulation import _dtensor_info, _placement_name

    shard = "torch.distributed.tensor.placement_types.Shard"
    assert _placement_name(OpaqueObject(shard, (), {"dim": 10**5000})) == "Shard()"  # no str()
    assert _placement_name(OpaqueObject(shard, (), {"dim": 1, 2: "x"})) == "Shard(dim=1)"
    assert _placement_name(OpaqueObject(shard, (), ["not", "a", "dict"])) == "Shard()"
    storage = StorageRecord("0", "float32", 4, "cpu", "archive/data/0", 16)
    piece = TensorRecord("", "float32", (2,), (1,), 0, storage)
    spec = OpaqueObject("torch.distributed.tensor._dtensor_spec.DTensorSpec", (), {})
    for state in (None, 5, (None,), {"_local_tensor": "x"}, {"_spec": spec}):
        assert _dtensor_info(state) is None
    info = _dtensor_info((None, {"_local_tensor": piece, "_spec": spec}))
    assert info is not None and info.local is piece and info.placements == ()


def test_diff_compares_dtensor_pieces_rank_by_rank() -> None:
    """Each rank file holds its pieces: a file against itself is identical, rank 0 against
    rank 1 differs (other rows of the same tensors), a piece of another size is said."""
    from ckpttool.commands.diff.run import diff

    rank0, rank1 = (FSDP2 / f"model_world_size_2_rank_{r}.pt" for r in (0, 1))
    same = diff(str(rank0), str(rank0))
    assert same.equal
    other = diff(str(rank0), str(rank1))
    assert not other.equal
    notes = {t.key: t.changes for t in other.tensors}
    assert "local piece [3, 4] -> [2, 4]" in notes["proj.weight"]
