"""``repair_file`` on single files (issue 27): a torch.save archive cut at every record boundary
and a byte either side, a torn storage, a lost ``data.pkl``; a safetensors file cut inside and
after its last tensors. Each output is checked against ``torch.load`` of the undamaged file."""

from __future__ import annotations

import json
import os
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.repair import RepairReport, repair_file
from ckpttool.commands.verify import verify
from ckpttool.errors import (
    CkptError,
    InputError,
    NotACheckpointError,
    OutputExistsError,
    ReadBackError,
    UnrecoverableError,
)
from ckpttool.formats import registry
from tests.support.helpers import FIXTURES

RESUME = FIXTURES / "minimind" / "pretrain_32_resume.pth"
STATE_DICT = FIXTURES / "ckpttool" / "pretrain_32.pth"
SAFETENSORS = FIXTURES / "safetensors" / "model.safetensors"


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a loaded tree by dotted key (tensors and plain values)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(node, (list, tuple)):
        out = {}
        for i, value in enumerate(node):
            out.update(_leaves(value, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: node}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    )


def _record_ends(path: Path) -> dict[str, tuple[int, int]]:
    """Each record's (start, end) in the undamaged archive, its data descriptor included:
    from the central directory, one record ending where the next begins."""
    with zipfile.ZipFile(path) as archive:
        infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
        starts = [info.header_offset for info in infos]
        ends = [*starts[1:], archive.start_dir]
    return {info.filename: (start, end) for info, start, end in zip(infos, starts, ends)}


def _storage_keys(path: Path) -> dict[str, str]:
    """tensor key -> storage record name, from the undamaged file."""
    with open_checkpoint(path) as ckpt:
        return {r.key: r.storage.record for r in ckpt.tensors() if r.storage is not None}


def _cut(src: Path, tmp_path: Path, length: int, name: str | None = None) -> Path:
    out = tmp_path / (name or f"cut{length}{src.suffix}")
    out.write_bytes(src.read_bytes()[:length])
    return out


def _check_output(report: RepairReport, original: Path, lost: set[str]) -> None:
    """The repaired file: lost keys exactly ``lost``; every other tensor (but those left out
    with a lost one in an optimizer entry) and every plain value as in the original."""
    assert {t.key for t in report.lost} == lost
    for key in report.dropped:  # only with a lost tensor of the same optimizer entry
        entry = key.rsplit(".", 1)[0]
        assert key.startswith("optimizer.state.") and any(
            k.startswith(entry + ".") for k in lost
        ), key
    loaded = (
        _leaves(torch.load(report.output, weights_only=True))
        if original.suffix != ".safetensors"
        else _safetensors(Path(report.output))
    )
    source = (
        _leaves(torch.load(original, weights_only=True))
        if original.suffix != ".safetensors"
        else _safetensors(original)
    )
    expected = {k for k, v in source.items() if isinstance(v, torch.Tensor)}
    expected -= lost | set(report.dropped)
    got = {k for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    assert got == expected
    assert report.recovered == len(got)
    for key, value in loaded.items():
        if isinstance(value, torch.Tensor):
            assert _same_bits(value, source[key]), key
        else:
            assert value == source[key], key
    # every plain value is kept, unless it sat in a dropped optimizer entry
    for key, value in source.items():
        if not isinstance(value, torch.Tensor) and not key.startswith("optimizer.state."):
            assert key in loaded, key
    (result,) = verify([report.output])
    assert result.ok, (result.problems, result.error)


def _safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(path))


def _cuts(ends: dict[str, tuple[int, int]], size: int) -> list[int]:
    points = {end for _, end in ends.values()} | {start for start, _ in ends.values()}
    return sorted({p + d for p in points for d in (-1, 0, 1) if 0 < p + d < size})


@pytest.mark.parametrize("fixture", [RESUME, STATE_DICT], ids=["resume", "state_dict"])
def test_a_torch_archive_cut_at_every_record_boundary(fixture: Path, tmp_path: Path) -> None:
    ends = _record_ends(fixture)
    records = _storage_keys(fixture)
    pkl_end = next(end for name, (_, end) in ends.items() if name.endswith("/data.pkl"))
    size = fixture.stat().st_size
    for length in _cuts(ends, size):
        src = _cut(fixture, tmp_path, length, f"cut{fixture.suffix}")
        before = src.read_bytes()
        out = tmp_path / f"out{length}.pth"
        if length < 4:  # not even a zip's signature: no format recognises it
            with pytest.raises(NotACheckpointError, match="recover"):
                repair_file(src, out)
            assert not out.exists()
        elif length < pkl_end:
            with pytest.raises(UnrecoverableError, match=r"data\.pkl is lost"):
                repair_file(src, out)
            assert not out.exists()
        else:
            report = repair_file(src, out)
            assert report.written and report.format == "torch-zip"
            assert report.damage  # every cut is damage: the central directory is gone
            lost = {key for key, record in records.items() if ends[record][1] > length}
            _check_output(report, fixture, lost)
            out.unlink()
        assert src.read_bytes() == before


def test_an_intact_file_is_not_written(tmp_path: Path) -> None:
    out = tmp_path / "out.pth"
    for fixture in (RESUME, STATE_DICT, SAFETENSORS):
        report = repair_file(fixture, out)
        assert not report.damaged and report.damage == () and report.lost == ()
        assert report.dropped == () and report.filled == ()
        assert report.output is None and not report.written
        assert report.recovered == len(_storage_keys(fixture))
    assert list(tmp_path.iterdir()) == []


def test_a_flipped_byte_in_one_storage_loses_that_tensor_alone(tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.q_proj.weight"
    record = _storage_keys(STATE_DICT)[key]
    start, end = _record_ends(STATE_DICT)[record]
    data = bytearray(STATE_DICT.read_bytes())
    data[(start + end) // 2 + 40] ^= 0x10  # inside its bytes (past the 64-byte aligned header)
    src = tmp_path / "torn.pth"
    src.write_bytes(bytes(data))
    report = repair_file(src, tmp_path / "out.pth")
    assert any("CRC-32" in line and record in line for line in report.damage)
    _check_output(report, STATE_DICT, {key})
    assert src.read_bytes() == bytes(data)


def test_a_torn_optimizer_storage_drops_its_whole_entry(tmp_path: Path) -> None:
    key = "optimizer.state.3.exp_avg"
    record = _storage_keys(RESUME)[key]
    end = _record_ends(RESUME)[record][1]
    data = bytearray(RESUME.read_bytes())
    data[end - 20] ^= 0x01  # the last bytes of its data, before the 16-byte descriptor
    src = tmp_path / "torn.pth"
    src.write_bytes(bytes(data))
    report = repair_file(src, tmp_path / "out.pth")
    assert set(report.dropped) == {"optimizer.state.3.step", "optimizer.state.3.exp_avg_sq"}
    _check_output(report, RESUME, {key})
    assert 3 not in torch.load(report.output, weights_only=True)["optimizer"]["state"]


def test_a_lost_data_pkl_is_a_clear_error_and_nothing_is_written(tmp_path: Path) -> None:
    src = _cut(RESUME, tmp_path, 3000)
    with pytest.raises(UnrecoverableError, match=r"cut3000\.pth: data\.pkl is lost") as caught:
        repair_file(src)
    assert caught.value.intact == []
    assert str(caught.value).endswith("no storage record is intact")
    assert not (tmp_path / "cut3000.repaired.pth").exists()
    assert src.read_bytes() == RESUME.read_bytes()[:3000]


def test_a_torn_data_pkl_lists_the_intact_storages(tmp_path: Path) -> None:
    data = bytearray(RESUME.read_bytes())
    data[500] ^= 0xFF  # inside data.pkl
    src = tmp_path / "torn.pth"
    src.write_bytes(bytes(data))
    with pytest.raises(UnrecoverableError, match=r"data\.pkl is torn") as caught:
        repair_file(src, dry_run=True)
    with zipfile.ZipFile(RESUME) as archive:
        stored = [i for i in archive.infolist() if "/data/" in i.filename]
    assert caught.value.intact == [info.filename for info in stored]
    first = ", ".join(f"{i.filename} ({i.file_size:,} bytes)" for i in stored[:3])
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    assert message.endswith(
        f"{len(stored)} storage records are intact: {first} and {len(stored) - 3} more"
    )
    assert not (tmp_path / "torn.repaired.pth").exists()


def test_dry_run_writes_nothing_and_the_default_output_is_beside_the_source(
    tmp_path: Path,
) -> None:
    src = _cut(STATE_DICT, tmp_path, STATE_DICT.stat().st_size - 200)
    report = repair_file(src, dry_run=True)
    assert not report.written and report.damage and report.lost == ()
    assert report.output == str(tmp_path / f"{src.stem}.repaired.pth")
    assert not Path(report.output).exists()
    report = repair_file(src)
    assert Path(report.output).exists() and report.written


def _safetensors_extents(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return 8 + n, {name: tuple(info["data_offsets"]) for name, info in header.items()}


def test_a_safetensors_file_cut_at_every_tensor_boundary_and_inside(tmp_path: Path) -> None:
    data_start, extents = _safetensors_extents(SAFETENSORS)
    last = sorted(extents.items(), key=lambda item: item[1])
    size = SAFETENSORS.stat().st_size
    cuts = {data_start + p + d for _, (b, e) in last for p in (b, e) for d in (-1, 0, 1)}
    cuts |= {data_start + (b + e) // 2 for _, (b, e) in last}
    for length in sorted(c for c in cuts if c < size):
        src = _cut(SAFETENSORS, tmp_path, length, "cut.safetensors")
        if length < data_start:  # the header itself is cut: nothing to rebuild from
            with pytest.raises(CkptError, match="header"):
                repair_file(src, tmp_path / f"out{length}.safetensors")
            assert not (tmp_path / f"out{length}.safetensors").exists()
            continue
        report = repair_file(src, tmp_path / f"out{length}.safetensors")
        lost = {name for name, (_, end) in extents.items() if data_start + end > length}
        assert report.format == "safetensors" and report.damage
        _check_output(report, SAFETENSORS, lost)
        assert src.read_bytes() == SAFETENSORS.read_bytes()[:length]


def test_a_safetensors_file_with_trailing_bytes_keeps_every_tensor(tmp_path: Path) -> None:
    src = tmp_path / "trailing.safetensors"
    src.write_bytes(SAFETENSORS.read_bytes() + b"\0" * 100)
    report = repair_file(src, tmp_path / "out.safetensors")
    assert any("trailing" in line for line in report.damage)
    _check_output(report, SAFETENSORS, set())
    assert Path(report.output).stat().st_size == SAFETENSORS.stat().st_size


def test_recover_is_reached_through_the_registry() -> None:
    assert registry.format_by_id("torch-tar").recover(None, 0) is None  # type: ignore[arg-type]
    with open(RESUME, "rb") as handle:
        found = registry.recover_file(handle, RESUME.stat().st_size)
    assert found is not None and found.format == "torch-zip" and found.damage == []


def test_an_output_that_does_not_read_back_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from ckpttool.formats.torch_zip import zip_writer

    copy_range = zip_writer.copy_range

    def copy_flipped(source: int, offset: int, dest: int, at: int, size: int, *rest: Any) -> None:
        """Each storage copied, then its first byte flipped in the output."""
        copy_range(source, offset, dest, at, size, *rest)
        if size:
            os.pwrite(dest, bytes([os.pread(source, 1, offset)[0] ^ 1]), at)

    monkeypatch.setattr(zip_writer, "copy_range", copy_flipped)
    src = _cut(STATE_DICT, tmp_path, STATE_DICT.stat().st_size - 200)
    with pytest.raises(ReadBackError, match="does not read back as salvaged"):
        repair_file(src, tmp_path / "out.pth")
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_the_source_is_never_the_output_and_an_output_is_not_overwritten(tmp_path: Path) -> None:
    src = _cut(STATE_DICT, tmp_path, STATE_DICT.stat().st_size - 200)
    before = src.read_bytes()
    with pytest.raises(InputError, match="is the source"):
        repair_file(src, src)
    (tmp_path / "taken.pth").write_bytes(b"x")
    with pytest.raises(OutputExistsError):
        repair_file(src, tmp_path / "taken.pth")
    assert (tmp_path / "taken.pth").read_bytes() == b"x"
    repair_file(src, tmp_path / "taken.pth", overwrite=True)
    assert src.read_bytes() == before


def test_a_format_without_recovery_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "old.tar"
    with tarfile.open(src, "w") as tar:  # torch's tar format: recognised, never recovered
        tar.add(RESUME, arcname="tensors")
    with pytest.raises(NotACheckpointError, match=r"old\.tar: not a file ckpttool can recover"):
        repair_file(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.tar"]


def test_an_archive_without_data_descriptors_is_walked_by_its_local_headers(
    tmp_path: Path,
) -> None:
    # ckpttool's own writer puts each record's CRC-32 and size in its local header (a file cut
    # inside its central directory keeps every record, written out again by that writer)
    cut = _cut(STATE_DICT, tmp_path, STATE_DICT.stat().st_size - 30, "tail.pth")
    whole = repair_file(cut, tmp_path / "whole.pth").output
    assert whole is not None
    original = Path(whole)
    with zipfile.ZipFile(original) as archive:
        assert not any(info.flag_bits & 0x8 for info in archive.infolist())
    ends = _record_ends(original)
    records = _storage_keys(original)
    pkl_end = next(end for name, (_, end) in ends.items() if name.endswith("/data.pkl"))
    for length in _cuts(ends, original.stat().st_size):
        if length < pkl_end:
            continue
        src = _cut(original, tmp_path, length, "cut.pth")
        report = repair_file(src, tmp_path / "out.pth", overwrite=True)
        lost = {key for key, record in records.items() if ends[record][1] > length}
        _check_output(report, original, lost)
