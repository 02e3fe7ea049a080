"""Every command on a torch.distributed.checkpoint directory (tests/fixtures/dcp/checkpoint)."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.formats.dcp.directory import METADATA, DcpFiles, load_metadata
from ckpttool.formats.dcp.metadata import BytesEntry
from ckpttool.model.records import ChunkedStorageRecord
from tests.support.dcp_cases import (
    DCP,
    DCP_PTH,
    DCP_SAFETENSORS,
    SPLIT_ROWS,
    copy_dcp,
    hostile_metadata,
    torch_reference,
)
from tests.support.helpers import flatten_loaded


def run(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return torch_reference(tmp_path_factory.mktemp("reference"))


SHOW_MODEL = """\
file:       {path}
format:     dcp  (157.9 KB on disk)
files:      __0_0.distcp 42.9 KB, __1_0.distcp 92.6 KB  (70 tensor chunks)
layout:     MiniMind-style resume checkpoint
tensors:    12 of 45  (filter 'model.*'; 856 parameters)
bytes:      float32 3.3 KB
epoch:      1
step:       1200
world_size: 2
optimizer:  AdamW, state for 11 params (float32 5.7 KB)
  group 0: lr=0.001, eps=1e-08, weight_decay=0.01, amsgrad=false, maximize=false, \
foreach=false, capturable=false, differentiable=false, decoupled_weight_decay=true, \
betas=[0.9, 0.999], num_params=11

key                                                   dtype    shape    numel    size    notes
----------------------------------------------------  -------  -------  -------  ------  ------------------------------------
model.model.embed_tokens.weight                       float32  [16, 8]  128      512 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.self_attn.q_proj.weight          float32  [8, 8]   64       256 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.self_attn.k_proj.weight          float32  [4, 8]   32       128 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.self_attn.v_proj.weight          float32  [4, 8]   32       128 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.self_attn.o_proj.weight          float32  [8, 8]   64       256 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.mlp.gate_proj.weight             float32  [16, 8]  128      512 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.mlp.down_proj.weight             float32  [8, 16]  128      512 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.mlp.up_proj.weight               float32  [16, 8]  128      512 B   2 chunks: __0_0.distcp, __1_0.distcp
model.lm_head.weight                                  float32  [16, 8]  128      512 B   2 chunks: __0_0.distcp, __1_0.distcp
model.model.layers.0.input_layernorm.weight           float32  [8]      8        32 B    1 chunk: __1_0.distcp
model.model.layers.0.post_attention_layernorm.weight  float32  [8]      8        32 B    1 chunk: __1_0.distcp
model.model.norm.weight                               float32  [8]      8        32 B    1 chunk: __1_0.distcp
"""


def test_show_lists_global_shapes_chunks_and_files() -> None:
    result = run("show", DCP, "--filter", "model.*")
    assert result.exit_code == 0, result.output
    assert result.output == SHOW_MODEL.format(path=DCP)


def test_show_json_gives_every_chunk(reference: dict[str, Any]) -> None:
    result = run("show", DCP, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["format"], report["layout"]) == ("dcp", "minimind_resume")
    assert report["details"]["files"] == {
        "__0_0.distcp": (DCP / "__0_0.distcp").stat().st_size,
        "__1_0.distcp": (DCP / "__1_0.distcp").stat().st_size,
    }
    expected = dict(flatten_loaded(reference))
    assert [t["key"] for t in report["tensors"]] == list(expected)
    for entry in report["tensors"]:
        value = expected[entry["key"]]
        assert entry["shape"] == list(value.shape) and entry["dtype"] == str(value.dtype)[6:]
        covered = sum(math.prod(chunk["sizes"]) for chunk in entry["chunks"])
        assert covered == value.numel(), entry["key"]
    split = next(t for t in report["tensors"] if t["key"] == SPLIT_ROWS)
    assert split["chunks"] == [
        {"file": "__0_0.distcp", "offsets": [0, 0], "sizes": [8, 8]},
        {"file": "__1_0.distcp", "offsets": [8, 0], "sizes": [8, 8]},
    ]
    assert (report["fields"]["step"], report["fields"]["epoch"]) == (1200, 1)


def test_show_stats_equal_torch(reference: dict[str, Any]) -> None:
    result = run("show", DCP, "--stats", "--json", "--section", "model")
    assert result.exit_code == 0, result.output
    for entry in json.loads(result.output)["tensors"]:
        value = reference["model"][entry["key"].removeprefix("model.")].double()
        stats = entry["stats"]
        assert (stats["min"], stats["max"]) == (value.min().item(), value.max().item())
        assert math.isclose(stats["mean"], value.mean().item(), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(stats["std"], value.std(unbiased=False).item(), rel_tol=1e-6)
        assert (stats["nan"], stats["inf"]) == (0, 0)


# --- diff ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("other", "summary"), [
    (DCP_PTH, "45 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B"),
    (DCP_SAFETENSORS, "12 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B"),
    (DCP, "45 identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B"),
])  # fmt: skip
def test_diff_against_the_same_state_in_one_file(other: Path, summary: str) -> None:
    result = run("diff", DCP, other)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == summary


def _modified(tmp_path: Path) -> Path:
    """A copy with one element of lm_head's second chunk and the step value changed in place."""
    directory = copy_dcp(tmp_path, "modified")
    with open_checkpoint(directory) as ckpt:
        storage = next(r for r in ckpt.tensors() if r.key == SPLIT_ROWS).storage
        assert isinstance(storage, ChunkedStorageRecord)
        sizes = {k: v for k, v in ckpt.details["files"].items() if v is not None}
    files = DcpFiles(directory, sizes)
    _, base = files.chunk_tensor(storage.chunks[1], storage)  # rows 8-15
    with open(directory / METADATA, "rb") as handle:
        _, meta = load_metadata(handle, refuse_dangerous=True)
    step = next(e for e in meta.entries if isinstance(e, BytesEntry) and e.fqn == "step").span
    files.close()
    assert step is not None and step.file == storage.chunks[1].file
    data = bytearray((directory / step.file).read_bytes())
    data[base + 4 * (8 * 3 + 5) : base + 4 * (8 * 3 + 6)] = struct.pack("<f", 0.5)  # [11, 5]
    end = step.offset + step.length
    old, new = b"\x80\x02M\xb0\x04.", b"\x80\x02M\x60\x09."  # data.pkl: 1200 -> 2400
    pickled = data.index(old, step.offset, end)
    data[pickled : pickled + len(new)] = new
    old_crc, new_crc = (struct.pack("<I", zlib.crc32(p)) for p in (old, new))
    assert data.count(old_crc, step.offset, end) == 2  # local header, central directory
    data[step.offset : end] = data[step.offset : end].replace(old_crc, new_crc)
    (directory / step.file).write_bytes(bytes(data))
    return directory


def test_diff_finds_a_changed_element_and_field(tmp_path: Path) -> None:
    result = run("diff", DCP, _modified(tmp_path), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert [f["key"] for f in report["fields"]] == ["step"]
    changed = [t for t in report["tensors"] if t["status"] != "identical"]
    assert [(t["key"], t["status"], t["values"]["mismatched"]) for t in changed] == [
        (SPLIT_ROWS, "differ", 1)
    ]


# --- convert ------------------------------------------------------------------------------------


def test_convert_to_safetensors_and_pth_equals_torch(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    from safetensors.torch import load_file

    expected = reference["model"]
    for name in ("model.safetensors", "model.pth"):
        out = tmp_path / name
        result = run("convert", DCP, out)
        assert result.exit_code == 0, result.output
        if name.endswith(".safetensors"):
            written = load_file(out)
        else:
            written = torch.load(out, weights_only=True)
        assert list(written) == list(expected)
        assert all(torch.equal(written[k], v) for k, v in expected.items())
        assert run("diff", DCP, out).exit_code == 0


# --- verify and scan ----------------------------------------------------------------------------


def test_verify_ok() -> None:
    result = run("verify", DCP)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{DCP}: OK (dcp)",
        "  checked: structure (dcp), 45 tensor extents",
        "  checked: data files: each present and as long as its items (2 files)",
        "  checked: 85 items: zip directory, CRC-32 of every record, chunk dtype/shape/extent",
    ]


def test_verify_finds_a_missing_data_file(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    (directory / "__0_0.distcp").unlink()
    result = run("verify", directory)
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if "problem:" in line]
    assert problems == [
        "  problem: data file __0_0.distcp is missing (it should hold 43,905 bytes)"
    ]


def test_verify_finds_a_truncated_data_file(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    with open(directory / "__1_0.distcp", "r+b") as handle:
        handle.truncate(50_000)
    result = run("verify", directory)
    assert result.exit_code == 1, result.output
    assert (
        "  problem: data file __1_0.distcp has 50,000 bytes but its items reach byte 94,808 "
        "(truncated: an interrupted copy or save?)"
    ) in result.output.splitlines()
    assert run("show", directory).exit_code == 2


def test_verify_finds_altered_bytes_by_crc(tmp_path: Path) -> None:
    directory = _modified(tmp_path)
    result = run("verify", directory)
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if "problem:" in line]
    assert problems == [
        f"  problem: {SPLIT_ROWS} (chunk at [8, 0]) in __1_0.distcp@38118+1833: archive/data/0: "
        "CRC-32 is cf5633e3, the archive says e7fba5c8 (the bytes were altered or damaged)"
    ]  # the changed step's archive got a matching CRC: only the tensor's bytes are caught


def test_scan_classes_a_dcp_directory_safe() -> None:
    for target in (DCP, DCP / METADATA, DCP.parent):
        result = run("scan", target)
        assert result.exit_code == 0, result.output
        assert result.output.startswith("clean: only safe data constructs referenced")


def test_hostile_metadata_runs_nothing_in_any_command(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    marker = tmp_path / "ran"
    hostile_metadata(directory, marker)
    for command, code in (("show", 2), ("diff", 2), ("convert", 2), ("verify", 1), ("scan", 1)):
        args = (directory, DCP) if command == "diff" else (directory,)
        if command == "convert":
            args = (directory, tmp_path / "out.safetensors")
        result = run(command, *args)
        assert result.exit_code == code, (command, result.output)
        if code == 2:
            assert "refusing to read: the pickle calls posix.system" in result.output, command
    assert not marker.exists()


def test_an_unfinished_save_and_rescale_step_say_what_is_wrong(tmp_path: Path) -> None:
    directory = copy_dcp(tmp_path)
    result = run("rescale-step", directory, "--world-size", "1", "--dry-run")
    assert result.exit_code == 2
    assert "a torch.distributed.checkpoint directory; rescale-step rewrites one" in result.output
    (directory / METADATA).unlink()
    result = run("show", directory)
    assert result.exit_code == 2
    assert "without its .metadata file (DCP writes it last" in result.output
