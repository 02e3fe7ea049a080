"""``repair_file(..., fill_from=OTHER)`` (issue 27): the lost tensors, and only they, taken from
another checkpoint when dtype and shape match; the others stay lost with the reason. The
outputs are compared with ``torch.load`` of the undamaged file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.commands import repair as repair_module
from ckpttool.commands.repair import repair, repair_file
from ckpttool.commands.repair_report import FilledTensor
from ckpttool.commands.verify import verify
from ckpttool.errors import ReadBackError
from ckpttool.formats import registry
from tests.test_repair import (
    RESUME,
    SAFETENSORS,
    STATE_DICT,
    _check_output,
    _cut,
    _leaves,
    _record_ends,
    _safetensors,
    _same_bits,
    _storage_keys,
)
from tests.test_repair_legacy import LEGACY_RESUME


def _equal_to(output: str | None, original: Path) -> None:
    """``output`` loads to exactly what ``original`` does (every tensor bit for bit)."""
    assert output is not None
    if original.suffix == ".safetensors":
        got, want = _safetensors(Path(output)), _safetensors(original)
    else:
        got = _leaves(torch.load(output, weights_only=True))
        want = _leaves(torch.load(original, weights_only=True))
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert _same_bits(got[key], value), key
        else:
            assert got[key] == value, key
    (result,) = verify([output])
    assert result.ok, (result.problems, result.error)


def _cut_resume(tmp_path: Path) -> tuple[Path, set[str]]:
    """The MiniMind resume file cut inside its last model weight's storage, and the tensors
    that cut loses (that weight and the optimizer's state after it)."""
    ends = _record_ends(RESUME)
    records = _storage_keys(RESUME)
    length = max(ends[record][1] for k, record in records.items() if k.startswith("model.")) - 30
    lost = {k for k, record in records.items() if ends[record][1] > length}
    return _cut(RESUME, tmp_path, length, "cut.pth"), lost


def test_fill_from_the_original_gives_the_original_back(tmp_path: Path) -> None:
    src, lost = _cut_resume(tmp_path)
    assert any(k.startswith("optimizer.state.") for k in lost) and any(
        k.startswith("model.") for k in lost
    )
    report = repair_file(src, tmp_path / "out.pth", fill_from=RESUME)
    assert report.lost == () and report.dropped == ()
    assert {f.key for f in report.filled} == lost
    assert all(f.source == str(RESUME) for f in report.filled)
    assert report.recovered == len(_storage_keys(RESUME))
    _equal_to(report.output, RESUME)


def test_fill_from_through_repair_and_from_another_format(tmp_path: Path) -> None:
    # the lost model weights of a cut state dict, taken from a safetensors copy of it
    from safetensors.torch import save_file

    weights = tmp_path / "weights.safetensors"
    save_file(torch.load(STATE_DICT, weights_only=True), weights)
    length = STATE_DICT.stat().st_size // 2
    src = _cut(STATE_DICT, tmp_path, length, "half.pth")
    report = repair(src, tmp_path / "out.pth", fill_from=weights)
    assert report.lost == () and report.filled
    assert {f.source for f in report.filled} == {str(weights)}
    _equal_to(report.output, STATE_DICT)


def test_a_tensor_of_another_shape_or_missing_in_other_stays_lost(tmp_path: Path) -> None:
    src, lost = _cut_resume(tmp_path)
    other = torch.load(RESUME, weights_only=True)
    model_key = sorted(k for k in lost if k.startswith("model."))[0]
    moment = sorted(k for k in lost if k.endswith(".exp_avg"))[0]
    entry = moment.rsplit(".", 1)[0]  # optimizer.state.N
    number = int(entry.rsplit(".", 1)[1])
    name = model_key.split(".", 1)[1]
    other["model"][name] = other["model"][name].reshape(-1)[:-1].clone()  # another shape
    del other["optimizer"]["state"][number]["exp_avg"]  # not there at all
    mismatched = tmp_path / "other.pth"
    torch.save(other, mismatched)
    report = repair_file(src, tmp_path / "out.pth", fill_from=mismatched)
    reasons = {t.key: t.reason for t in report.lost}
    weight = torch.load(RESUME, weights_only=True)["model"][name]
    dtype, shape = str(weight.dtype).removeprefix("torch."), list(weight.shape)
    assert reasons[model_key] == (
        f"{mismatched} holds it as {dtype}[{weight.numel() - 1}], not {dtype}{shape}"
    )
    assert reasons[moment] == f"{mismatched} has no tensor {moment!r}"
    # the rest of that optimizer entry goes with it, each lost one saying why
    siblings = {k for k in lost if k.startswith(entry + ".")} - {moment}
    for key in siblings:
        assert reasons[key] == f"left out with its optimizer entry ({moment} is lost)"
    assert set(reasons) == {model_key} | {moment} | siblings
    assert {f.key for f in report.filled} == lost - set(reasons)
    loaded = torch.load(report.output, weights_only=True)
    assert number not in loaded["optimizer"]["state"] and name not in loaded["model"]
    _check_output(report, RESUME, set(reasons))


def test_a_flipped_byte_in_one_storage_is_taken_from_fill_from(tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.q_proj.weight"
    start, end = _record_ends(STATE_DICT)[_storage_keys(STATE_DICT)[key]]
    data = bytearray(STATE_DICT.read_bytes())
    data[(start + end) // 2 + 40] ^= 0x10
    src = tmp_path / "torn.pth"
    src.write_bytes(bytes(data))
    report = repair_file(src, tmp_path / "out.pth", fill_from=STATE_DICT)
    assert any("CRC-32" in line for line in report.damage)
    assert report.filled == (FilledTensor(key, str(STATE_DICT)),) and report.lost == ()
    _equal_to(report.output, STATE_DICT)


def test_fill_from_on_a_cut_legacy_file_and_a_cut_safetensors_file(tmp_path: Path) -> None:
    for original in (LEGACY_RESUME, SAFETENSORS):
        size = original.stat().st_size
        src = _cut(original, tmp_path, size * 7 // 10, f"cut{original.suffix}")
        alone = repair_file(src, tmp_path / f"alone{original.suffix}")
        assert alone.lost
        report = repair_file(src, tmp_path / f"out{original.suffix}", fill_from=original)
        assert report.lost == () and {f.key for f in report.filled} == {
            t.key for t in alone.lost
        } | set(alone.dropped)
        _equal_to(report.output, original)


def test_a_filled_tensor_that_does_not_read_back_removes_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def recover_badly(handle: Any, size: int) -> Any:
        found = registry.recover_file(handle, size)
        write = found.write

        def flipped(read: Any) -> Any:
            def read_flipped(key: str) -> bytes:
                data = read(key)
                return bytes([data[0] ^ 1]) + data[1:] if key.startswith("\0filled") else data

            return read_flipped

        found.write = lambda out, root, read: write(out, root, flipped(read))
        return found

    monkeypatch.setattr(repair_module, "recover_file", recover_badly)
    src, _ = _cut_resume(tmp_path)
    with pytest.raises(ReadBackError, match="does not read back as salvaged"):
        repair_file(src, tmp_path / "out.pth", fill_from=RESUME)
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_an_intact_file_with_fill_from_takes_nothing(tmp_path: Path) -> None:
    report = repair_file(RESUME, tmp_path / "out.pth", fill_from=STATE_DICT)
    assert report.filled == () and not report.damaged and report.output is None
    assert list(tmp_path.iterdir()) == []
