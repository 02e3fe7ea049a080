"""torch.distributed.checkpoint directories through the reader, against torch's own reading.

The fixture (tests/fixtures/dcp.py) was written by a real 2-process gloo group; the reference
is torch's ``dcp_to_torch_save``. Every tensor, every sub-range of it, every value must match.
"""

from __future__ import annotations

import io
import math
import os
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.scan import scan
from ckpttool.commands.verify import verify_file
from ckpttool.errors import CorruptCheckpointError, InputError, UnsafePickleError
from ckpttool.formats import base as base_format
from ckpttool.formats.dcp import directory as dcp_format
from ckpttool.formats.dcp import files as dcp_files
from ckpttool.formats.dcp.metadata import set_element
from ckpttool.io.values import read_tensor, tensor_stats
from ckpttool.model.records import ChunkedStorageRecord, TensorRecord, get_path
from tests.support.dcp_cases import (
    DCP,
    DCP_PTH,
    SPLIT_COLUMNS,
    SPLIT_ROWS,
    RunsCommand,
    copy_dcp,
    hostile_metadata,
    rewrite_metadata,
    torch_reference,
)
from tests.support.helpers import flatten_loaded


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return torch_reference(tmp_path_factory.mktemp("reference"))


@pytest.fixture
def ckpt() -> Any:
    with open_checkpoint(DCP) as opened:
        yield opened


def tensor(ckpt: Checkpoint, key: str) -> TensorRecord:
    return next(record for record in ckpt.tensors() if record.key == key)


def test_fixture_is_a_two_rank_checkpoint_with_tensors_split_across_files(ckpt: Checkpoint) -> None:
    assert sorted(p.name for p in DCP.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert ckpt.format == "dcp"
    assert ckpt.details["files"] == {
        name: (DCP / name).stat().st_size for name in ("__0_0.distcp", "__1_0.distcp")
    }
    assert ckpt.file_size == sum(p.stat().st_size for p in DCP.iterdir())
    rows = tensor(ckpt, SPLIT_ROWS).storage
    assert isinstance(rows, ChunkedStorageRecord)
    assert [(c.file, c.offsets, c.sizes) for c in rows.chunks] == [
        ("__0_0.distcp", (0, 0), (8, 8)), ("__1_0.distcp", (8, 0), (8, 8)),
    ]  # fmt: skip
    columns = tensor(ckpt, SPLIT_COLUMNS).storage
    assert isinstance(columns, ChunkedStorageRecord)
    assert [(c.offsets, c.sizes) for c in columns.chunks] == [((0, 0), (8, 8)), ((0, 8), (8, 8))]


def test_tensors_match_dcp_to_torch_save(ckpt: Checkpoint, reference: dict[str, Any]) -> None:
    expected = list(flatten_loaded(reference))
    records = ckpt.tensors()
    assert [r.key for r in records] == [key for key, _ in expected]
    for record, (key, value) in zip(records, expected):
        assert (record.dtype, record.shape) == (str(value.dtype)[6:], tuple(value.shape)), key
        assert record.is_contiguous and record.storage_offset == 0
        assert torch.equal(read_tensor(ckpt, record), value), key


def test_values_and_nesting_match_dcp_to_torch_save(
    ckpt: Checkpoint, reference: dict[str, Any]
) -> None:
    root = ckpt.root
    assert list(root) == list(reference) == ["model", "optimizer", "epoch", "step", "world_size"]
    assert (root["epoch"], root["step"], root["world_size"]) == (1, 1200, 2)
    # FQNs with dots stay one key (planner_data), list indices become lists
    assert list(root["model"]) == list(reference["model"])
    groups = root["optimizer"]["param_groups"]
    assert isinstance(groups, list) and len(groups) == 1
    assert groups[0] == reference["optimizer"]["param_groups"][0]
    assert list(root["optimizer"]["state"]) == list(reference["optimizer"]["state"])


@pytest.mark.parametrize("key", [SPLIT_ROWS, SPLIT_COLUMNS, "model.model.norm.weight",
                                 "optimizer.state.model.norm.weight.step"])  # fmt: skip
def test_any_range_of_a_tensor_assembles_from_its_chunks(
    ckpt: Checkpoint, reference: dict[str, Any], key: str
) -> None:
    record = tensor(ckpt, key)
    flat = dict(flatten_loaded(reference))[key].reshape(-1).numpy().view(np.uint8)
    draw = random.Random(key)
    ranges = [(0, record.numel), (0, 1), (record.numel - 1, 1)] + [
        (start, draw.randint(1, record.numel - start))
        for start in (draw.randrange(record.numel) for _ in range(20))
    ]
    for start, count in ranges:
        run = replace(record, shape=(count,), stride=(1,), storage_offset=start)
        data, first = ckpt.read_bytes(run)
        size = record.itemsize
        got = bytes(data)[first * size : (first + count) * size]
        assert got == flat[start * size : (start + count) * size].tobytes(), (start, count)


def test_reading_rows_touches_only_the_chunks_that_hold_them(
    ckpt: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    read: list[int] = []
    original_fd, original_pread = dcp_format.DcpFiles.fd, dcp_format.DcpFiles.pread

    def fd(self: dcp_format.DcpFiles, name: str) -> int:
        opened.append(name)
        return original_fd(self, name)

    def pread(self: dcp_format.DcpFiles, name: str, offset: int, length: int) -> bytearray:
        read.append(length)
        return original_pread(self, name, offset, length)

    monkeypatch.setattr(dcp_format.DcpFiles, "fd", fd)
    monkeypatch.setattr(dcp_format.DcpFiles, "pread", pread)
    record = tensor(ckpt, SPLIT_ROWS)  # 16 x 8 float32, rows 8-15 in __1_0.distcp
    ckpt.read_bytes(replace(record, shape=(2, 8), storage_offset=12 * 8))
    assert set(opened) == {"__1_0.distcp"}
    assert read == [2 * 8 * 4]  # the two rows' bytes, nothing else
    opened.clear()
    ckpt.read_bytes(replace(record, shape=(3,), stride=(1,), storage_offset=8 * 3))
    assert set(opened) == {"__0_0.distcp"}


def test_stats_equal_torch(ckpt: Checkpoint, reference: dict[str, Any]) -> None:
    for key, value in flatten_loaded(reference):
        if not value.is_floating_point() or value.numel() < 2:
            continue
        stats = tensor_stats(ckpt, tensor(ckpt, key))
        exact = value.double()
        assert (stats.min, stats.max) == (exact.min().item(), exact.max().item()), key
        assert math.isclose(stats.mean, exact.mean().item(), rel_tol=1e-9, abs_tol=1e-12), key
        std = exact.std(unbiased=False).item()
        assert math.isclose(stats.std, std, rel_tol=1e-6, abs_tol=1e-9), key


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open fds through /proc")
def test_data_files_are_bounded_and_closed(
    reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dcp_files, "MAX_OPEN_FILES", 1)  # every switch of file evicts one
    before = _open_fds()
    with open_checkpoint(DCP) as ckpt:
        for key, value in flatten_loaded(reference):
            assert torch.equal(read_tensor(ckpt, tensor(ckpt, key)), value)
            assert _open_fds() <= before + 2  # .metadata and one data file
    assert _open_fds() == before


def test_reads_go_on_after_short_preads(
    ckpt: Checkpoint, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pread moves at most 2 GiB on Linux: reads loop (here every pread gives 5 bytes)."""
    original = os.preadv

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        return original(fd, [memoryview(buffers[0])[:5]], offset)

    monkeypatch.setattr(base_format.os, "preadv", short)
    for key, value in flatten_loaded(reference):
        assert torch.equal(read_tensor(ckpt, tensor(ckpt, key)), value), key
    with open_checkpoint(DCP_PTH) as single:  # the single-file path reads through it too
        record = single.tensors()[0]
        assert torch.equal(read_tensor(single, record), reference["model"][record.key[6:]])


def test_set_element_builds_what_torch_builds() -> None:
    from torch.distributed.checkpoint._traverse import set_element as torch_set_element

    paths = [("a", "b.c"), ("a", "d", 1, "x"), ("a", "d", 0), ("top",), ("a", "d", 1, "y")]
    ours: dict[Any, Any] = {}
    theirs: dict[Any, Any] = {}
    for index, path in enumerate(paths):
        set_element(ours, path, index, str(path))
        torch_set_element(theirs, path, index)
    assert ours == theirs == {"a": {"b.c": 0, "d": [2, {"x": 1, "y": 4}]}, "top": 3}
    with pytest.raises(CorruptCheckpointError, match="inside another entry"):
        set_element(ours, ("top", "x"), 5, "top.x")


# --- damage: strict opening refuses, non-strict lists the problem ------------------------------


def _problems(directory: Path) -> list[str]:
    with open_checkpoint(directory, strict=False) as ckpt:
        return ckpt.problems


def test_missing_data_file(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    (directory / "__1_0.distcp").unlink()
    message = "data file __1_0.distcp is missing"
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        open_checkpoint(directory)
    assert len(_problems(directory)) == 1 and message in _problems(directory)[0]
    with (
        open_checkpoint(directory, strict=False) as ckpt,
        pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp is missing"),
    ):
        ckpt.read_bytes(tensor(ckpt, SPLIT_ROWS))


@pytest.mark.parametrize(("change", "message"), [
    (-100, r"has 94,708 bytes but its items reach byte 94,808 \(truncated"),
    (+3, "has 3 bytes after its last item"),
])  # fmt: skip
def test_data_file_of_the_wrong_size(tmp_path: Path, change: int, message: str) -> None:
    directory = copy_dcp(tmp_path)
    path = directory / "__1_0.distcp"
    os.truncate(path, path.stat().st_size + change)
    with pytest.raises(CorruptCheckpointError, match=message):
        open_checkpoint(directory)


def test_a_directory_without_metadata_is_an_unfinished_save(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    (directory / ".metadata").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"without its \.metadata file"):
        open_checkpoint(directory)
    with pytest.raises(InputError, match="is a directory"):
        open_checkpoint(tmp_path / "..")


def _drop_second_chunk(metadata: Any) -> None:
    metadata.state_dict_metadata[SPLIT_ROWS].chunks.pop()


def _overlap_chunks(metadata: Any) -> None:
    chunks = metadata.state_dict_metadata[SPLIT_ROWS].chunks
    chunks[1] = replace(chunks[1], offsets=torch.Size([4, 0]), sizes=torch.Size([12, 8]))


def _escape_directory(metadata: Any) -> None:
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"


def _huge_size(metadata: Any) -> None:
    metadata.state_dict_metadata[SPLIT_ROWS].size = torch.Size([2**62, 8])


def _conflicting_paths(metadata: Any) -> None:
    metadata.planner_data["step"] = ("model", "lm_head.weight", "x")


@pytest.mark.parametrize(("change", "message"), [
    (_drop_second_chunk, "its chunks hold 64 of its 128 elements"),
    (_overlap_chunks, r"chunks at \[0, 0\] and \[4, 0\] overlap"),
    (_escape_directory, "DCP names files inside its directory"),
    (_huge_size, "more elements than torch can count"),
    (_conflicting_paths, "inside another entry"),
])  # fmt: skip
def test_tampered_metadata_is_refused(tmp_path: Path, change: Any, message: str) -> None:
    directory = copy_dcp(tmp_path)
    rewrite_metadata(directory, change)
    with pytest.raises(CorruptCheckpointError, match=message):
        open_checkpoint(directory)


# --- hostile pickles: refused, nothing runs ------------------------------------------------------


def test_hostile_metadata_is_refused_without_running(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    marker = tmp_path / "ran"
    hostile_metadata(directory, marker)
    with pytest.raises(UnsafePickleError, match=r"calls posix\.system"):
        open_checkpoint(directory)
    report = scan([directory])
    assert report.found and ("posix.system", "dangerous") in {
        (g.qualname, g.verdict) for f in report.files for g in f.globals
    }
    assert not marker.exists()


def test_hostile_value_in_a_data_file_is_refused_without_running(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    directory = tmp_path / "hostile"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns it is not distributed
        dcp.save(
            {"w": torch.ones(2), "evil": RunsCommand(f"touch {marker}")}, checkpoint_id=directory
        )
    with pytest.raises(UnsafePickleError, match=r"calls posix\.system"):
        open_checkpoint(directory)
    [found] = scan([directory]).files
    assert ("posix.system", "dangerous") in {(g.qualname, g.verdict) for g in found.globals}
    problems = verify_file(directory).problems
    assert (
        "the data files' pickles call posix.system: never load it with torch.load "
        "(see `ckpttool scan`)"
    ) in problems
    assert not marker.exists()


def test_single_process_save_of_many_kinds(tmp_path: Path) -> None:
    """bf16, int, bool, 0-dim, empty, a view, lists, tuples, a BytesIO: as dcp_to_torch_save.

    A single process (no process group): DCP saves every tensor as one chunk.
    """
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = {
        "w": {"bf16": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
              "int": torch.arange(5), "bool": torch.tensor([True, False]),
              "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)},
        "list": [torch.ones(2), {"x": 1}], "tuple": (1, "two"), "view": torch.arange(10.0)[2:5],
        "blob": io.BytesIO(b"opaque bytes"),
        "pair": (torch.arange(3.0), 3),  # not traversed by DCP: a value holding a tensor
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "many")
        dcp_to_torch_save(tmp_path / "many", tmp_path / "many.pth")
    expected = torch.load(tmp_path / "many.pth", weights_only=False)
    with open_checkpoint(tmp_path / "many") as ckpt:
        pairs = list(flatten_loaded(expected))
        assert [r.key for r in ckpt.tensors()] == [key for key, _ in pairs]
        for record, (key, value) in zip(ckpt.tensors(), pairs):
            assert torch.equal(read_tensor(ckpt, record), value), key
        assert get_path(ckpt.root, "list.1.x") == 1 and ckpt.root["tuple"] == (1, "two")
        assert ckpt.root["blob"].state[0] == b"opaque bytes"  # a BytesIO, never imported
        assert get_path(ckpt.root, "pair.0").inline_data is not None  # bytes from the value
