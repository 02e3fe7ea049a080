"""``repair`` keeps what ``torch.save`` kept: a transposed (non-contiguous) tensor, a view into
part of a storage, and tensors sharing one storage come back as the same views of one storage,
and every storage that checked out is copied whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpttool.commands.repair import repair_file

#: How each format is damaged without losing a tensor: a zip loses its central directory, a
#: legacy file (which has none) gets trailing bytes.
DAMAGE = {"zip": lambda data: data[:-200], "legacy": lambda data: data + b"\0" * 100}


def _saved(tmp_path: Path, legacy: bool = False) -> Path:
    base = torch.arange(24, dtype=torch.float32)
    matrix = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    path = tmp_path / "views.pth"
    value = {"base": base, "window": base[5:11], "transposed": matrix.t(), "epoch": 3}
    torch.save(value, path, _use_new_zipfile_serialization=not legacy)
    return path


@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_views_strides_and_shared_storages_survive_a_repair(tmp_path: Path, kind: str) -> None:
    path = _saved(tmp_path, legacy=kind == "legacy")
    cut = tmp_path / "cut.pth"
    cut.write_bytes(DAMAGE[kind](path.read_bytes()))
    report = repair_file(cut, tmp_path / "out.pth")
    assert report.lost == () and report.recovered == 3
    original = torch.load(path, weights_only=True)
    repaired = torch.load(tmp_path / "out.pth", weights_only=True)
    assert repaired["epoch"] == 3
    for key in ("base", "window", "transposed"):
        assert repaired[key].equal(original[key]), key
        assert repaired[key].stride() == original[key].stride(), key
        assert repaired[key].storage_offset() == original[key].storage_offset(), key
    assert not repaired["transposed"].is_contiguous()
    # the window still views the base's storage: one storage, as torch.save wrote it
    assert (
        repaired["window"].untyped_storage().data_ptr()
        == repaired["base"].untyped_storage().data_ptr()
    )


@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_numpy_arrays_in_the_pickle_come_back_as_numpy_arrays(tmp_path: Path, kind: str) -> None:
    """NumPy arrays keep their bytes inside data.pkl (a Trainer's rng_state.pth holds numpy's
    RNG state): never lost by a cut, written back as NumPy pickles them, every kind intact."""
    import numpy as np

    arrays = {
        "state": ("MT19937", np.arange(624, dtype=np.uint32), 7, 0, 0.0),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        "big_endian": np.arange(5, dtype=">i4"),
        "flags": np.array([True, False, True]),
        "bytes": np.frombuffer(b"\x00\x80\xff", dtype=np.uint8).copy(),
        "scalar": np.array(2.5, dtype=np.float32),
        "weight": torch.ones(4, 4),
    }
    path = tmp_path / "rng.pth"
    torch.save(arrays, path, _use_new_zipfile_serialization=kind == "zip")
    cut = tmp_path / "cut.pth"
    cut.write_bytes(DAMAGE[kind](path.read_bytes()))
    report = repair_file(cut, tmp_path / "out.pth")
    assert report.lost == () and report.recovered == 7
    # a file this test wrote: its NumPy globals are trusted
    original = torch.load(path, weights_only=False)
    repaired = torch.load(tmp_path / "out.pth", weights_only=False)
    assert repaired["state"][0] == "MT19937" and repaired["state"][2:] == (7, 0, 0.0)
    pairs = [(original["state"][1], repaired["state"][1])]
    pairs += [
        (original[k], repaired[k]) for k in ("fortran", "big_endian", "flags", "bytes", "scalar")
    ]
    for want, got in pairs:
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        assert got.flags["F_CONTIGUOUS"] == want.flags["F_CONTIGUOUS"]
    assert repaired["weight"].equal(original["weight"])
