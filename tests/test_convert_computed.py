"""``convert``'s computed tensors (cast, computed by a ``--map`` rule) are computed once: the
read-back compares what the written file holds with the CRC-32 of the bytes written, and still
catches a byte that changed between the two."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckpttool.commands.convert.run as convert_run
import ckpttool.model.cast as cast_module
from ckpttool.commands.convert.run import convert
from ckpttool.commands.mapped import DerivedCheckpoint
from ckpttool.errors import VerificationError
from ckpttool.formats.registry import format_by_id
from tests.support.helpers import FIXTURES

MINIMIND = FIXTURES / "minimind/pretrain_32.pth"  # fp16


def test_a_cast_tensor_is_cast_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = cast_module.cast_array  # imported by convert when a tensor is cast (NumPy's cost)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cast_module, "cast_array", counting)
    report = convert(MINIMIND, tmp_path / "out.safetensors", dtype="fp32")
    assert report.verified
    assert sum(report.cast.values()) == report.tensors > 0
    assert len(calls) == report.tensors  # written; the read-back is checked against a CRC


def test_a_mapped_tensor_is_made_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "sd.pth"
    torch.save({"w": torch.randn(3, 5), "v": torch.randn(4, 2), "b": torch.ones(2)}, source)
    transposed = tmp_path / "transpose.json"
    transposed.write_text(json.dumps({"unmatched": "keep", "rules": [
        {"from": "w", "to": "w_t", "op": "transpose"},
        {"from": "v", "to": "v_t", "op": "transpose"}]}))  # fmt: skip
    made: Counter[str] = Counter()
    real = DerivedCheckpoint.read_storage

    def counting(self: DerivedCheckpoint, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if storage.key in self.derived and (self._made is None or self._made[0] != storage.key):
            made[storage.key] += 1
        return real(self, storage, *args, **kwargs)

    monkeypatch.setattr(DerivedCheckpoint, "read_storage", counting)
    out = tmp_path / "out.safetensors"
    report = convert(source, out, map_name=str(transposed))
    assert report.verified
    assert sorted(made.values()) == [1, 1]
    written = load_file(out)
    original = torch.load(source)
    assert torch.equal(written["w_t"], original["w"].T)
    assert torch.equal(written["v_t"], original["v"].T)


@pytest.mark.parametrize(("to", "options"), [
    ("out.safetensors", {"dtype": "fp32"}),
    ("out.pth", {"dtype": "bf16"}),
])  # fmt: skip
def test_a_byte_changed_after_the_cast_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str, options: dict[str, Any]
) -> None:
    """The bytes a cast produced are hashed; the writer then gets a copy with one byte flipped
    (as a bad write would leave it): the read-back differs from the hash."""

    class Flipping:
        def __init__(self, writer: Any) -> None:
            self._writer = writer

        def __getattr__(self, name: str) -> Any:
            return getattr(self._writer, name)

        def write(self, handle: Any, outs: Any, data: Any, *rest: Any) -> Any:
            def flipped() -> Any:
                for number, item in enumerate(data):
                    if number == 2:
                        item = bytearray(item)
                        item[-1] ^= 0x01
                    yield item

            return self._writer.write(handle, outs, flipped(), *rest)

    monkeypatch.setattr(convert_run, "format_by_id", lambda name: Flipping(format_by_id(name)))
    target = tmp_path / to
    with pytest.raises(VerificationError, match="does not read back bit-for-bit equal"):
        convert(MINIMIND, target, **options)
    assert not target.exists()
