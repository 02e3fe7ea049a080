"""formats.zip_index against zipfile: the same directory on every archive, never more lenient.

The reader lists torch archives with its own small zip directory parser (importing zipfile
costs a tenth of ``show``'s run). zipfile is the reference: on every committed zip fixture and
on thousands of mutated ones, ZipIndex must list the same members (name, offsets, sizes, CRC,
flags) and read the same bytes, or refuse. It may refuse more than zipfile in the ways listed
in STRICTER (a multi-disk end record, an entry count that disagrees with the directory, a
member name with a NUL byte, which zipfile silently cuts short, a directory over 256 MB, an
entry whose name or comment runs past the directory, which zipfile reads short) and
when reading a member whose local header contradicts the directory; it may never accept an
archive zipfile rejects, nor return bytes zipfile would not. Where zipfile and torch's reader
(miniz) would find different directories, it refuses the archive as ambiguous
(AmbiguousZipError: tests/test_containers.py holds those cases).
"""

from __future__ import annotations

import io
import random
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpttool.formats.torch_zip.zip_index import AmbiguousZipError, BadZipError, ZipIndex
from tests.support.fuzz_targets import MUTATIONS, mutate
from tests.support.helpers import FIXTURES, fixture_files

ZIP_FIXTURES = [p for p in fixture_files() if p.read_bytes()[:4] == b"PK\x03\x04"]
STRICTER = (
    "span several disks", "entries, its end record says", "NUL byte", "directory claims",
    "runs past its end", "on its disk",
)  # fmt: skip
FIELDS = ("filename", "header_offset", "compress_type", "compress_size", "file_size", "CRC",
          "flag_bits")  # fmt: skip
MAX_READ = 1 << 20


def _reference(data: bytes) -> list[tuple[object, ...]] | None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return [tuple(getattr(info, f) for f in FIELDS) for info in archive.infolist()]
    except Exception:  # everything zipfile raises on a bad archive means "rejected"
        return None


def _check_against_zipfile(data: bytes) -> None:
    expected = _reference(data)
    try:
        index = ZipIndex(io.BytesIO(data))
    except AmbiguousZipError:  # zipfile reads one directory, torch's reader another
        return
    except BadZipError as error:
        assert expected is None or any(s in str(error) for s in STRICTER), str(error)
        return
    except (ValueError, struct.error, zlib.error):  # e.g. an undecodable UTF-8 name
        assert expected is None
        return
    assert expected is not None, "ZipIndex accepted a directory zipfile rejects"
    assert [tuple(m) for m in index.infolist()] == expected
    reference = zipfile.ZipFile(io.BytesIO(data))
    for member, info in zip(index.infolist(), reference.infolist()):  # the same, checked above
        if member.file_size > MAX_READ:
            continue
        try:
            wanted: bytes | None = reference.read(info)  # by entry: names may repeat
        except Exception:
            wanted = None
        try:
            got: bytes | None = index.read(member)
        except (BadZipError, ValueError, zlib.error):
            got = None
        if got is not None:  # refusing is allowed; other bytes than zipfile's are not
            assert got == wanted, member.filename


@pytest.mark.parametrize("path", ZIP_FIXTURES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_same_directory_and_bytes_as_zipfile(path: Path) -> None:
    index = ZipIndex(io.BytesIO(path.read_bytes()))
    with zipfile.ZipFile(path) as reference:
        assert [tuple(m) for m in index.infolist()] == [
            tuple(getattr(info, f) for f in FIELDS) for info in reference.infolist()
        ]
        for member, info in zip(index.infolist(), reference.infolist()):
            if member.file_size <= MAX_READ:
                assert index.read(member) == reference.read(info)


def test_zip_fixtures_exist() -> None:
    assert len(ZIP_FIXTURES) >= 10


def _zip(
    entries: dict[str, bytes], *, compression: int = zipfile.ZIP_STORED, **kw: object
) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression, **kw) as archive:  # type: ignore[arg-type]
        for name, payload in entries.items():
            archive.writestr(name, payload)
    return buffer.getvalue()


def test_zip64_deflated_comment_and_prefix() -> None:
    """What torch never writes but a re-zipped file may hold: each read as zipfile reads it,
    but for data in front of the archive: zipfile shifts the directory's offset by it, torch's
    reader does not, so the two read different bytes as the directory (refused, ambiguous)."""
    entries = {"archive/data.pkl": b"\x80\x02}q\x00.", "archive/data/0": bytes(range(256)) * 8}
    deflated = _zip(entries, compression=zipfile.ZIP_DEFLATED)
    forced64 = io.BytesIO()
    with zipfile.ZipFile(forced64, "w") as archive:
        for name, payload in entries.items():
            with archive.open(name, "w", force_zip64=True) as member:
                member.write(payload)
    commented = io.BytesIO()
    with zipfile.ZipFile(commented, "w") as archive:
        archive.comment = b"an archive comment moves the end record away from the end"
        archive.writestr("archive/data.pkl", b"\x80\x02N.")
    with pytest.raises(AmbiguousZipError, match="where zipfile reads it"):
        ZipIndex(io.BytesIO(b"#!prefix\n" + deflated))
    for data in (deflated, forced64.getvalue(), commented.getvalue()):
        _check_against_zipfile(data)
        index = ZipIndex(io.BytesIO(data))
        assert index.read(index.getinfo("archive/data.pkl")) in (b"\x80\x02}q\x00.", b"\x80\x02N.")


def test_refusals() -> None:
    stored = _zip({"archive/data.pkl": b"\x80\x02N."})
    with pytest.raises(BadZipError, match="not a zip file"):
        ZipIndex(io.BytesIO(b"PK\x03\x04 but nothing else"))
    with pytest.raises(BadZipError, match="not a zip file"):
        ZipIndex(io.BytesIO(stored[:-5]))  # the end record cut short
    bad_crc = bytearray(stored)
    bad_crc[bad_crc.index(b"\x80\x02N.")] ^= 1
    index = ZipIndex(io.BytesIO(bytes(bad_crc)))
    with pytest.raises(BadZipError, match="CRC"):
        index.read(index.getinfo("archive/data.pkl"))
    with pytest.raises(KeyError):
        index.getinfo("archive/missing")


def test_deflate_bomb_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member inflating past its declared size yields at most file_size + 1 bytes, then fails."""
    from ckpttool.formats.torch_zip import zip_index

    produced: list[int] = []
    real_decompressobj = zlib.decompressobj

    class Recording:
        def __init__(self, wbits: int) -> None:
            self.inner = real_decompressobj(wbits)

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self.inner.decompress(data, max_length)
            produced.append(len(out))
            return out

    data = _zip({"archive/data.pkl": bytes(1 << 20)}, compression=zipfile.ZIP_DEFLATED)
    index = ZipIndex(io.BytesIO(data))
    lying = index.getinfo("archive/data.pkl")._replace(file_size=100)  # inflates to 1 MiB
    monkeypatch.setattr(zip_index.zlib, "decompressobj", Recording)
    with pytest.raises(BadZipError, match="different size"):
        index.read(lying)
    assert produced and max(produced) <= 101


def _with_zip64_extra(data: bytes) -> bytes:
    """A one-member stored archive whose directory entry gives its sizes and offset as
    0xFFFFFFFF and the real values in a zip64 extra field, as for members past 4 GiB."""
    eocd = data.rindex(b"PK\x05\x06")
    dir_size, dir_offset = struct.unpack_from("<LL", data, eocd + 12)
    entry = bytearray(data[dir_offset : dir_offset + dir_size])
    crc, compressed, size = struct.unpack_from("<3L", entry, 16)
    name_len, extra_len = struct.unpack_from("<HH", entry, 28)
    offset = struct.unpack_from("<L", entry, 42)[0]
    assert extra_len == 0 and len(entry) == 46 + name_len
    extra = struct.pack("<HHQQQ", 0x0001, 24, size, compressed, offset)
    struct.pack_into("<3L", entry, 16, crc, 0xFFFFFFFF, 0xFFFFFFFF)
    struct.pack_into("<H", entry, 30, len(extra))
    struct.pack_into("<L", entry, 42, 0xFFFFFFFF)
    end = bytearray(data[eocd:])
    struct.pack_into("<L", end, 12, dir_size + len(extra))
    return data[:dir_offset] + bytes(entry) + extra + bytes(end)


def test_zip64_extra_field_gives_sizes_and_offset() -> None:
    payload = bytes(range(256)) * 4
    data = _with_zip64_extra(_zip({"archive/data/0": payload}))
    with zipfile.ZipFile(io.BytesIO(data)) as reference:  # the crafted entry is valid zip64
        assert reference.read("archive/data/0") == payload
    _check_against_zipfile(data)
    index = ZipIndex(io.BytesIO(data))
    member = index.getinfo("archive/data/0")
    assert (member.file_size, member.compress_size, member.header_offset) == (1024, 1024, 0)
    assert index.read(member) == payload
    truncated = data.replace(struct.pack("<HH", 0x0001, 24), struct.pack("<HH", 0x0001, 8), 1)
    with pytest.raises(BadZipError):  # the field is now shorter than its record says
        ZipIndex(io.BytesIO(truncated))


@pytest.mark.slow
@settings(
    max_examples=3000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(
    seed=st.integers(0, len(ZIP_FIXTURES) - 1),
    steps=st.lists(
        st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**32)), min_size=1, max_size=3
    ),
)
def test_mutated_archives_never_more_lenient_than_zipfile(
    seed: int, steps: list[tuple[str, int]]
) -> None:
    data = ZIP_FIXTURES[seed].read_bytes()
    others = [p.read_bytes() for p in ZIP_FIXTURES[:3]]
    for kind, salt in steps:
        data = mutate(data, kind, random.Random(salt), others)
    _check_against_zipfile(data)


@pytest.mark.filterwarnings("ignore:Duplicate name")  # the corpus writes one on purpose
def test_hostile_corpus_archives(tmp_path: Path) -> None:
    """The hardening corpus (zip bomb, size lies, duplicates, bad CRC...): as zipfile, or refused."""
    from tests.support.adversarial import corpus

    archives = {n: d for n, d in corpus(tmp_path / "marker").items() if d[:2] == b"PK"}
    assert len(archives) > 20
    for data in archives.values():
        _check_against_zipfile(data)


def test_directory_size_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory larger than MAX_DIRECTORY is refused before it is read into memory."""
    from ckpttool.formats.torch_zip import zip_index

    data = ZIP_FIXTURES[0].read_bytes()
    ZipIndex(io.BytesIO(data))  # within the limit
    monkeypatch.setattr(zip_index, "MAX_DIRECTORY", 64)
    with pytest.raises(BadZipError, match="directory claims"):
        ZipIndex(io.BytesIO(data))
