"""A folder or a zip archive of checkpoint files that no other plug-in names, read as one
checkpoint whose parts are its files.

The rule (docs/formats.md, "Containers of checkpoint files"): a folder without subfolders (a
tree of folders is checkpoints in several places, which ``verify`` walks) holding two or more
files named like checkpoints (:data:`~ckpttool.frameworks.base.CHECKPOINT_SUFFIXES`) that are
not one series (names that differ only by their numbers, ``ckpt-100.pt``, ``ckpt-200.pt``: a
run, which ``trend`` follows) and that no framework before this one knows; or a zip archive no
format reads (no ``data.pkl``: not a ``torch.save`` file, nor torch.package's ``.data/``) with at
least one member named like a checkpoint (stable-baselines3's ``model.zip``: ``policy.pth``,
``policy.optimizer.pth``, ``pytorch_variables.pth`` and a JSON ``data``). Each checkpoint file is
a part named by its file name less the suffix, opened by its own format as a single file is; every
other file is listed as a part without weights (named, never dropped unsaid). A zip member stored
uncompressed is read in place, as a byte range of the archive (:class:`~ckpttool.io.window.
FileWindow`); a compressed one is inflated into memory up to :data:`MAX_INFLATED` bytes, and
refused above that, in one line naming it.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import CorruptCheckpointError, InputError
from ckpttool.frameworks.base import (
    CHECKPOINT_SUFFIXES,
    CONFIG,
    CUSTOM,
    OTHER,
    PARTS,
    FrameworkDirectory,
    Member,
    list_files,
    one_series,
)
from ckpttool.io.source import is_dir, is_url, join, list_dirs

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint

CHECKPOINT_PARTS = "checkpoint_parts"
#: The role of a member that is a part's checkpoint file: the role of a checkpoint file the
#: layout gives no other (``show --json``'s vocabulary of roles)
PART = CUSTOM
#: A compressed zip member is inflated into memory up to this size; a larger one is refused
#: (the reader never holds a whole checkpoint in memory: unzip the archive first).
MAX_INFLATED = 64 << 20
#: More members than this is no archive of checkpoint parts (a bound on what detection reads).
MAX_MEMBERS = 10_000
FOLDER_TITLE = "folder of checkpoint files"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length


@dataclass(frozen=True)
class ZipMember:
    """Where one member's bytes lie in the archive."""

    info: zipfile.ZipInfo
    offset: int  # of its data, after the local header


def detect(path: str) -> FrameworkDirectory | None:
    """The folder or zip archive ``path`` as a container of checkpoint files (the module
    docstring's rule), or None."""
    if is_dir(path):
        return _folder(path)
    if not is_url(path) and os.path.isfile(path):
        return _archive(path)
    return None


def part_name(file: str) -> str:
    """A part's name: its file's name less its checkpoint suffix (``policy.optimizer.pth``:
    ``policy.optimizer``)."""
    for suffix in CHECKPOINT_SUFFIXES:
        if file.endswith(suffix) and len(file) > len(suffix):
            return file[: -len(suffix)]
    return file


def _section(name: str, taken: set[str]) -> str:
    """Where a part's tree goes in the merged tree: a top-level key without dots (a dotted
    section is a path), unique."""
    section = re.sub(r"[./]", "_", name) or "_"
    while section in taken:
        section += "_"
    taken.add(section)
    return section


def _parts(files: dict[str, int], layout: FrameworkDirectory) -> None:
    """Each file of ``files`` a part of ``layout``: a checkpoint file read at its section, any
    other listed."""
    parts: list[dict[str, Any]] = []
    taken: set[str] = set()
    for file, size in files.items():
        name = part_name(file)
        section = _section(name, taken)
        if file.endswith(CHECKPOINT_SUFFIXES):
            layout.members.append(Member(file, PART, section, size))
            kind = ""  # its format, once opened
        else:
            json = file.endswith(".json") or file == "data"  # stable-baselines3's data is JSON
            layout.members.append(Member(file, CONFIG if json else OTHER, None, size))
            kind = "not a checkpoint"
        parts.append({"name": name, "file": file, "folder": "", "type": kind,
                      "prefix": f"{section}.", "section": section, "tensors": 0})  # fmt: skip
    layout.details[PARTS] = parts


def _folder(path: str) -> FrameworkDirectory | None:
    files = {n: s for n, s in list_files(path).items() if not n.startswith(".")}
    names = [n for n in files if n.endswith(CHECKPOINT_SUFFIXES)]
    if len(names) < 2 or one_series(names):
        return None
    if any(not name.startswith(".") for name in list_dirs(path)):
        return None  # a tree of folders: checkpoints in several places, which verify walks
    layout = FrameworkDirectory(
        kind=CHECKPOINT_PARTS,
        title=FOLDER_TITLE,
        directory=path,
        members=[],
    )
    _parts(files, layout)
    layout.opener = _opener(layout, lambda name: _open_file(join(path, name)))
    return layout


def _archive(path: str) -> FrameworkDirectory | None:
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"PK\x03\x04":
                return None
            archive = zipfile.ZipFile(handle)
            infos = [info for info in archive.infolist() if not info.is_dir()]
            if len(infos) > MAX_MEMBERS:
                return None
            names = [info.filename for info in infos]
            if any(_torch_archive_name(name) for name in names) or not any(
                name.endswith(CHECKPOINT_SUFFIXES) for name in names
            ):
                return None  # a format's archive: its own refusal stands
            if len(set(names)) != len(names):
                duplicate = next(n for n in names if names.count(n) > 1)
                raise CorruptCheckpointError(f"the zip archive has two members named {duplicate!r}")
            size = os.fstat(handle.fileno()).st_size
            members = {info.filename: _locate(handle, info, size) for info in infos}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError):
        return None  # not a zip this reader can list: the formats' refusal stands
    layout = FrameworkDirectory(
        kind=CHECKPOINT_PARTS,
        title="zip archive of checkpoint files",
        directory=path,
        members=[],
        found=members,
    )
    _parts({name: members[name].info.file_size for name in names}, layout)
    layout.opener = _opener(layout, lambda name: _open_member(path, members[name]))
    return layout


def _torch_archive_name(name: str) -> bool:
    """A record of an archive a format reads, or refuses by name: ``data.pkl`` (torch.save,
    TorchScript), torch.package's ``.data/``."""
    last = name.rsplit("/", 1)[-1]
    return last.lower() == "data.pkl" or name.startswith(".data/") or "/.data/" in name


def _locate(handle: Any, info: zipfile.ZipInfo, size: int) -> ZipMember:
    handle.seek(info.header_offset)
    header = handle.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size:
        raise ValueError("truncated")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise ValueError("no local header")
    offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if offset + info.compress_size > size:
        raise ValueError("truncated")
    return ZipMember(info, offset)


def _opener(layout: FrameworkDirectory, open_part: Any) -> Any:
    """How the tree reader opens a part's file: by its own format, as a single file; the part
    then says which format that was."""
    listed: list[dict[str, Any]] = layout.details[PARTS]  # type: ignore[assignment]
    parts = {part["file"]: part for part in listed}

    def opener(name: str, strict: bool, refuse_dangerous: bool) -> Checkpoint:
        ckpt: Checkpoint = open_part(name)(strict, refuse_dangerous)
        parts[name]["type"] = ckpt.format
        return ckpt

    return opener


def _open_file(path: str) -> Any:
    from ckpttool.frameworks.base import open_member

    return lambda strict, refuse: open_member(path, strict=strict, refuse_dangerous=refuse)


def _open_member(archive: str, member: ZipMember) -> Any:
    """A zip member opened as a file: its byte range of the archive when stored, its inflated
    bytes when compressed and small."""
    from ckpttool.formats.registry import open_file
    from ckpttool.io.window import FileWindow, MemoryWindow

    info = member.info
    shown = f"{archive}/{info.filename}"

    def open_it(strict: bool, refuse_dangerous: bool) -> Checkpoint:
        window: Any
        if info.compress_type == zipfile.ZIP_STORED:
            window = FileWindow(archive, member.offset, info.compress_size, shown)
        else:
            window = MemoryWindow(inflated(archive, info), shown)
        if window.size == 0:
            window.close()
            raise CorruptCheckpointError(f"{shown}: the member is empty")
        return open_file(shown, window, strict, refuse_dangerous, False)

    return open_it


def inflated(archive: str, info: zipfile.ZipInfo) -> bytes:
    """A compressed member's bytes, CRC-checked, when it is at most :data:`MAX_INFLATED`."""
    if info.file_size > MAX_INFLATED:
        raise InputError(
            f"{archive}: member {info.filename} is compressed ({info.file_size:,} bytes "
            f"inflated); ckpttool reads compressed members of up to {MAX_INFLATED >> 20} MiB "
            "(unzip the archive and name the file)"
        )
    try:
        with zipfile.ZipFile(archive) as opened:
            return opened.read(info.filename)
    except (zipfile.BadZipFile, zlib.error, NotImplementedError) as error:
        raise CorruptCheckpointError(f"{archive}: member {info.filename}: {error}") from None


def stored_crc(archive: str, member: ZipMember) -> int:
    """The CRC-32 of a member's bytes as the archive holds them (a stored member's own bytes)."""
    from ckpttool.io.source import read_at

    crc = 0
    chunk = 8 << 20
    fd = os.open(archive, os.O_RDONLY)
    try:
        for start in range(0, member.info.compress_size, chunk):
            length = min(chunk, member.info.compress_size - start)
            crc = zlib.crc32(read_at(fd, length, member.offset + start), crc)
    finally:
        os.close(fd)
    return crc
