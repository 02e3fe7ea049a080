"""Reading many tensors in blocks (ckpttool.io.read_batch) gives what reading each one gives.

And diff, which settles pairs of small tensors by comparing their bytes read that way, gives
the same report as comparing every pair's values one by one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.diff import run as diff_module
from ckpttool.commands.diff.run import IDENTICAL, WITHIN_TOLERANCE, DiffReport, diff
from ckpttool.io.read_batch import read_many
from ckpttool.model.records import TensorRecord, stored_records
from tests.support.helpers import FIXTURES, fixture_files, fixture_id
from tests.test_convert import big_endian_copy

PAIRS = FIXTURES / "pairs"


def outcomes(reads: Any) -> list[Any]:
    """Each read's (bytes, first element), or the error that stopped the reads."""
    out: list[Any] = []
    try:
        for data, first in reads:
            out.append((bytes(data), first))
    except Exception as error:  # the error is what is compared
        out.append((type(error), str(error)))
    return out


def one_by_one(ckpt: Checkpoint, records: list[TensorRecord]) -> Any:
    for record in records:
        yield ckpt.read_bytes(record)


@pytest.mark.parametrize("block", [64, 4096, 1 << 20])
@pytest.mark.parametrize("path", fixture_files(), ids=fixture_id)
def test_read_many_gives_what_read_bytes_gives(path: Path, block: int) -> None:
    """Every fixture (views, shared storages, NumPy arrays, legacy and safetensors files, meta
    tensors, sparse parts), forwards and backwards (no block spans a backward step)."""
    with open_checkpoint(path) as ckpt:
        records = [r for r in stored_records(ckpt.tensors()) if r.storage or r.inline_data]
        for order in (records, records[::-1]):
            assert outcomes(read_many(ckpt, order, block)) == outcomes(one_by_one(ckpt, order))


def small_tensors(count: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.arange(i, i + 6, dtype=torch.float32) for i in range(count)}


def test_adjacent_records_are_read_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "many.pth"
    torch.save(small_tensors(300), path)
    calls = {"read_file": 0, "read_bytes": 0}
    for name in calls:
        original = getattr(Checkpoint, name)

        def counting(self: Checkpoint, *args: Any, _name: str = name, _f: Any = original) -> Any:
            calls[_name] += 1
            return _f(self, *args)

        monkeypatch.setattr(Checkpoint, name, counting)
    with open_checkpoint(path) as ckpt:
        records = ckpt.tensors()
        got = [bytes(data) for data, _ in read_many(ckpt, records)]
    assert got == [
        torch.arange(i, i + 6, dtype=torch.float32).numpy().tobytes() for i in range(300)
    ]
    assert calls == {"read_file": 2, "read_bytes": 0}  # 256 records looked ahead, then 44


def test_a_file_cut_short_fails_at_the_same_record(tmp_path: Path) -> None:
    """The file shrinks after it was opened: the block read comes back short, and each record
    is then read alone, raising its own error at its own turn."""
    path = tmp_path / "many.pth"
    torch.save(small_tensors(50), path)
    with open_checkpoint(path) as ckpt:
        records = ckpt.tensors()
        middle = ckpt.storage_span(records[30].storage)[0]  # type: ignore[arg-type]
        os.truncate(path, middle + 8)
        batched = outcomes(read_many(ckpt, records))
        alone = outcomes(one_by_one(ckpt, records))
    assert batched == alone
    assert len(alone) == 31 and alone[-1][0] is not bytes and "truncated" in alone[-1][1]


def report_one_by_one(a: Path, b: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(diff_module, "_bytes_settle", lambda pair: False)
        return diff(a, b, **options)


def same_reports(batched: DiffReport, alone: DiffReport) -> None:
    assert batched == alone
    for x, y in zip(batched.tensors, alone.tensors, strict=True):  # the verdicts, field by field
        assert (x.key, x.status, x.changes, x.values) == (y.key, y.status, y.changes, y.values)


def save_pair(tmp_path: Path, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Any:
    torch.save(a, tmp_path / "a.pth")
    torch.save(b, tmp_path / "b.pth")
    return tmp_path / "a.pth", tmp_path / "b.pth"


def test_diff_by_bytes_keeps_value_semantics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN with the same bits is identical, -0.0 against 0.0 is not (equal within tolerance),
    other NaN payloads are not bitwise equal, a transposed view and a slice of a shared
    storage are compared by their values, ints and bools exactly."""
    nan = torch.tensor([1.0, float("nan"), 3.0])
    other_nan = nan.clone()
    other_nan.view(torch.int32)[1] += 1  # another NaN payload
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    shared = torch.arange(8, dtype=torch.float64)
    a = {
        "nan": nan, "nan_payload": nan, "zero": torch.zeros(4), "t": base.t(), "plain": base,
        "half": shared[:4], "other_half": shared[4:], "ints": torch.arange(5),
        "flags": torch.tensor([True, False]), "bf16": torch.ones(3, dtype=torch.bfloat16),
        "empty": torch.zeros(0),
    }  # fmt: skip
    b = {
        "nan": nan.clone(), "nan_payload": other_nan, "zero": -torch.zeros(4),
        "t": base.t().contiguous(), "plain": base.clone(), "half": shared[:4].clone(),
        "other_half": shared[4:], "ints": torch.arange(5), "flags": torch.tensor([True, True]),
        "bf16": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0),
    }  # fmt: skip
    path_a, path_b = save_pair(tmp_path, a, b)
    report = diff(path_a, path_b)
    same_reports(report, report_one_by_one(path_a, path_b, monkeypatch))
    status = {entry.key: entry.status for entry in report.tensors}
    assert status["nan"] == IDENTICAL and status["zero"] == WITHIN_TOLERANCE
    assert status["t"] == status["plain"] == status["half"] == IDENTICAL
    nan_payload = next(e for e in report.tensors if e.key == "nan_payload")
    assert nan_payload.values is not None and not nan_payload.values.bitwise_equal


def test_diff_of_big_endian_and_little_endian_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same values in both byte orders: identical, though the bytes differ."""
    little = tmp_path / "little.pth"
    torch.save({"w": torch.arange(6, dtype=torch.float32), "i": torch.arange(3)}, little)
    big = tmp_path / "big.pth"
    big_endian_copy(little, big)
    for a, b in ((little, big), (big, big), (big, little)):
        report = diff(a, b)
        same_reports(report, report_one_by_one(a, b, monkeypatch))
        assert {entry.status for entry in report.tensors} == {IDENTICAL}


@pytest.mark.parametrize(
    "other", sorted(p.name for p in PAIRS.iterdir() if p.suffix in (".pth", ".safetensors"))
)
def test_diff_of_every_pair_is_the_same_one_by_one(
    other: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = PAIRS / "base.pth"
    for rounded in (False, True):
        batched = diff(base, PAIRS / other, rounded=rounded)
        alone = report_one_by_one(base, PAIRS / other, monkeypatch, rounded=rounded)
        same_reports(batched, alone)


def test_expected_reads_give_the_same_bytes_whatever_is_asked(tmp_path: Path) -> None:
    """Checkpoint.expect_reads: records asked for in turn, out of turn, twice, or not at all
    read as they do without the hint."""
    path = tmp_path / "many.pth"
    torch.save(small_tensors(40), path)
    with open_checkpoint(path) as ckpt:
        records = ckpt.tensors()
        want = [bytes(ckpt.read_bytes(r)[0]) for r in records]
        asked = [0, 1, 5, 2, 3, 3, 4, 39, 6, *range(7, 30), 35, 36]  # 30 to 34 never
        with ckpt.expect_reads(records):
            got = [bytes(ckpt.read_bytes(records[i])[0]) for i in asked]
        assert got == [want[i] for i in asked]


def test_convert_reads_small_tensors_in_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written and read back (source and output) in blocks, not one read per tensor."""
    from ckpttool.commands.convert.run import convert

    path = tmp_path / "many.pth"
    torch.save(small_tensors(300), path)
    alone: list[str] = []  # reads of one tensor's bytes
    original = Checkpoint.read_storage

    def counting(self: Checkpoint, storage: Any, *args: Any) -> Any:
        alone.append(storage.key)
        return original(self, storage, *args)

    monkeypatch.setattr(Checkpoint, "read_storage", counting)
    report = convert(path, tmp_path / "out.safetensors")
    assert report.verified and len(alone) < 20
