"""Reading a DCP directory's item archives: from memory or a window, with or without walks shared.

A chunk's archive up to ``MAX_IN_MEMORY`` bytes is read with one read and parsed in memory;
walks of byte-identical ``data.pkl`` pickles are shared through ``PickleCache``. Both are
checked differentially: every chunk's record, every tensor's bytes and every error (a storage
member missing or short, a big-endian chunk, a different dtype in one of two otherwise
identical archives, a truncated archive) must be what the windowed, uncached path gives.
"""

from __future__ import annotations

import io
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.verify import verify_file
from ckpttool.errors import CkptError
from ckpttool.formats.dcp import files as dcp_files
from ckpttool.formats.dcp.directory import DcpFiles, load_metadata, tensor_record
from ckpttool.formats.dcp.metadata import TensorEntry
from ckpttool.formats.torch_zip import reader as torch_zip
from ckpttool.io.source import member_sizes, read_range
from ckpttool.model.records import ChunkRecord, StorageRecord
from tests.support.dcp_cases import DCP, rewrite_metadata

Outcome = list[tuple[str, Any]]


def _save(directory: Path, state: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns it is not distributed
        dcp.save(state, checkpoint_id=directory)
    return directory


def _same_shapes(directory: Path, count: int = 3) -> Path:
    """``count`` float32 4x4 tensors (byte-identical pickles) and a value."""
    state: dict[str, Any] = {
        f"t{i}": torch.arange(16.0).reshape(4, 4) + 16 * i for i in range(count)
    }
    state["step"] = 7
    return _save(directory, state)


def _chunks(directory: Path) -> list[tuple[ChunkRecord, StorageRecord]]:
    with open(directory / ".metadata", "rb") as handle:
        _, meta = load_metadata(handle, refuse_dangerous=True)
    pairs = []
    for entry in meta.entries:
        if isinstance(entry, TensorEntry):
            storage = tensor_record(entry).storage
            assert storage is not None
            pairs += [(chunk, storage) for chunk in entry.chunks]
    return pairs


def _files(directory: Path) -> DcpFiles:
    with open(directory / ".metadata", "rb") as handle:
        _, meta = load_metadata(handle, refuse_dangerous=True)
    return DcpFiles(directory, member_sizes(str(directory), list(meta.files)))


@pytest.fixture(params=["memory+cache", "window+cache", "memory"])
def mode(request: pytest.FixtureRequest) -> str:
    """How the outcome under test reads archives (the reference: window, no cache)."""
    return str(request.param)


def _reading(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(dcp_files, "MAX_IN_MEMORY", 1 << 20 if "memory" in mode else -1)
    monkeypatch.setattr(torch_zip, "MAX_CACHED_PICKLE", 4096 if "cache" in mode else -1)


def _outcome(directory: Path) -> Outcome:
    """Each chunk's record (or error), each tensor's bytes (or error), verify's problems."""
    found: Outcome = []
    files = _files(directory)
    try:
        for chunk, storage in _chunks(directory):
            try:
                record, base = files.chunk_tensor(chunk, storage)
                found.append((storage.key, (repr(record), base)))
            except CkptError as error:
                found.append((storage.key, f"{type(error).__name__}: {error}"))
        for _, storage in _chunks(directory):
            try:
                found.append((storage.key, bytes(files.read(storage, 0, storage.nbytes))))
            except CkptError as error:
                found.append((storage.key, f"{type(error).__name__}: {error}"))
    finally:
        files.close()
    found.append(("verify", verify_file(directory).problems))
    return found


def _both(directory: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> tuple[Outcome, Outcome]:
    """(reference, under test)."""
    with monkeypatch.context() as patch:
        _reading(patch, "window")
        reference = _outcome(directory)
    with monkeypatch.context() as patch:
        _reading(patch, mode)
        tested = _outcome(directory)
    return reference, tested


# -- tampering with one archive of a data file ---------------------------------------------


def _central_entry(archive: bytearray, name: bytes) -> int:
    at = archive.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", archive, at + 28)[0]
        if archive[at + 46 : at + 46 + name_len] == name:
            return at
        at = archive.find(b"PK\x01\x02", at + 1)
    raise AssertionError(f"no directory entry {name!r}")


def _patch(directory: Path, chunk: ChunkRecord, change: Callable[[bytearray], None]) -> None:
    path = directory / chunk.file
    data = bytearray(path.read_bytes())
    archive = data[chunk.offset : chunk.offset + chunk.length]
    before = bytes(archive)
    change(archive)
    assert len(archive) == chunk.length and bytes(archive) != before
    data[chunk.offset : chunk.offset + chunk.length] = archive
    path.write_bytes(data)


def _member(suffix: str, change: Callable[[bytes], bytes]) -> Callable[[bytearray], None]:
    """Replace a member's bytes (same length), its CRC-32 set to match them."""

    def patch(archive: bytearray) -> None:
        with zipfile.ZipFile(io.BytesIO(bytes(archive))) as opened:
            info = next(i for i in opened.infolist() if i.filename.endswith(suffix))
        name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        new = change(bytes(archive[start : start + info.file_size]))
        assert len(new) == info.file_size
        archive[start : start + len(new)] = new
        crc = zlib.crc32(new)
        struct.pack_into("<L", archive, _central_entry(archive, info.filename.encode()) + 16, crc)
        if archive[start + len(new) : start + len(new) + 4] == b"PK\x07\x08":  # data descriptor
            struct.pack_into("<L", archive, start + len(new) + 4, crc)

    return patch


def _rename_storage(archive: bytearray) -> None:
    name = next(n for n in zipfile.ZipFile(io.BytesIO(bytes(archive))).namelist() if "/data/" in n)
    archive[:] = archive.replace(name.encode(), name[:-1].encode() + b"9")


def _shorten_storage(archive: bytearray) -> None:
    name = next(n for n in zipfile.ZipFile(io.BytesIO(bytes(archive))).namelist() if "/data/" in n)
    entry = _central_entry(archive, name.encode())
    for field in (20, 24):  # compressed and file size
        size = struct.unpack_from("<L", archive, entry + field)[0]
        struct.pack_into("<L", archive, entry + field, size - 4)


TAMPERED: dict[str, tuple[Callable[[bytearray], None], str]] = {
    "storage member missing": (_rename_storage, "storage '0' is missing from the archive"),
    "storage member short": (_shorten_storage, "reaches past its storage's bytes"),
    "big-endian": (_member("byteorder", lambda _: b"big   "), "is big-endian"),
    "other dtype": (
        _member("data.pkl", lambda pkl: pkl.replace(b"FloatStorage", b"ShortStorage")),
        "is int16[4, 4], the metadata says float32[4, 4]",
    ),
}


@pytest.mark.parametrize("damage", sorted(TAMPERED))
def test_a_tampered_archive_after_an_identical_one_reads_as_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, damage: str
) -> None:
    """t0 is read first (its walk cached), t1 is damaged, t2 is as t0: each as uncached."""
    directory = _same_shapes(tmp_path / "dcp")
    change, message = TAMPERED[damage]
    [(chunk, _)] = [pair for pair in _chunks(directory) if pair[1].key == "t1"]
    _patch(directory, chunk, change)
    reference, tested = _both(directory, monkeypatch, mode)
    assert tested == reference
    errors = [value for key, value in tested if key == "t1"]
    assert all(isinstance(e, str) and message in e for e in errors), errors
    assert all(not isinstance(value, str) for key, value in tested if key in ("t0", "t2"))
    assert [p for p in tested[-1][1] if p.startswith("t1")], tested[-1]  # verify names it


def _lengthen_storage(archive: bytearray) -> None:
    name = next(n for n in zipfile.ZipFile(io.BytesIO(bytes(archive))).namelist() if "/data/" in n)
    entry = _central_entry(archive, name.encode())
    for field in (20, 24):  # compressed and file size: past the archive, not the data file
        size = struct.unpack_from("<L", archive, entry + field)[0]
        struct.pack_into("<L", archive, entry + field, size + 2000)


def test_a_storage_member_claiming_past_its_archive_reads_as_through_a_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A local window is bounded by its data file's size (a bound that never rejects a valid
    archive): an archive read from memory is bounded the same, so it reads the same."""
    directory = _same_shapes(tmp_path / "dcp")
    [(chunk, _)] = [pair for pair in _chunks(directory) if pair[1].key == "t1"]
    _patch(directory, chunk, _lengthen_storage)
    reference, tested = _both(directory, monkeypatch, mode)
    assert tested == reference
    assert [p for p in tested[-1][1] if p.startswith("t1") and "CRC-32" in p], tested[-1]


def test_a_truncated_archive_reads_as_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    directory = _same_shapes(tmp_path / "dcp")

    def shorten(metadata: Any) -> None:
        index = next(i for i in metadata.storage_data if i.fqn == "t1")
        info = metadata.storage_data[index]
        info.length -= 1  # the archive loses its last byte: its end record is cut

    rewrite_metadata(directory, shorten)
    reference, tested = _both(directory, monkeypatch, mode)
    assert tested == reference
    errors = [value for key, value in tested if key == "t1"]
    assert all(isinstance(e, str) and "corrupt or truncated zip archive" in e for e in errors)


def test_untampered_directories_read_the_same_every_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The committed two-rank fixture (rows and columns split across files) and a save of
    many kinds (bf16, int, bool, 0-dim, empty, a view) and of two shapes sharing a pickle."""
    many = _save(
        tmp_path / "many",
        {"bf16": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "int": torch.arange(5),
         "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
         "empty": torch.zeros(0, 3), "view": torch.arange(10.0)[2:5],
         "a": torch.ones(2, 3), "b": torch.zeros(2, 3), "c": torch.ones(3, 2)},
    )  # fmt: skip
    for directory in (DCP, many):
        reference, tested = _both(directory, monkeypatch, mode)
        assert tested == reference
        assert not any(isinstance(value, str) for _, value in tested[:-1])


def test_byte_ranges_of_a_whole_chunk_read_as_the_rows_give_them(tmp_path: Path) -> None:
    """One read for a tensor stored whole, including ranges that start or end inside an item
    (cut from the first whole item, as the rows are) and a range past the end (an error)."""
    directory = _save(tmp_path / "dcp", {"w": torch.arange(24.0).reshape(2, 3, 4)})
    [(_, storage)] = _chunks(directory)
    expected = torch.arange(24.0).numpy().tobytes()
    files = _files(directory)
    try:
        for start, stop in [(0, 96), (4, 40), (6, 9), (47, 96), (95, 96), (0, 1)]:
            first = start // 4 * 4
            assert files.read(storage, start, stop) == expected[first : first + stop - start]
        with pytest.raises(CkptError, match="do not cover the tensor"):
            files.read(storage, 0, 100)
    finally:
        files.close()


# -- the cache: hits, bound, what it refuses to share ---------------------------------------


def test_identical_pickles_are_walked_once(tmp_path: Path) -> None:
    directory = _same_shapes(tmp_path / "dcp", count=20)
    files = _files(directory)
    try:
        for chunk, storage in _chunks(directory):
            files.chunk_tensor(chunk, storage)
        assert (files.pickles.walks, files.pickles.hits, len(files.pickles)) == (1, 19, 1)
    finally:
        files.close()


def _archive(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _rezip(archive: bytes, change: Callable[[dict[str, bytes]], None]) -> bytes:
    """The archive's members rewritten by ``change`` (a dict name -> bytes), stored."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        members = {name: opened.read(name) for name in opened.namelist()}
    change(members)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as written:
        for name, data in members.items():
            written.writestr(name, data)
    return out.getvalue()


def _read(archive: bytes, cache: torch_zip.PickleCache | None) -> Any:
    try:
        parsed = torch_zip.read_torch_zip(
            dcp_files._ArchiveBytes(bytearray(archive), len(archive)),
            refuse_dangerous=True,
            track_spans=False,
            cache=cache,
        )
    except CkptError as error:
        return f"{type(error).__name__}: {error}"
    return repr(parsed.root), parsed.storages, parsed.details, parsed.pickle


def _storage_member(members: dict[str, bytes]) -> str:
    return next(name for name in members if "/data/" in name)


def _shorter(members: dict[str, bytes]) -> None:
    name = _storage_member(members)
    members[name] = members[name][:-4]


def _larger(members: dict[str, bytes]) -> None:
    name = _storage_member(members)
    members[name] += b"\0" * 4


def _renamed(members: dict[str, bytes]) -> None:
    name = _storage_member(members)
    members[name[:-1] + "7"] = members.pop(name)


def _big(members: dict[str, bytes]) -> None:
    members[next(n for n in members if n.endswith("byteorder"))] = b"big"


def _no_byteorder(members: dict[str, bytes]) -> None:
    del members[next(n for n in members if n.endswith("byteorder"))]


def _double(members: dict[str, bytes]) -> None:
    pkl = next(n for n in members if n.endswith("data.pkl"))
    members[pkl] = members[pkl].replace(b"FloatStorage", b"DoubleStorage")


@pytest.mark.parametrize(
    "change", [_shorter, _larger, _renamed, _big, _no_byteorder, _double, lambda m: None]
)
def test_a_cached_walk_is_used_only_where_it_equals_a_fresh_one(change: Any) -> None:
    """A first archive's walk is cached; a second with the same data.pkl bytes but other
    storages (a member shorter, larger, renamed, big-endian) reads exactly as uncached."""
    first = _archive(torch.arange(16.0))
    second = _rezip(first, change)
    cache = torch_zip.PickleCache()
    assert not isinstance(_read(first, cache), str)
    assert _read(second, cache) == _read(second, None)
    # and a failed or refused replay leaves nothing of it behind: the first reads as before
    assert _read(first, cache) == _read(first, None)


def test_the_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    archives = [_archive(torch.zeros(n)) for n in (1, 2, 3)]  # three different pickles
    cache = torch_zip.PickleCache(entries=2)
    for archive in archives + archives[2:]:
        _read(archive, cache)
    assert (cache.walks, cache.hits, len(cache)) == (3, 1, 2)
    _read(archives[0], cache)  # evicted: walked again
    assert (cache.walks, cache.hits, len(cache)) == (4, 1, 2)


def test_large_pickles_are_not_cached() -> None:
    many: dict[str, torch.Tensor] = {f"tensor_{i:04d}": torch.zeros(1) for i in range(200)}
    buffer = io.BytesIO()
    torch.save(many, buffer)
    assert len(zipfile.ZipFile(buffer).read("archive/data.pkl")) > torch_zip.MAX_CACHED_PICKLE
    cache = torch_zip.PickleCache()
    for _ in range(2):
        _read(buffer.getvalue(), cache)
    assert (cache.walks, cache.hits, len(cache)) == (0, 0, 0)
    small = _archive(torch.zeros(2))
    for _ in range(2):
        _read(small, cache)
    assert (cache.walks, cache.hits, len(cache)) == (1, 1, 1)


class Holder:
    """A value DCP pickles whole: the reader keeps it as an opaque object with its state."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_values_never_share_a_walk(tmp_path: Path) -> None:
    """A value's opaque objects get their tensors' bytes set in place: two values with
    byte-identical pickles stay two trees."""
    state = {"x": Holder(torch.arange(3.0)), "y": Holder(torch.arange(3.0))}
    directory = _save(tmp_path / "dcp", state)
    with open_checkpoint(directory) as ckpt:
        x, y = ckpt.root["x"], ckpt.root["y"]
        assert x is not y and x.state is not y.state
        assert x.state["tensor"].inline_data == torch.arange(3.0).numpy().tobytes()


def test_small_archives_are_read_once_and_large_ones_a_range_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded by MAX_IN_MEMORY: a larger archive goes through a window."""
    directory = _save(tmp_path / "dcp", {"small": torch.ones(4), "large": torch.ones(300_000)})
    lengths: list[int] = []

    def recording(source: Any, length: int, offset: int) -> bytearray:
        lengths.append(length)
        return read_range(source, length, offset)

    monkeypatch.setattr(dcp_files, "read_range", recording)
    files = _files(directory)
    try:
        for chunk, storage in _chunks(directory):
            lengths.clear()
            files.chunk_tensor(chunk, storage)
            if storage.key == "small":
                assert lengths == [chunk.length]
            else:
                assert chunk.length > dcp_files.MAX_IN_MEMORY
                assert lengths and max(lengths) <= 1 << 16, lengths
    finally:
        files.close()
