"""verify reads the records of a torch zip in blocks of adjacent ones: the problems it finds
are those it finds reading them one by one (damaged records mid-block, a file cut short)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.verify import verify
from ckpttool.formats.torch_zip import verify as verify_zip
from ckpttool.io import parallel


def save_many(path: Path) -> bytes:
    torch.save({f"t{i}": torch.full((8,), float(i)) for i in range(60)}, path)
    return path.read_bytes()


def problems(path: Path) -> list[str]:
    (result,) = verify([path])
    return result.problems


def one_by_one(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    with monkeypatch.context() as patch:
        patch.setattr(verify_zip, "BLOCK", 0)  # no run of records joins
        return problems(path)


@pytest.mark.parametrize("damage", ["none", "one_byte", "two_records", "zeroed_header"])
def test_blocks_find_what_single_reads_find(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "many.pth"
    data = bytearray(save_many(path))
    middle = data.index(torch.full((8,), 30.0).numpy().tobytes())
    if damage in ("one_byte", "two_records"):
        data[middle + 3] ^= 0x10
    if damage == "two_records":
        data[data.index(torch.full((8,), 31.0).numpy().tobytes())] ^= 0x01
    if damage == "zeroed_header":  # record 30's local header and the start of its bytes
        header = data.rindex(b"PK\x03\x04", 0, middle)
        data[header : middle + 16] = bytes(middle + 16 - header)
    path.write_bytes(bytes(data))
    found = problems(path)
    assert found == one_by_one(path, monkeypatch)
    expected = {"none": 0, "one_byte": 1, "two_records": 2, "zeroed_header": 1}[damage]
    assert len(found) == expected


def test_a_file_cut_short_is_reported_as_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory read from the whole file, the records' bytes from a copy cut inside
    record 30: the run that reaches past the end is read again record by record."""
    path = tmp_path / "many.pth"
    data = save_many(path)
    with open_checkpoint(path) as ckpt:
        record = ckpt.tensors()[30]
        assert record.storage is not None
        cut = ckpt.storage_span(record.storage)[0] + 5
    short = tmp_path / "short.bin"
    short.write_bytes(data[:cut])
    fd = os.open(short, os.O_RDONLY)
    try:
        with open(path, "rb") as handle:
            archive = verify_zip.open_zip(handle)
            batched = verify_zip.check_archive(fd, archive, 0)
            with monkeypatch.context() as patch:
                patch.setattr(verify_zip, "BLOCK", 0)
                alone = verify_zip.check_archive(fd, archive, 0)
    finally:
        os.close(fd)
    assert batched == alone
    assert "data/30: the file ends inside this record (truncated)" in alone[0]
    assert len(alone) >= 30


@pytest.mark.parametrize("damage", ["none", "two_records", "zeroed_header"])
def test_records_checked_on_threads_report_as_one_thread(damage: str, tmp_path: Path) -> None:
    """The runs' CRCs are taken on ``--jobs`` threads: the problems, and their order, are the
    same with 1 and 4 (records large enough that each is a run of its own)."""
    path = tmp_path / "large.pth"
    torch.save({f"t{i}": torch.full((300_000,), float(i)) for i in range(12)}, path)
    data = bytearray(path.read_bytes())
    for i in (3, 9) if damage == "two_records" else ():
        data[data.index(torch.full((4,), float(i)).numpy().tobytes()) + 5_000] ^= 0x01
    if damage == "zeroed_header":  # record 5's local header
        start = data.index(torch.full((4,), 5.0).numpy().tobytes())
        header = data.rindex(b"PK\x03\x04", 0, start)
        data[header : header + 30] = bytes(30)
    path.write_bytes(bytes(data))
    with parallel.using(1):
        alone = problems(path)
    with parallel.using(4):
        threaded = problems(path)
    assert threaded == alone
    assert len(alone) == {"none": 0, "two_records": 2, "zeroed_header": 1}[damage]
    if damage == "two_records":
        assert [p.split(":")[0] for p in alone] == ["large/data/3", "large/data/9"]


def test_cli_report_of_a_damaged_file_is_the_same_with_any_jobs(tmp_path: Path) -> None:
    """``verify --jobs 1`` and ``--jobs 4`` of one file: the same text and the same JSON bytes,
    exit 1, each damaged record named once."""
    from click.testing import CliRunner

    from ckpttool.cli import cli

    path = tmp_path / "large.pth"
    torch.save({f"t{i}": torch.full((300_000,), float(i)) for i in range(12)}, path)
    data = bytearray(path.read_bytes())
    for i in (2, 10):
        data[data.index(torch.full((4,), float(i)).numpy().tobytes()) + 9_000] ^= 0x04
    path.write_bytes(bytes(data))
    for extra in ([], ["--json"]):
        one, four = (
            CliRunner().invoke(cli, ["verify", str(path), "--jobs", jobs, *extra])
            for jobs in ("1", "4")
        )
        assert (one.exit_code, four.exit_code) == (1, 1)
        assert four.output == one.output
        assert one.output.count("large/data/2:") == one.output.count("large/data/10:") == 1
