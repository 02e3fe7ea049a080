"""A strict, read-only zip directory: what reading a torch.save archive needs, and no more.

``zipfile`` parses the central directory well, but importing it pulls in ``shutil``, ``bz2``,
``lzma``, ``threading`` and ``pathlib``: about a tenth of ``ckpttool show``'s run time, spent
before the file is opened. A torch archive needs much less: find the end-of-directory record
(zip64 included), list the members, and read a small member (``data.pkl``) whole. This module
does that with ``struct`` and ``zlib``. Its members have the attribute names of
``zipfile.ZipInfo`` (``filename``, ``header_offset``, ``compress_type``, ``CRC``...), so code
that walks an archive reads the same with either.

Everything the directory claims is checked before it is used: where the directory starts and
how long it is, each entry's lengths, the zip64 extra field, and a member's bytes against the
end of the file.

The directory is found as ``torch.load``'s reader (miniz, in caffe2's PyTorchStreamReader)
finds it: the last end record with a whole record's room after it, the zip64 end record where
the locator points, the directory at the offset the end record gives. Where another reader
(Python's ``zipfile``, which shifts offsets by data it supposes in front of the archive and
takes the zip64 record just before the locator) would find something else, the archive reads
two ways: :class:`AmbiguousZipError`. Names are looked up as miniz looks them up, ignoring
ASCII case (:meth:`ZipIndex.find`); two records whose names differ only in case are ambiguous.
"""

from __future__ import annotations

import itertools
import struct
import threading
import zlib
from typing import BinaryIO, NamedTuple

from ckpttool.io.crc import crc32

# A file's handle is shared by the threads of --jobs (a directory's members read ahead): a seek
# and the read after it must not interleave with another thread's, or one reads the other's
# bytes ("has no local header"). The reads under it are small (a header, data.pkl); a tensor's
# bytes are read by position (pread), outside it.
_SEEK_READ = threading.RLock()  # re-entrant: a handle may be a window read through another

ZIP_STORED = 0
ZIP_DEFLATED = 8

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
# One central directory entry ("<4s4B4HL2L5H2L"), 46 bytes, as read: the signature, extract
# version, flags, method, CRC, compressed and file size, name/extra/comment lengths and local
# header offset; the versions made by, times, disk and attributes skipped as padding.
_CENTRAL_READ = struct.Struct("<4s2xBxHH4xLLLHHH8xL")
LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a member's local header
_LOCAL_HEADER_MOST = LOCAL_HEADER.size + 2 * 0xFFFF  # with the longest name and extra field
_MAX_COMMENT = 0xFFFF
# A torch archive's directory holds one ~100-byte entry per storage: a few MB for the largest
# models. A claim past this is a damaged or hostile end record; it is refused, not read.
MAX_DIRECTORY = 256 << 20
_MAX_EXTRACT_VERSION = 63  # what zipfile accepts: zip64, deflate, bzip2, lzma
_UTF8_NAMES = 0x800
_ENCRYPTED = 0x1
_PATCHED = 0x20
_STRONG_ENCRYPTION = 0x40


class BadZipError(ValueError):
    """The bytes are not a zip archive this module can read (the message says why)."""


class AmbiguousZipError(BadZipError):
    """The archive reads two ways: two zip readers would see different records (the message
    names both readings)."""


_ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def fold(name: str) -> str:
    """``name`` as miniz compares names (``mz_zip_reader_locate_file`` without its
    case-sensitive flag, as torch calls it): ASCII letters in lower case."""
    return name.translate(_ASCII_FOLD)


def case_collision(names: list[str]) -> tuple[str, str] | None:
    """Two different names that torch's reader cannot tell apart (they differ only in ASCII
    case): which of them a lookup finds depends on its binary search, not on the file order."""
    joined = "\n".join(names)
    if joined.translate(_ASCII_FOLD) == joined:  # no upper case (what torch writes): no two
        return None
    seen: dict[str, str] = {}
    for name in names:
        folded = fold(name)
        other = seen.setdefault(folded, name)
        if other != name:
            return other, name
    return None


class ZipMember(NamedTuple):
    """One central directory entry (field names as ``zipfile.ZipInfo``'s)."""

    filename: str
    header_offset: int  # where the member's local header starts in the file
    compress_type: int  # 0 stored (what torch writes), 8 deflated, ...
    compress_size: int  # bytes stored in the file
    file_size: int  # bytes once inflated
    CRC: int  # CRC-32 of the inflated bytes
    flag_bits: int


def _name_encoding(flags: int) -> str:
    """The zip spec's rule, as zipfile follows it: UTF-8 under flag bit 11, else cp437."""
    return "utf-8" if flags & _UTF8_NAMES else "cp437"


def _decode_name(raw: bytes, flags: int) -> str:
    if b"\x00" in raw:  # zipfile cuts the name there: two names for one record
        raise BadZipError(f"a member name holds a NUL byte ({raw[:60]!r})")
    if raw.isascii():  # what torch writes; both encodings agree on ASCII
        return raw.decode("ascii")
    return raw.decode(_name_encoding(flags))


def encoded_name(member: ZipMember) -> bytes:
    """``member``'s name as the archive stores it (cp437 round-trips every byte)."""
    name = member.filename
    if name.isascii():  # what torch writes (once per tensor); both encodings agree on ASCII
        return name.encode("ascii")
    return name.encode(_name_encoding(member.flag_bits))


class ZipIndex:
    """The central directory of the zip archive read through ``handle`` (seekable)."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.size = handle.seek(0, 2)
        start_dir, dir_size, count = self._find_directory()
        self.filelist: list[ZipMember] = self._read_directory(start_dir, dir_size, count)
        self.directory_start = start_dir
        self.NameToInfo: dict[str, ZipMember] = {m.filename: m for m in self.filelist}
        self._folded: dict[str, ZipMember] | None = None
        # torch.save with torch.serialization.config.save.compute_crc32 = False writes 0 for
        # every CRC (torch.load never checks them): nothing to check a record's bytes against
        self.crc_computed = any(m.CRC for m in self.filelist) or not self.filelist

    @property
    def handle(self) -> BinaryIO:
        """What the directory was read through (its members are read through it too)."""
        return self._handle

    # -- zipfile.ZipFile's read-side names ----------------------------------------------------
    def infolist(self) -> list[ZipMember]:
        return list(self.filelist)

    def namelist(self) -> list[str]:
        return [member.filename for member in self.filelist]

    def find(self, name: str) -> ZipMember | None:
        """The record torch's reader finds under ``name`` (ASCII case ignored); None if none.
        Unique only where :func:`case_collision` finds no two names."""
        member = self.NameToInfo.get(name)
        if member is not None:
            return member
        if self._folded is None:
            self._folded = {fold(m.filename): m for m in self.filelist}
        return self._folded.get(fold(name))

    def getinfo(self, name: str) -> ZipMember:
        member = self.NameToInfo.get(name)
        if member is None:
            raise KeyError(f"there is no item named {name!r} in the archive")
        return member

    def regions(self) -> dict[str, tuple[int, int]]:
        """Member name -> (offset, length) of the bytes from its local header to the next
        member's (or the central directory), known without reading: where its header and data
        lie, for a remote file to fetch in few large requests (a hint: a record's real span is
        still read from its local header). Capped at what a header may hold and the data."""
        starts = sorted({m.header_offset for m in self.filelist} | {self.directory_start})
        following = dict(itertools.pairwise(starts))
        regions = {}
        for member in self.filelist:
            most = _LOCAL_HEADER_MOST + member.compress_size
            stop = following.get(member.header_offset, member.header_offset)
            regions[member.filename] = (
                member.header_offset,
                min(stop - member.header_offset, most),
            )
        return regions

    # -- parsing -----------------------------------------------------------------------------
    def _pread(self, offset: int, length: int) -> bytes:
        with _SEEK_READ:
            self._handle.seek(offset)
            return self._handle.read(length)

    def _find_directory(self) -> tuple[int, int, int]:
        """(offset, byte length, entry count) of the central directory, as miniz finds it."""
        if self.size < _EOCD.size:
            raise BadZipError("File is not a zip file (too short)")
        # No archive comment (torch.save writes none): the record is the last 22 bytes, as
        # zipfile tries first and miniz finds it. Only otherwise search the comment's 64 KiB,
        # which over a URL would fetch the last tensors' bytes of a small file.
        tail_start = self.size - _EOCD.size
        tail = self._pread(tail_start, _EOCD.size)
        if tail[:4] == b"PK\x05\x06" and tail[-2:] == b"\x00\x00":
            at = 0
        else:
            tail_start = max(0, self.size - _EOCD.size - _MAX_COMMENT)
            tail = self._pread(tail_start, self.size - tail_start)
            at = _end_record(tail)
        (_, disk, dir_disk, disk_count, count, dir_size, dir_offset, _) = _EOCD.unpack_from(
            tail, at
        )
        location = tail_start + at
        zip64 = False
        if location >= _EOCD64_LOCATOR.size:
            locator = self._pread(location - _EOCD64_LOCATOR.size, _EOCD64_LOCATOR.size)
            signature, locator_disk, record_at, disks = _EOCD64_LOCATOR.unpack(locator)
            if signature == b"PK\x06\x07":
                if locator_disk != 0 or disks != 1:
                    raise BadZipError("zip archives that span several disks are not supported")
                before = location - _EOCD64_LOCATOR.size - _EOCD64.size
                if record_at != before:
                    raise AmbiguousZipError(
                        f"the zip64 locator points at byte {record_at:,} for the zip64 end "
                        f"record (torch's reader reads it there), zipfile reads the one at "
                        f"byte {before:,}, just before the locator"
                    )
                record = self._pread(record_at, _EOCD64.size) if record_at >= 0 else b""
                if len(record) == _EOCD64.size and record[:4] == b"PK\x06\x06":
                    fields = _EOCD64.unpack(record)
                    disk, dir_disk, disk_count, count, dir_size, dir_offset = (
                        fields[4], fields[5], fields[6], fields[7], fields[8], fields[9],
                    )  # fmt: skip
                    zip64 = True
        if disk != 0 or dir_disk != 0:
            raise BadZipError("zip archives that span several disks are not supported")
        if disk_count != count:
            raise BadZipError(
                f"the end record counts {count} entries in all but {disk_count} on its disk"
            )
        # zipfile shifts every offset by data it supposes in front of the archive (a zip
        # appended to another file); miniz reads the directory where the record says
        directory_end = location - (_EOCD64.size + _EOCD64_LOCATOR.size if zip64 else 0)
        self.concat = directory_end - dir_size - dir_offset
        if self.concat != 0:
            raise AmbiguousZipError(
                f"the end record puts the central directory at byte {dir_offset:,} (torch's "
                f"reader reads it there) but it ends {self.concat:+,} bytes from there, where "
                f"zipfile reads it (at byte {dir_offset + self.concat:,})"
            )
        start_dir = dir_offset
        if start_dir < 0 or dir_size < 0:
            raise BadZipError("Bad offset for central directory")
        if dir_size > MAX_DIRECTORY:
            raise BadZipError(f"the central directory claims {dir_size:,} bytes")
        return start_dir, dir_size, count

    def _read_directory(self, start_dir: int, dir_size: int, count: int) -> list[ZipMember]:
        data = self._pread(start_dir, dir_size)
        if len(data) != dir_size:
            raise BadZipError("Truncated central directory")
        members: list[ZipMember] = []
        append = members.append
        unpack = _CENTRAL_READ.unpack_from
        entry_size = _CENTRAL_READ.size
        make = tuple.__new__  # ZipMember(...) without its Python-level __new__ (one per tensor)
        concat = self.concat
        pos = 0
        while pos < dir_size:
            if pos + entry_size > dir_size:
                raise BadZipError("Truncated central directory")
            (signature, extract_version, flags, method, crc, compressed, size, name_len, extra_len,
             comment_len, offset) = unpack(data, pos)  # fmt: skip
            if signature != b"PK\x01\x02":
                raise BadZipError("Bad magic number for central directory")
            if extract_version > _MAX_EXTRACT_VERSION:
                raise BadZipError(f"zip file version {extract_version / 10:.1f} is not supported")
            name_at = pos + entry_size
            name_end = name_at + name_len
            pos = name_end + extra_len + comment_len
            if pos > dir_size:  # zipfile reads such an entry short; it is corrupt
                raise BadZipError(
                    f"the directory entry at byte {name_at - entry_size} runs past its end"
                )
            raw = data[name_at:name_end]
            if raw.isascii() and b"\x00" not in raw:  # what torch writes (_decode_name's rule)
                name = raw.decode("ascii")
            else:
                name = _decode_name(raw, flags)
            if max(size, compressed, offset) == 0xFFFFFFFF:  # any of them (4-byte fields)
                extra = data[name_end : name_end + extra_len]
                size, compressed, offset = _zip64_extra(extra, size, compressed, offset)
            elif extra_len:
                _check_extra(data, name_end, extra_len)
            append(make(ZipMember, (name, offset + concat, method, compressed, size, crc, flags)))
        if len(members) != count:  # miniz reads ``count`` entries, zipfile all of them
            raise BadZipError(
                f"the central directory lists {len(members)} entries, its end record says {count}"
            )
        return members

    # -- reading a member --------------------------------------------------------------------
    def local_header(self, member: ZipMember) -> LocalHeader:
        """``member``'s local header as it is, for a caller that compares it (``verify``)."""
        return parse_local_header(self._handle, member)

    def data_offset(self, member: ZipMember, as_torch: bool = False) -> int:
        """Where ``member``'s bytes start, from its local header (checked against the entry;
        ``as_torch``: whatever name it gives, as miniz reads it)."""
        if as_torch:
            header = parse_local_header(self._handle, member)
        else:
            header = read_local_header(self._handle, member)
        either = header.flags | member.flag_bits  # zipfile goes by the directory's; either will do
        if either & (_ENCRYPTED | _STRONG_ENCRYPTION):
            raise BadZipError(f"{member.filename}: the member is encrypted")
        if either & _PATCHED:
            raise BadZipError(f"{member.filename}: compressed patched data is not supported")
        return header.data_start

    def read(self, member: ZipMember, as_torch: bool = False) -> bytes:
        """A member's bytes, inflated and CRC-checked (callers bound ``file_size`` first).

        ``as_torch`` reads them as torch's reader (miniz) does for ``torch.load``: the local
        header's name is not compared with the directory's and the CRC-32 is not checked
        (``torch.load`` runs a ``data.pkl`` whose CRC is wrong, or whose local header names
        another file: measured with torch 2.13). ``scan`` reads so, to walk the pickle torch
        runs."""
        start = self.data_offset(member, as_torch)
        if start + member.compress_size > self.size:
            raise BadZipError(f"{member.filename}: the file ends inside this member")
        raw = self._pread(start, member.compress_size)
        if member.compress_type == ZIP_STORED:
            if member.compress_size != member.file_size:
                raise BadZipError(f"{member.filename}: stored size differs from its length")
            data = raw
        elif member.compress_type == ZIP_DEFLATED:
            inflater = zlib.decompressobj(-15)
            data = inflater.decompress(raw, member.file_size + 1)  # bounded, whatever it holds
            if len(data) != member.file_size:
                raise BadZipError(f"{member.filename}: inflates to a different size")
        else:
            raise BadZipError(
                f"{member.filename}: compression method {member.compress_type} is not supported"
            )
        if self.crc_computed and not as_torch and crc32(data) != member.CRC:
            raise BadZipError(f"Bad CRC-32 for file {member.filename!r}")
        return data


def _end_record(tail: bytes) -> int:
    """Where in ``tail`` (the file's last bytes) the end-of-central-directory record is, as
    miniz finds it: the last signature with a whole record's room after it. One that another
    reader takes instead makes the archive ambiguous: a signature in the last 21 bytes
    (``zipfile`` takes it, and fails), or an earlier record whose comment length reaches the
    file's end exactly (a reader that accepts the first such record takes it)."""
    signature = b"PK\x05\x06"
    at = tail.rfind(signature)
    close = at >= 0 and at + _EOCD.size > len(tail)
    if close:
        at = tail.rfind(signature, 0, at + len(signature) - 1)
    if at < 0:
        raise BadZipError("File is not a zip file (no end of central directory record)")
    if close:
        raise AmbiguousZipError(
            "an end-of-central-directory signature in the last 21 bytes of the file, too "
            "close for a record (zipfile takes it, and fails; torch's reader takes the one "
            f"{len(tail) - at} bytes before the end)"
        )
    earlier = tail.rfind(signature, 0, at + len(signature) - 1)
    while earlier >= 0:
        (comment,) = struct.unpack_from("<H", tail, earlier + 20)
        if earlier + _EOCD.size + comment == len(tail):
            raise AmbiguousZipError(
                f"two end-of-central-directory records, {at - earlier} bytes apart, each "
                "reaching the end of the file (torch's reader takes the last)"
            )
        earlier = tail.rfind(signature, 0, earlier + len(signature) - 1)
    return at


class LocalHeader(NamedTuple):
    """A member's local header: where its bytes start, and what ``verify`` compares."""

    data_start: int  # where the member's bytes start in the file
    method: int  # compression method the local header gives
    flags: int
    crc: int  # CRC-32 it gives (0 when flag bit 3 defers it to a data descriptor)
    raw_name: bytes  # the name as stored, decoded by ``flags`` as the directory's names are

    def names(self, member: ZipMember) -> bool:
        """Whether this header names ``member`` as the central directory does."""
        try:
            return _decode_name(self.raw_name, self.flags) == member.filename
        except ValueError:  # a NUL byte, or bytes that are not UTF-8 under the UTF-8 flag
            return False


def parse_local_header(handle: BinaryIO, member: ZipMember) -> LocalHeader:
    """``member``'s local header as the file holds it: found and whole, not yet compared."""
    name = member.filename
    if member.header_offset < 0:
        raise BadZipError(f"record {name!r} has a negative offset")
    with _SEEK_READ:
        handle.seek(member.header_offset)
        header = handle.read(LOCAL_HEADER.size)
        raw_name = (
            handle.read(int.from_bytes(header[26:28], "little")) if len(header) >= 28 else b""
        )
    if len(header) != LOCAL_HEADER.size:
        raise BadZipError(f"record {name!r} is cut off (truncated file)")
    (signature, _, flags, method, _, _, crc, _, _, name_len,
     extra_len) = LOCAL_HEADER.unpack(header)  # fmt: skip
    if signature != b"PK\x03\x04":
        raise BadZipError(f"record {name!r} has no local header")
    data_start = member.header_offset + LOCAL_HEADER.size + name_len + extra_len
    return LocalHeader(data_start, method, flags, crc, raw_name)


def read_local_header(handle: BinaryIO, member: ZipMember) -> LocalHeader:
    """A member's local header, checked against its directory entry (offset, magic, name)."""
    header = parse_local_header(handle, member)
    if not header.names(member):
        raise BadZipError(
            f"the zip's central directory says {member.filename!r} where the local header says "
            f"{header.raw_name!r}"
        )
    return header


def _check_extra(data: bytes, at: int, length: int) -> None:
    """Extra fields are (id, size, payload) records; one that overruns the field is corrupt."""
    end = at + length
    while end - at >= 4:
        field_id, field_len = struct.unpack_from("<HH", data, at)
        at += 4 + field_len
        if at > end:
            raise BadZipError(f"Corrupt extra field {field_id:04x} (size={field_len})")


def _zip64_extra(extra: bytes, size: int, compressed: int, offset: int) -> tuple[int, int, int]:
    """The 64-bit sizes and offset that replace 0xFFFFFFFF in an entry (zip64 extra field)."""
    _check_extra(extra, 0, len(extra))
    at = 0
    while len(extra) - at >= 4:
        field_id, field_len = struct.unpack_from("<HH", extra, at)
        payload = extra[at + 4 : at + 4 + field_len]
        at += 4 + field_len
        if field_id != 0x0001:
            continue
        values = list(struct.unpack_from(f"<{len(payload) // 8}Q", payload))
        try:
            if size == 0xFFFFFFFF:
                size = values.pop(0)
            if compressed == 0xFFFFFFFF:
                compressed = values.pop(0)
            if offset == 0xFFFFFFFF:
                offset = values.pop(0)
        except IndexError:
            raise BadZipError("Corrupt zip64 extra field") from None
    return size, compressed, offset


__all__ = [
    "LOCAL_HEADER", "ZIP_DEFLATED", "ZIP_STORED", "AmbiguousZipError", "BadZipError",
    "LocalHeader", "ZipIndex", "ZipMember", "case_collision", "encoded_name", "fold",
    "parse_local_header", "read_local_header",
]  # fmt: skip
