"""Equal bytes are equal tensors: the byte-first paths of ``diff`` and of the read-back checks
give the verdicts of the value paths they skip (issue 33)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.diff import run as diff_run
from ckpttool.commands.diff.run import IDENTICAL, WITHIN_TOLERANCE, DiffReport, diff
from ckpttool.io import blocks
from ckpttool.io.read_batch import BLOCK

LARGE = BLOCK // 4 + 1000  # float32 elements: more bytes than one batched read holds


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def _pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Large tensors with known changes (and some without), A and B."""
    generator = torch.Generator().manual_seed(33)
    base = torch.randn(LARGE, generator=generator)
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}

    def both(key: str, left: torch.Tensor, right: torch.Tensor | None = None) -> None:
        a[key] = left
        b[key] = left.clone() if right is None else right

    def changed(tensor: torch.Tensor, index: int, value: Any) -> torch.Tensor:
        out = tensor.clone()
        out[index] = value
        return out

    both("same", base)
    both("one_element", base, changed(base, LARGE - 1, base[LARGE - 1] + 1))
    both("tiny_change", base, changed(base, 7, base[7] * (1 + 1e-7)))  # within tolerance
    zero = changed(base, 3, 0.0)
    both("negative_zero", zero, changed(zero, 3, -0.0))  # bytes differ, values equal
    nan = changed(base, 5, float("nan"))
    both("nan_same_payload", nan)
    payload = changed(base, 5, _nan(0x7FC00000))
    both("nan_other_payload", payload, changed(payload, 5, _nan(0x7FC00001)))
    both("nan_moved", nan, changed(nan, 6, float("nan")))
    both("fp16", base.repeat(2).half())
    both("bf16_changed", base.repeat(2).bfloat16(), changed(base.repeat(2).bfloat16(), 0, 3.0))
    integers = torch.arange(LARGE, dtype=torch.int64)
    both("int64_same", integers)
    both("int64_changed", integers, changed(integers, 100, -1))
    both("bytes_over_chunk", torch.zeros(1 << 21, dtype=torch.uint8))
    wide = base.repeat(2).reshape(2, LARGE)
    both("view_offset", wide[1], wide.clone()[1])  # a contiguous view past its storage's start
    both("transposed", wide.t(), wide.t().contiguous())  # strides differ: values path
    both("dtype_changed", base, base.double())
    return a, b


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    a, b = _pair()
    folder = tmp_path_factory.mktemp("pair")
    torch.save(a, folder / "a.pth")
    torch.save(dict(reversed(b.items())), folder / "b.pth")  # other offsets in B
    return folder / "a.pth", folder / "b.pth"


def _reports(
    saved_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, **options: Any
) -> tuple[DiffReport, DiffReport]:
    path_a, path_b = saved_pair
    fast = diff(path_a, path_b, **options)
    with monkeypatch.context() as patch:
        patch.setattr(diff_run, "_bytes_settle", lambda pair: False)  # every pair by value
        slow = diff(path_a, path_b, **options)
    return fast, slow


@pytest.mark.parametrize("options", [{}, {"norms": True}, {"rtol": 0.0, "atol": 0.0}])
def test_bytes_first_gives_the_value_paths_verdicts(
    saved_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    fast, slow = _reports(saved_pair, monkeypatch, **options)
    assert fast.tensors == slow.tensors
    statuses = {entry.key: entry.status for entry in fast.tensors}
    # what the docs say, for the cases the byte path must not decide alone
    assert statuses["nan_same_payload"] == IDENTICAL  # equal bits: bitwise equal
    assert statuses["negative_zero"] == WITHIN_TOLERANCE  # -0.0 == 0.0, bits differ
    assert statuses["nan_other_payload"] == WITHIN_TOLERANCE  # even with no tolerance
    assert statuses["same"] == statuses["fp16"] == statuses["int64_same"] == IDENTICAL


def test_large_equal_pairs_are_not_decoded(
    saved_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the pairs whose bytes differ (or that cannot be compared as one range each) reach
    the value comparison."""
    decoded: list[str] = []
    compare = diff_run.compare_values

    def counting(ckpt_a: Any, record_a: Any, *args: Any, **kwargs: Any) -> Any:
        decoded.append(record_a.key)
        return compare(ckpt_a, record_a, *args, **kwargs)

    monkeypatch.setattr(diff_run, "compare_values", counting)
    report = diff(*saved_pair)
    assert sorted(decoded) == [
        "bf16_changed", "dtype_changed", "int64_changed", "nan_moved", "nan_other_payload",
        "negative_zero", "one_element", "tiny_change", "transposed",
    ]  # fmt: skip
    assert report.counts()[IDENTICAL] == 7


@pytest.mark.parametrize("memcmp", [True, False], ids=["memcmp", "bytes"])
def test_equal_ranges_and_crc_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memcmp: bool
) -> None:
    """Block by block, across block boundaries and at the end of the file; with the C
    library's memcmp and without it."""
    import zlib

    if not memcmp:
        monkeypatch.setattr(blocks, "_memcmp", lambda: None)
    data = bytes(range(256)) * (3 * blocks.BLOCK // 256) + b"tail"
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    other = bytearray(data)
    other[2 * blocks.BLOCK + 1] ^= 1
    (tmp_path / "other.bin").write_bytes(other)
    with open(path, "rb") as first, open(tmp_path / "other.bin", "rb") as second:
        from ckpttool.io.source import read_into

        def read_a(offset: int, into: memoryview) -> int:
            return read_into(first.fileno(), offset, into)

        def read_b(offset: int, into: memoryview) -> int:
            return read_into(second.fileno(), offset, into)

        size = len(data)
        assert blocks.equal_ranges(read_a, 0, read_a, 0, size)
        assert blocks.equal_ranges(read_a, 0, read_b, 0, 2 * blocks.BLOCK)
        assert not blocks.equal_ranges(read_a, 0, read_b, 0, size)
        assert not blocks.equal_ranges(read_a, 0, read_a, 256, size)  # B ends early
        assert blocks.equal_ranges(read_a, 256, read_a, 512, blocks.BLOCK)
        assert blocks.crc_range(read_a, 0, size) == zlib.crc32(data)
        assert blocks.crc_range(read_a, 5, size - 5) == zlib.crc32(data[5:])
        assert blocks.crc_range(read_a, 5, size) is None  # the file ends inside
        assert blocks.crc_range(read_a, 0, 0) == 0


@pytest.mark.parametrize("damage", ["none", "last_block", "cut"])
def test_verify_checks_large_records_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A record of several blocks: a flipped byte in its last block, a file cut inside it.
    Its bytes are read into reused buffers, never as one new buffer per read."""
    from ckpttool.commands.verify import verify
    from ckpttool.formats.torch_zip import verify as verify_zip

    path = tmp_path / "large.pth"
    tensor = torch.arange(3 * blocks.BLOCK // 4 + 5, dtype=torch.float32)
    torch.save({"large": tensor, "after": torch.ones(4)}, path)
    data = bytearray(path.read_bytes())
    start = data.index(tensor.numpy().tobytes())
    end = start + tensor.numel() * 4
    if damage == "last_block":
        data[end - 2] ^= 0x01
    if damage == "cut":
        data = data[: end - 100] + data[-22:]  # the end-of-directory record kept: still a zip
    path.write_bytes(bytes(data))
    reads: list[int] = []
    read_range = verify_zip.read_range
    monkeypatch.setattr(
        verify_zip, "read_range", lambda fd, n, at: reads.append(n) or read_range(fd, n, at)
    )
    (result,) = verify([path])
    assert max(reads, default=0) <= blocks.BLOCK
    if damage == "none":
        assert result.problems == []
    elif damage == "last_block":
        assert any("data/0: CRC-32 is" in problem for problem in result.problems)
    else:
        assert result.problems


@pytest.fixture(scope="module")
def large_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dict with tensors of several blocks (one a view past its storage's start)."""
    path = tmp_path_factory.mktemp("weights") / "large.pth"
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn(2, LARGE + 3, generator=generator)
    torch.save(
        {
            "embed": torch.randn(LARGE * 3, generator=generator).half(),
            "row": wide[1],  # the second half of its storage
            "small": torch.ones(10),
            "counts": torch.arange(LARGE, dtype=torch.int64),
        },
        path,
    )
    return path


@pytest.mark.parametrize("to", ["out.safetensors", "out.pth"])
def test_convert_reads_back_large_tensors_range_against_range(
    large_weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    """The source's large tensors are read once to be written (safetensors: not at all, the
    kernel copies them); the read-back compares the two files' bytes directly (not the source
    read and decoded again)."""
    import ckpttool.commands.convert.run as module
    from ckpttool.commands.convert.run import convert

    produced: list[str] = []
    tensor_bytes = module.tensor_bytes
    monkeypatch.setattr(
        module,
        "tensor_bytes",
        lambda ckpt, planned: produced.append(planned.name) or tensor_bytes(ckpt, planned),
    )
    report = convert(large_weights, tmp_path / to)
    assert report.verified
    large = ["counts", "embed", "row"] if to.endswith(".pth") else []
    assert sorted(produced) == [*large, "small", "small"]
    with open_checkpoint(tmp_path / to) as written, open_checkpoint(large_weights) as source:
        for record in source.tensors():
            mine = written.tensors()[[r.key for r in written.tensors()].index(record.key)]
            assert bytes(read_whole(written, mine)) == bytes(read_whole(source, record))


def read_whole(ckpt: Any, record: Any) -> bytes:
    data, first = ckpt.read_bytes(record)
    start = first * record.itemsize
    return bytes(data[start : start + record.nbytes])


@pytest.mark.parametrize("to", ["out.safetensors", "out.pth"])
@pytest.mark.parametrize("where", [0, -1])
def test_convert_read_back_catches_a_flipped_byte_in_a_large_tensor(
    large_weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: int, to: str
) -> None:
    """A byte of ``row`` (its first or last) flipped as it is written: copied by the kernel
    (safetensors) or read and written (pth)."""
    import os

    import ckpttool.commands.convert.run as module
    from ckpttool.commands.convert.run import convert
    from ckpttool.errors import VerificationError

    tensor_bytes = module.tensor_bytes
    row = torch.load(large_weights)["row"].numpy().tobytes()

    def corrupting(ckpt: Any, planned: Any) -> Any:
        data, cast = tensor_bytes(ckpt, planned)
        if planned.name != "row":
            return data, cast
        flipped = bytearray(data)
        flipped[where] ^= 0x01
        return flipped, cast

    copy_range = blocks.copy_range

    def copy_flipped(source: int, offset: int, dest: int, at: int, size: int, *rest: Any) -> None:
        copy_range(source, offset, dest, at, size, *rest)
        if os.pread(source, size, offset) == row:
            spot = at + (where % size)
            os.pwrite(dest, bytes([os.pread(dest, 1, spot)[0] ^ 1]), spot)

    monkeypatch.setattr(module, "tensor_bytes", corrupting)
    monkeypatch.setattr(blocks, "copy_range", copy_flipped)
    target = tmp_path / to
    with pytest.raises(VerificationError, match="row does not read back bit-for-bit equal"):
        convert(large_weights, target)
    assert not target.exists()
