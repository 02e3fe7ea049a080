"""Directories of per-rank DTensor state dicts read as one checkpoint (frameworks/rank_set).

The sets are torch's own, under tests/fixtures/frameworks/rank_sets/ (``write_ranks.py``: FSDP2
with an uneven split and a 0-d buffer, tensor parallelism with ``Shard(1)`` and ``Replicate``, a
verl-style Llama with its ``huggingface/`` folder), each beside the full state dict the same run
gathered (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``): the oracle.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from safetensors import safe_open

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.convert.run import convert
from ckpttool.commands.diff.run import diff
from ckpttool.commands.scan import scan
from ckpttool.commands.show import show
from ckpttool.commands.verify import verify
from ckpttool.errors import CorruptCheckpointError, InputError
from ckpttool.frameworks.rank_set.assemble import placed
from ckpttool.model.records import DTensorInfo, TensorRecord
from tests.support.helpers import FIXTURES

SETS = FIXTURES / "frameworks/rank_sets"
SETS_2D = FIXTURES / "frameworks/rank_sets_2d"  # 4 ranks, a 2 x 2 mesh
NAMES = ("fsdp2", "tp", "verl", "fsdp1", "2d/hsdp", "2d/fsdp_tp")


def where(name: str) -> Path:
    return SETS_2D / name.removeprefix("2d/") if name.startswith("2d/") else SETS / name


def oracle(name: str) -> dict[str, torch.Tensor]:
    path = where(name)
    return torch.load(path.with_name(f"{path.name}_full_state_dict.pt"), weights_only=True)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_a_set_opens_as_its_global_state_dict(name: str) -> None:
    expected = oracle(name)
    with open_checkpoint(where(name)) as ckpt:
        records = {r.key: r for r in ckpt.tensors()}
        assert ckpt.details["layout"] == "rank_set"
    assert sorted(records) == sorted(expected)
    for key, tensor in expected.items():
        assert records[key].shape == tuple(tensor.shape), key
        assert records[key].dtype == str(tensor.dtype).removeprefix("torch."), key


def load_with_aliases(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, each alias ``convert`` recorded (a tied pair stored once)
    under its own name too."""
    written = st.load_file(path)
    with safe_open(path, "pt") as stored:
        aliases = json.loads((stored.metadata() or {}).get("ckpttool.aliases", "{}"))
    written.update({alias: written[target] for alias, target in aliases.items()})
    return written


@pytest.mark.parametrize("name", NAMES)
def test_convert_writes_the_oracle_bit_for_bit(name: str, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    convert(where(name), out)
    written = load_with_aliases(out)
    expected = oracle(name)
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert written[key].dtype == tensor.dtype and written[key].shape == tensor.shape, key
        assert as_bytes(written[key]) == as_bytes(tensor), key


def test_convert_of_a_verl_set_writes_a_model_directory_with_its_config(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    convert(SETS / "verl", str(out) + "/")
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (SETS / "verl/huggingface" / name).read_bytes()
    written = load_with_aliases(out / "model.safetensors")
    assert "lm_head.weight" not in st.load_file(out / "model.safetensors")  # tied, as HF stores
    for key, tensor in oracle("verl").items():
        assert as_bytes(written[key]) == as_bytes(tensor), key


@pytest.mark.parametrize("name", NAMES)
def test_diff_of_the_set_against_its_oracle_is_identical(name: str) -> None:
    path = where(name)
    report = diff(str(path), str(path.with_name(f"{path.name}_full_state_dict.pt")))
    assert report.equal


def test_show_gives_each_tensors_global_shape_and_split() -> None:
    report = show(SETS / "tp")
    assert report.layout == "rank_set"
    by_key = {info.record.key: info for info in report.tensors}
    assert by_key["down.weight"].record.shape == (4, 5)
    assert "Shard(dim=1) over mesh [2] (tp)" in " ".join(by_key["down.weight"].notes)
    assert "Replicate() over mesh [2] (tp)" in " ".join(by_key["down.bias"].notes)
    assert "plain tensor, the same on every rank" in " ".join(by_key["step"].notes)
    assert report.details["rank_set"]["ranks"] == 2


def test_show_of_the_uneven_set() -> None:
    report = show(SETS / "fsdp2")
    by_key = {info.record.key: info for info in report.tensors}
    assert by_key["proj.weight"].record.shape == (5, 4)
    assert by_key["scale"].record.shape == ()
    storage = by_key["proj.weight"].record.storage
    assert [(c.offsets, c.sizes) for c in storage.chunks] == [((0, 0), (3, 4)), ((3, 0), (2, 4))]


def test_show_of_a_2d_mesh_gives_both_placements() -> None:
    report = show(SETS_2D / "fsdp_tp")
    notes = {info.record.key: " ".join(info.notes) for info in report.tensors}
    assert (
        "(_StridedShard(dim=0, sf=2), Shard(dim=0)) over mesh [2, 2] (dp, tp)"
        in (notes["up.weight"])
    )
    assert "(Shard(dim=0), Shard(dim=1))" in notes["down.weight"]
    assert "(Shard(dim=0), Replicate())" in notes["down.bias"]
    hsdp = show(SETS_2D / "hsdp")
    by_key = {info.record.key: info.record for info in hsdp.tensors}
    files = [c.file for c in by_key["proj.weight"].storage.chunks]
    assert files == ["model_world_size_4_rank_0.pt", "model_world_size_4_rank_1.pt"]


def test_verify_compares_hsdp_replicas(tmp_path: Path) -> None:
    """Rank 2 holds the same rows as rank 0 (the other replica): a copy that differs is said."""
    import torch.distributed.tensor  # registers DTensor for weights_only loads

    shutil.copytree(SETS_2D / "hsdp", tmp_path / "set")
    rank2 = tmp_path / "set/model_world_size_4_rank_2.pt"
    state = torch.load(rank2, weights_only=True)
    state["proj.bias"]._local_tensor.add_(1)
    torch.save(state, rank2)
    (result,) = verify([tmp_path / "set"])
    assert any(
        "proj.bias: replicated, but model_world_size_4_rank_2.pt's copy differs from "
        "model_world_size_4_rank_0.pt's" in p
        for p in result.problems
    ), result.problems


@pytest.mark.parametrize("name", NAMES)
def test_verify_passes_a_whole_set(name: str) -> None:
    (result,) = verify([where(name)])
    assert result.ok, result.problems
    assert any("tile each global tensor" in line for line in result.checked)


def test_verify_names_a_missing_rank_file_and_other_commands_refuse(tmp_path: Path) -> None:
    shutil.copytree(SETS / "fsdp2", tmp_path / "set")
    (tmp_path / "set/model_world_size_2_rank_1.pt").unlink()
    (result,) = verify([tmp_path / "set"])
    assert not result.ok
    assert any("model_world_size_2_rank_1.pt is missing" in p for p in result.problems)
    with pytest.raises(CorruptCheckpointError, match=r"rank_1\.pt is missing"):
        convert(tmp_path / "set", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_verify_finds_pieces_that_do_not_tile(tmp_path: Path) -> None:
    """Rank 0's file saved again as rank 1's: both pieces claim the first rows."""
    shutil.copytree(SETS / "fsdp2", tmp_path / "set")
    rank0 = tmp_path / "set/model_world_size_2_rank_0.pt"
    shutil.copyfile(rank0, tmp_path / "set/model_world_size_2_rank_1.pt")
    (result,) = verify([tmp_path / "set"])
    assert not result.ok
    assert any("proj.weight: the pieces of" in p and "overlap" in p for p in result.problems)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        open_checkpoint(tmp_path / "set")


def test_verify_compares_replicated_tensors_across_ranks(tmp_path: Path) -> None:
    """Rank 1's 0-d buffer changed (the file saved again by torch): verify says it differs."""
    shutil.copytree(SETS / "fsdp2", tmp_path / "set")
    rank1 = tmp_path / "set/model_world_size_2_rank_1.pt"
    import torch.distributed.tensor  # registers DTensor for weights_only loads

    state = torch.load(rank1, weights_only=True)
    state["scale"] = torch.tensor(0.25)
    torch.save(state, rank1)
    (result,) = verify([tmp_path / "set"])
    assert any(
        "scale: replicated, but model_world_size_2_rank_1.pt's copy differs" in p
        for p in result.problems
    )


def test_one_rank_file_alone_is_refused_naming_the_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="give ckpttool the directory of all the rank files"):
        convert(SETS / "fsdp2/model_world_size_2_rank_0.pt", tmp_path / "out.safetensors")


def test_composer_names_are_a_set(tmp_path: Path) -> None:
    for rank in (0, 1):
        shutil.copyfile(
            SETS / f"fsdp2/model_world_size_2_rank_{rank}.pt", tmp_path / f"ep0-ba8-rank{rank}.pt"
        )
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.details["layout"] == "rank_set"
        assert ckpt.details["rank_files"] == "ep0-ba8-rank{R}.pt"
        assert {r.key: r.shape for r in ckpt.tensors()}["proj.weight"] == (5, 4)


def test_scan_classes_the_sharding_classes_as_data() -> None:
    report = scan([SETS / "tp", SETS / "fsdp2", SETS / "fsdp1"])
    assert report.clean, report
    assert len(report.files) == 6
    names = {g.qualname for f in report.files for g in f.globals}
    assert "torch.distributed.tensor.placement_types.Replicate" in names


# torch's own rule for where a rank's piece lies, against ckpttool's: 1-D and 2-D meshes,
# uneven and empty pieces, FSDP-over-TP's _StridedShard ("ss0/2": dim 0, split factor 2).
MESHES = [
    ((5, 4), (2,), ("s0",)),
    ((5, 4), (4,), ("s0",)),
    ((3,), (4,), ("s0",)),
    ((4, 7), (3,), ("s1",)),
    ((9, 6), (2, 2), ("r", "s0")),
    ((9, 6), (2, 3), ("s0", "s1")),
    ((9, 6), (2, 2), ("s0", "s0")),
    ((7, 5), (3, 2), ("s1", "r")),
    ((), (2,), ("r",)),
    ((8, 4), (2, 2), ("ss0/2", "s0")),
    ((11, 3), (2, 2), ("ss0/2", "s0")),
    ((5, 6), (2, 2), ("ss0/2", "s0")),
    ((7, 5), (3, 2), ("ss1/2", "s1")),
]


def torch_indices(
    shape: tuple[int, ...], mesh: tuple[int, ...], coordinate: list[int], placements: list[Any]
) -> list[list[int]]:
    """Each dimension's global indices on ``coordinate``: torch's own loop
    (``_compute_local_shape_and_global_offset``), keeping the whole index lists it tracks."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    local = list(shape)
    indices: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(placements):
        if not hasattr(placement, "dim"):
            continue
        dim = placement.dim
        size, offsets = _get_shard_size_and_offsets(
            local[dim], mesh[mesh_dim], coordinate[mesh_dim], placement,
            indices.get(dim), shape[dim], False,
        )  # fmt: skip
        local[dim] = size
        indices[dim] = offsets if size else torch.arange(0)
    return [
        indices[d].tolist() if d in indices else list(range(shape[d])) for d in range(len(shape))
    ]


def torch_placement(spec: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if spec == "r":
        return Replicate()
    if spec.startswith("ss"):
        dim, factor = spec[2:].split("/")
        return _StridedShard(int(dim), split_factor=int(factor))
    return Shard(int(spec[1]))


def kind_of(spec: str) -> tuple[Any, ...]:
    if spec == "r":
        return ("replicate",)
    if spec.startswith("ss"):
        dim, factor = spec[2:].split("/")
        return ("strided_shard", int(dim), int(factor))
    return ("shard", int(spec[1]))


@pytest.mark.parametrize(("shape", "mesh", "spec"), MESHES)
def test_pieces_lie_where_torch_puts_them(
    shape: tuple[int, ...], mesh: tuple[int, ...], spec: tuple[str, ...]
) -> None:
    from itertools import product

    placements = [torch_placement(s) for s in spec]
    kinds = tuple(kind_of(s) for s in spec)
    local = TensorRecord("", "float32", (), (), 0, None)
    for coordinate in product(*(range(n) for n in mesh)):
        expected = torch_indices(shape, mesh, list(coordinate), placements)
        info = DTensorInfo(local, (), mesh, None, coordinate, kinds)
        runs, _ = placed("t", shape, info)
        got = [[i for lo, hi in dim_runs for i in range(lo, hi)] for dim_runs in runs]
        assert got == expected, coordinate


def test_partial_and_unknown_placements_are_refused() -> None:
    local = TensorRecord("", "float32", (2,), (1,), 0, None)
    partial = DTensorInfo(local, (), (2,), None, (0,), (("partial", "sum"),))
    with pytest.raises(InputError, match=r"Partial.*ckpttool does not add them up"):
        placed("w", (2,), partial)
    unknown = DTensorInfo(local, (), (2,), None, (0,), (("unknown", "Shard2D"),))
    with pytest.raises(InputError, match="unknown placement Shard2D"):
        placed("w", (4,), unknown)


def torch_str(kind: tuple[Any, ...]) -> str:
    """A placement as torch's ``str`` writes it (``S(0)``, ``_S(0, 2)``, ``R``, ``P(sum)``)."""
    if kind[0] == "shard":
        return f"S({kind[1]})"
    if kind[0] == "strided_shard":
        return f"_S({kind[1]}, {kind[2]})"
    return "R" if kind[0] == "replicate" else f"P({kind[1]})"


def test_a_rank_file_records_mesh_coordinate_and_placements_as_torch_loads_them() -> None:
    """Against the manifest, which froze what torch's own loader sees in each rank file."""
    import json

    manifest = json.loads((FIXTURES / "frameworks/manifest.json").read_text())
    for case, folder in (("rank_sets", "tp"), ("rank_sets_2d", "fsdp_tp")):
        ranks = manifest["cases"][case]["framework"][folder]["ranks"]
        for name, expected in ranks.items():
            with open_checkpoint(FIXTURES / "frameworks" / case / folder / name) as ckpt:
                records = {r.key: r for r in ckpt.tensors()}
            for key, entry in expected.items():
                info = records[key].dtensor
                if "placements" not in entry:
                    assert info is None
                    continue
                assert info is not None
                assert [torch_str(k) for k in info.kinds] == entry["placements"], (name, key)
                assert list(info.coordinate or ()) == entry["coordinate"], (name, key)
                assert list(records[key].shape) == entry["global_shape"]
                assert list(info.local.shape) == entry["local"]["shape"]
                assert info.mesh_shape == ((2,) if case == "rank_sets" else (2, 2))
                assert info.mesh_dim_names == (("tp",) if case == "rank_sets" else ("dp", "tp"))
    with open_checkpoint(SETS_2D / "fsdp_tp/model_world_size_4_rank_3.pt") as ckpt:
        info = ckpt.root["up.weight"].dtensor
    assert info.kinds == (("strided_shard", 0, 2), ("shard", 0))
    assert info.global_stride == (4, 1)


_ST_GETATTR = (
    b"\x80\x02cbuiltins\ngetattr\nctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n"
)


def test_a_sharded_tensors_nested_class_is_resolved_by_name_and_nothing_else() -> None:
    """``getattr(ShardedTensor, 'ProcessGroupState')`` (how its state pickles the NamedTuple) is
    the data record of that name; any other attribute of the class stays dangerous."""
    from ckpttool.pickle.interpreter import load_pickle

    def verdicts(data: bytes) -> dict[str, Any]:
        found = load_pickle(data, refuse_dangerous=False).globals_seen
        return {f"{m}.{n}": str(v) for m, n, v in found}

    good = _ST_GETATTR + b"X\x11\x00\x00\x00ProcessGroupState\x86R)\x81."
    seen = verdicts(good)
    assert "dangerous" not in " ".join(seen.values()), seen
    assert "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState" in seen
    bad = _ST_GETATTR + b"X\x0c\x00\x00\x00__setstate__\x86R."
    assert "dangerous" in verdicts(bad)["builtins.getattr"].lower()


def test_fsdp1_sharded_tensors_are_read_with_their_offsets() -> None:
    """FSDP1's SHARDED_STATE_DICT: each ShardedTensor's one local shard and its offsets."""
    with open_checkpoint(SETS / "fsdp1/model_rank1.pt") as ckpt:
        record = ckpt.root["proj.weight"]
    assert record.shape == (5, 4) and record.storage is None
    info = record.dtensor
    assert info is not None and info.cls == "ShardedTensor"
    assert info.kinds == (("offsets", (3, 0)),) and info.local.shape == (2, 4)
    assert info.coordinate == (1,) and info.mesh_shape == (2,)
    report = show(SETS / "fsdp1")
    notes = {i.record.key: " ".join(i.notes) for i in report.tensors}
    assert "ShardedTensor, each rank's shard at its offsets, 2 chunks" in notes["proj.weight"]


def test_a_partial_dtensor_written_by_torch_is_refused_naming_it(tmp_path: Path) -> None:
    """``DTensor.from_local(..., [Partial()])`` saved by each rank: its pieces are addends, not
    pieces; every command refuses the set with one line, and writes nothing."""
    message = r"weight: a Partial\(sum\) placement .* ckpttool does not add them up"
    with pytest.raises(InputError, match=message):
        open_checkpoint(SETS / "partial")
    with pytest.raises(InputError, match=message):
        convert(SETS / "partial", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    (result,) = verify([SETS / "partial"])
    assert result.error is not None and "Partial(sum)" in result.error


@pytest.mark.parametrize("rank_set", [SETS / "verl", SETS / "fsdp2", SETS_2D / "hsdp"])
def test_rescale_of_a_rank_set_is_refused_saying_why(rank_set: Path) -> None:
    from ckpttool.commands.rescale.directory import rescale_directory
    from ckpttool.errors import LayoutError

    with pytest.raises(LayoutError) as refused:
        rescale_directory(rank_set, 4, dry_run=True)
    message = str(refused.value)
    assert "a set of per-rank state dicts" in message
    assert "count optimizer steps of the global batch" in message
    assert "convert the set" in message
