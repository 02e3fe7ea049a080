"""``repair_file`` on legacy torch.save files and bare pickles (issue 27): a legacy file cut at
every record boundary and a byte either side, a storage whose element count is wrong, a flipped
byte that nothing can see; a bare pickle with trailing bytes or cut before its STOP. Each legacy
output is checked against ``torch.load`` of the undamaged file (the helpers of test_repair)."""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.repair import repair_file
from ckpttool.errors import ReadBackError, UnrecoverableError
from ckpttool.formats.torch_legacy.writer import HEADER, write_legacy
from tests.support.helpers import FIXTURES
from tests.test_repair import _check_output, _cut, _same_bits

LEGACY_STATE_DICT = FIXTURES / "legacy" / "state_dict.pth"
LEGACY_RESUME = FIXTURES / "legacy" / "resume_bigkeys.pth"


def _pickle_ends(data: bytes) -> list[int]:
    """Where each of a legacy file's five pickles ends (just past its STOP)."""
    ends, at = [], 0
    for _ in range(5):
        for op, _, pos in pickletools.genops(io.BytesIO(data[at:])):
            if op.name == "STOP":
                at += pos + 1
        ends.append(at)
    return ends


def _storages(path: Path) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Each storage's (start of its count, end of its bytes), and tensor key -> storage key,
    from the undamaged file."""
    with open_checkpoint(path) as ckpt:
        records = [r for r in ckpt.tensors() if r.storage is not None]
        spans = {}
        for record in records:
            offset, length = ckpt.storage_span(record.storage)
            spans[record.storage.key] = (offset - 8, offset + length)
        return spans, {r.key: r.storage.key for r in records}


@pytest.mark.parametrize(
    "fixture", [LEGACY_STATE_DICT, LEGACY_RESUME], ids=["state_dict", "resume"]
)
def test_a_legacy_file_cut_at_every_record_boundary(fixture: Path, tmp_path: Path) -> None:
    data = fixture.read_bytes()
    ends = _pickle_ends(data)
    spans, tensors = _storages(fixture)
    assert ends[-1] == min(start for start, _ in spans.values())  # the storages follow
    points = set(ends) | {p for span in spans.values() for p in (span[0], span[0] + 8, span[1])}
    cuts = sorted({p + d for p in points for d in (-1, 0, 1) if 0 < p + d < len(data)})
    for length in cuts:
        src = _cut(fixture, tmp_path, length, "cut.pth")
        out = tmp_path / f"out{length}.pth"
        if length < ends[-1]:  # a pickle is cut: nothing to rebuild the tree from
            with pytest.raises(UnrecoverableError, match=r"cut\.pth: .* is cut before its end"):
                repair_file(src, out)
            assert not out.exists()
            continue
        report = repair_file(src, out)
        assert report.written and report.format == "torch-legacy" and report.damage
        lost = {key for key, storage in tensors.items() if spans[storage][1] > length}
        _check_output(report, fixture, lost)
        out.unlink()
        assert src.read_bytes() == data[:length]


def test_trailing_bytes_after_the_last_storage_are_cut_away(tmp_path: Path) -> None:
    src = tmp_path / "trailing.pth"
    src.write_bytes(LEGACY_RESUME.read_bytes() + b"\0" * 99)
    report = repair_file(src, tmp_path / "out.pth")
    assert report.damage == ("99 bytes after the last storage",)
    _check_output(report, LEGACY_RESUME, set())


def test_a_wrong_element_count_loses_that_storage_and_the_ones_after(tmp_path: Path) -> None:
    spans, tensors = _storages(LEGACY_STATE_DICT)
    order = sorted(spans, key=lambda key: spans[key][0])
    broken = order[4]
    data = bytearray(LEGACY_STATE_DICT.read_bytes())
    data[spans[broken][0]] ^= 0x01  # the count's low byte: the storages after it cannot be found
    src = tmp_path / "count.pth"
    src.write_bytes(bytes(data))
    report = repair_file(src, tmp_path / "out.pth")
    assert any(f"storage {broken!r}" in line and "element count" in line for line in report.damage)
    lost = {key for key, storage in tensors.items() if storage in order[4:]}
    _check_output(report, LEGACY_STATE_DICT, lost)


def test_a_flipped_byte_inside_a_legacy_storage_cannot_be_seen(tmp_path: Path) -> None:
    # a legacy file has no checksum: a storage whose bytes are all there counts as intact
    spans, _ = _storages(LEGACY_STATE_DICT)
    start, end = next(iter(spans.values()))
    data = bytearray(LEGACY_STATE_DICT.read_bytes())
    data[(start + 8 + end) // 2] ^= 0x10
    src = tmp_path / "flipped.pth"
    src.write_bytes(bytes(data))
    report = repair_file(src, tmp_path / "out.pth")
    assert not report.damaged and report.output is None
    assert not (tmp_path / "out.pth").exists()


def test_an_intact_legacy_file_is_not_written(tmp_path: Path) -> None:
    report = repair_file(LEGACY_RESUME, tmp_path / "out.pth")
    assert report.format == "torch-legacy" and not report.damaged
    assert report.output is None and not report.written
    assert list(tmp_path.iterdir()) == []


def test_the_legacy_writer_writes_what_torch_save_writes(tmp_path: Path) -> None:
    value = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1, 2, 3], dtype=torch.int64),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "epoch": 3,
        "lr": [0.5, None, (1, "x")],
    }
    made = io.BytesIO()
    torch.save(value, made, _use_new_zipfile_serialization=False)
    theirs = made.getvalue()
    assert theirs.startswith(HEADER)  # magic number, protocol, sys info: torch's very bytes
    src = tmp_path / "theirs.pth"
    src.write_bytes(theirs)
    with open_checkpoint(src) as ckpt:
        root = ckpt.root

        def read(key: str) -> bytes:
            storage = next(r.storage for r in ckpt.tensors() if r.storage.key == key)
            return bytes(ckpt.read_storage(storage, 0, storage.nbytes))

        ours = io.BytesIO()
        write_legacy(ours, root, read)
    loaded = torch.load(io.BytesIO(ours.getvalue()), weights_only=True)
    assert loaded.keys() == value.keys()
    for key in ("w", "b", "h"):
        assert _same_bits(loaded[key], value[key])
    assert loaded["epoch"] == 3 and loaded["lr"] == [0.5, None, (1, "x")]
    # the same layout after the pickles: sorted keys, then count + bytes in that order
    assert (
        len(ours.getvalue()) - _pickle_ends(ours.getvalue())[-1]
        == len(theirs) - (_pickle_ends(theirs)[-1])
    )


# --- bare pickles ----------------------------------------------------------------------------

BARE = {"epoch": 3, "step": 1500, "lr": [0.001, 0.0005], "name": "run-7"}


def test_a_bare_pickle_with_trailing_bytes_is_cut_at_its_stop(tmp_path: Path) -> None:
    pickled = pickle.dumps(BARE, protocol=2)
    src = tmp_path / "state.pkl"
    src.write_bytes(pickled + b"garbage\0\0")
    report = repair_file(src, tmp_path / "out.pkl")
    assert report.format == "pickle" and report.written
    assert report.damage == ("9 bytes after the pickle's STOP opcode (trailing bytes)",)
    assert report.lost == () and report.recovered == 0
    assert Path(report.output).read_bytes() == pickled
    assert pickle.loads(Path(report.output).read_bytes()) == BARE
    assert src.read_bytes() == pickled + b"garbage\0\0"


def test_a_bare_pickle_cut_before_its_stop_is_unrecoverable(tmp_path: Path) -> None:
    pickled = pickle.dumps(BARE, protocol=2)
    src = tmp_path / "state.pkl"
    src.write_bytes(pickled[:-1])  # no STOP
    with pytest.raises(UnrecoverableError) as caught:
        repair_file(src, tmp_path / "out.pkl")
    message = str(caught.value)
    assert message.startswith(f"{src}: the pickle is cut before its end")
    assert "\n" not in message and caught.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pkl"]


def test_an_intact_bare_pickle_is_not_written(tmp_path: Path) -> None:
    src = tmp_path / "state.pkl"
    src.write_bytes(pickle.dumps(BARE, protocol=2))
    report = repair_file(src, tmp_path / "out.pkl")
    assert report.format == "pickle" and not report.damaged
    assert report.output is None and not report.written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pkl"]


def test_an_output_of_another_format_does_not_pass_the_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpttool.commands import repair as repair_module
    from ckpttool.formats import registry

    def recover_as_legacy(handle: Any, size: int) -> Any:
        found = registry.recover_file(handle, size)
        found.write = write_legacy  # the pickle's values, but as a legacy file
        return found

    monkeypatch.setattr(repair_module, "recover_file", recover_as_legacy)
    src = tmp_path / "state.pkl"
    src.write_bytes(pickle.dumps(BARE, protocol=2) + b"\0")
    with pytest.raises(ReadBackError, match="reads as torch-legacy, not pickle"):
        repair_file(src, tmp_path / "out.pkl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pkl"]
