"""The reader agrees with torch on every fixture, and refuses bad input with a clear error."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.errors import CorruptCheckpointError, InputError, NotACheckpointError
from ckpttool.io.values import read_array, read_tensor
from ckpttool.model.roles import detect_layout
from tests.support.helpers import FIXTURES, dtype_name, fixture_files, fixture_id, flatten_loaded

FILES = fixture_files()


def _torch_load(path: Path, weights_only: bool) -> object:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _weights_only_readable(path: Path) -> bool:
    try:
        _torch_load(path, weights_only=True)
    except Exception:
        return False
    return True


WEIGHTS_ONLY = [p for p in FILES if _weights_only_readable(p)]


def test_fixture_set_is_broad() -> None:
    assert len(FILES) >= 15
    assert len(WEIGHTS_ONLY) >= 10


@pytest.mark.parametrize("path", WEIGHTS_ONLY, ids=fixture_id)
def test_keys_dtypes_shapes_match_torch_weights_only(path: Path) -> None:
    expected = {
        key: (dtype_name(v), list(v.shape))
        for key, v in flatten_loaded(_torch_load(path, weights_only=True))
    }
    with open_checkpoint(path) as ckpt:
        got = {r.key: (r.dtype, list(r.shape)) for r in ckpt.tensors()}
    assert got == expected


@pytest.mark.parametrize("path", FILES, ids=fixture_id)
def test_values_match_torch(path: Path) -> None:
    """Every tensor's values, read lazily, equal what a full (trusted) torch.load returns."""
    loaded = dict(flatten_loaded(_torch_load(path, weights_only=False)))
    with open_checkpoint(path) as ckpt:
        records = ckpt.tensors()
        assert [r.key for r in records] == list(loaded)
        for record in records:
            expected = loaded[record.key]
            if isinstance(expected, np.ndarray):
                assert np.array_equal(read_array(ckpt, record), expected)
            else:
                value = read_tensor(ckpt, record)
                assert value.dtype == expected.dtype
                assert torch.equal(value, expected), record.key


def test_reader_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import sys; from ckpttool.checkpoint import open_checkpoint; from ckpttool.commands.show import show;"
        f"show({str(FIXTURES / 'minimind/pretrain_32_resume.pth')!r});"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("minimind/pretrain_32.pth", "state_dict"),
        ("minimind/pretrain_32_resume.pth", "minimind_resume"),
        ("ckpttool/pretrain_32_resume.pth", "ckpttool_resume"),
        ("lightning/epoch=1-step=40.ckpt", "lightning"),
        ("safetensors/model.safetensors", "safetensors"),
        ("special/nested_generic.pth", "nested_dict"),
        ("legacy/resume_bigkeys.pth", "minimind_resume"),
    ],
)
def test_layouts(name: str, layout: str) -> None:
    with open_checkpoint(FIXTURES / name) as ckpt:
        assert detect_layout(ckpt.root, ckpt.format) == layout


def test_special_storages() -> None:
    with open_checkpoint(FIXTURES / "special/cuda_storages.pth") as ckpt:
        assert {r.location for r in ckpt.tensors()} >= {"cuda:0", "cuda:1"}
    with open_checkpoint(FIXTURES / "special/custom_prefix.pth") as ckpt:
        assert ckpt.details["prefix"] == "model_600000"
    with open_checkpoint(FIXTURES / "special/nonnumeric_keys.pth") as ckpt:
        keys = {r.storage.key for r in ckpt.tensors() if r.storage}
        assert not all(k.isdigit() and int(k) < 100 for k in keys)


def test_views_share_storage_and_keep_strides() -> None:
    with open_checkpoint(FIXTURES / "special/views.pth") as ckpt:
        records = ckpt.tensors()
        assert any(not r.is_contiguous for r in records)
        assert any(r.storage_offset > 0 for r in records)
        assert len({r.storage for r in records}) < len(records)


def test_opaque_objects_are_described_not_imported() -> None:
    with open_checkpoint(FIXTURES / "special/namespace_config.pth") as ckpt:
        classes = {type(v).__name__ for v in ckpt.root.values()}
        assert "OpaqueObject" in classes
        config = ckpt.root["config"]
        assert config.cls == "tests.fixtures.generate.TrainConfig"
        assert "lr" in config.fields()
        # argparse.Namespace is plain data: read as the mapping of its attributes
        assert ckpt.root["args"] == {
            "lr": 5e-4, "batch_size": 32, "save_dir": "../out", "use_moe": False
        }  # fmt: skip
        assert type(ckpt.root["args"]) is dict


# --- bad input ------------------------------------------------------------------------


def test_missing_directory_empty(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        open_checkpoint(tmp_path / "nope.pth")
    with pytest.raises(InputError, match="is a directory"):
        open_checkpoint(tmp_path)
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(InputError, match="empty"):
        open_checkpoint(tmp_path / "empty.pth")


@pytest.mark.parametrize(
    "content",
    [b"hello, this is text\n", b"\x08\x07\x12\x07pytorch\x1a\x032.1", b"\x1f\x8b\x08\x00junk"],
    ids=["text", "onnx-like", "gzip"],
)
def test_not_a_checkpoint(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "thing.pth"
    path.write_bytes(content)
    with pytest.raises(NotACheckpointError):
        open_checkpoint(path)


@pytest.mark.parametrize(
    "content",
    [b"hello, this is text\n", b"PK\x03\x04" + b"\0" * 60, b"\x80\x02}q\x00(X\x01"],
    ids=["text", "cut-zip", "cut-pickle"],
)
def test_errors_name_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "thing.pth"
    path.write_bytes(content)
    with pytest.raises((NotACheckpointError, CorruptCheckpointError)) as raised:
        open_checkpoint(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert str(raised.value).count(str(path)) == 1


def test_a_file_cut_after_opening_names_the_file_when_read(tmp_path: Path) -> None:
    path = tmp_path / "shrinking.pth"
    path.write_bytes((FIXTURES / "minimind/pretrain_32.pth").read_bytes())
    with open_checkpoint(path) as ckpt:
        last = max(ckpt.tensors(), key=lambda r: ckpt.storage_span(r.storage)[0])  # type: ignore[arg-type]
        with open(path, "r+b") as handle:  # another process truncates it meanwhile
            handle.truncate(ckpt.storage_span(last.storage)[0] + 1)  # type: ignore[arg-type]
        with pytest.raises(CorruptCheckpointError) as raised:
            ckpt.read_bytes(last)
    assert str(raised.value).startswith(f"{path}: ")
    assert "truncated" in str(raised.value)


def test_torchscript_is_recognised() -> None:
    with pytest.raises(NotACheckpointError, match=r"TorchScript"):
        open_checkpoint(FIXTURES / "special/torchscript.pt")


def test_zip_without_data_pkl(tmp_path: Path) -> None:
    path = tmp_path / "x.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hi")
    with pytest.raises(NotACheckpointError, match=r"no data\.pkl"):
        open_checkpoint(path)


@pytest.mark.parametrize(
    "name",
    [
        "minimind/pretrain_32_resume.pth",
        "legacy/resume_bigkeys.pth",
        "safetensors/model.safetensors",
    ],
)
def test_truncated_files_fail_cleanly(tmp_path: Path, name: str) -> None:
    data = (FIXTURES / name).read_bytes()
    for cut in np.linspace(1, len(data) - 1, 20).astype(int):
        path = tmp_path / f"cut{cut}"
        path.write_bytes(data[:cut])
        with (
            pytest.raises((CorruptCheckpointError, NotACheckpointError)),
            open_checkpoint(path) as ckpt,
        ):
            for record in ckpt.tensors():  # values of a truncated file must fail too
                read_tensor(ckpt, record)
