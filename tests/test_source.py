"""Local files and URLs: one Location protocol, two implementations, chosen once by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.checkpoint import open_checkpoint
from ckpttool.errors import CorruptCheckpointError, EmptyFileError, InputError
from ckpttool.io import source
from ckpttool.io.source import LocalSource, location


def test_location_is_chosen_from_the_name() -> None:
    assert location("ckpt.pth") == LocalSource("ckpt.pth")
    assert isinstance(location(Path("dir") / "ckpt.pth"), LocalSource)
    assert isinstance(location("file:///tmp/ckpt.pth"), LocalSource)  # read locally
    remote = location("s3://bucket/run/ckpt.pth")
    assert type(remote).__name__ == "RemoteSource"
    assert remote.join("x") == "s3://bucket/run/ckpt.pth/x"
    assert not location("https://host/dir/").can_list() and remote.can_list()


def test_a_local_location_does_not_import_the_remote_side(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abc")
    code = (
        "import sys; from ckpttool.io import source; "
        f"d = {str(tmp_path)!r}; source.list_names(d); source.member_sizes(d, ['a.bin']); "
        "source.read_small(source.join(d, 'a.bin'), 10); source.shown_name(d); "
        "source.open_source(source.join(d, 'a.bin')).close(); "
        "print('ckpttool.io.remote' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_local_verbs(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abcdef")
    here = LocalSource(str(tmp_path))
    assert here.list_names() == ["a.bin"] and here.list_dirs() == ["sub"]
    assert here.member_sizes(["a.bin", "missing", "sub"]) == {"a.bin": 6}
    assert here.is_dir() and not here.is_file()
    member = LocalSource(here.join("a.bin"))
    assert member.read_head(3) == b"abc" and member.read_small(6) == b"abcdef"
    with pytest.raises(ValueError, match="6 bytes of JSON"):
        member.read_small(5)
    with member.open() as handle:
        assert handle.read() == b"abcdef"


def test_opening_refuses_what_is_no_file(tmp_path: Path) -> None:
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(EmptyFileError, match=r"empty\.pth: the file is empty"):
        source.open_source(str(tmp_path / "empty.pth"))
    with pytest.raises(InputError, match=r"missing\.pth: no such file"):
        source.open_source(str(tmp_path / "missing.pth"))
    with pytest.raises(InputError, match="is a directory, not a checkpoint file"):
        source.open_source(str(tmp_path))


def test_dcp_wording_is_the_door_s_not_io_s(tmp_path: Path) -> None:
    """io says "a directory"; the door names a DCP directory without its .metadata."""
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(InputError, match="is a directory, not a checkpoint file"):
        source.open_local(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match=r"without its \.metadata file"):
        open_checkpoint(tmp_path)
