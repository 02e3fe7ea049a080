"""The streaming zip writer produces archives torch and zipfile read, aligned like torch's."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.formats.torch_zip.reader import member_span
from ckpttool.formats.torch_zip.zip_writer import ALIGNMENT, TorchZipWriter
from tests.support.helpers import FIXTURES


def _rewrite(source: Path, target: Path, chunk: int = 7) -> None:
    archive = zipfile.ZipFile(source)
    with open(target, "wb") as handle, TorchZipWriter(handle) as writer:
        for info in archive.infolist():
            data = archive.read(info.filename)
            writer.write_stream(
                info.filename, (data[i : i + chunk] for i in range(0, len(data), chunk))
            )


def test_rewritten_archive_is_valid_aligned_and_loads(tmp_path: Path) -> None:
    source = FIXTURES / "ckpttool/pretrain_32_resume.pth"
    target = tmp_path / "copy.pth"
    _rewrite(source, target)
    archive = zipfile.ZipFile(target)
    assert archive.testzip() is None  # every CRC right
    with open(target, "rb") as handle:
        assert {member_span(handle, i)[0] % ALIGNMENT for i in archive.infolist()} == {0}
    original = torch.load(source, weights_only=True)
    for mmap in (False, True):
        copy = torch.load(target, weights_only=True, mmap=mmap)
        assert torch.equal(copy["model"]["model.embed_tokens.weight"],
                           original["model"]["model.embed_tokens.weight"])  # fmt: skip
        assert copy["step"] == original["step"]
    with open_checkpoint(target) as ckpt:
        assert len(ckpt.tensors()) == len(open_checkpoint(source).tensors())


def test_duplicate_record_refused(tmp_path: Path) -> None:
    with open(tmp_path / "x.zip", "wb") as handle:
        writer = TorchZipWriter(handle)
        writer.write("a/data.pkl", b"x")
        with pytest.raises(ValueError, match="duplicate"):
            writer.write("a/data.pkl", b"y")
