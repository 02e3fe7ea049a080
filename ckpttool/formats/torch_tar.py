"""torch's pre-0.4 tar format: recognised as ``torch.load`` recognises it, walked by ``scan``.

``torch.load`` still reads it (``_legacy_load`` tries ``tarfile.open`` on every non-zip file
before it reads a pickle stream, and goes on to the stream only on a ``tarfile.TarError``):
members ``storages`` (a count, then per storage a pickle ``(key, location, storage_type)`` and
its bytes, then a pickle of storage views), ``tensors`` (a count, then per tensor a pickle
``(key, storage_id, type)`` and its sizes, strides and offset) and ``pickle`` (the object), all
unpickled, with ``weights_only=False`` only. ckpttool reads no values from it: commands other
than ``scan`` refuse it by name; ``scan`` walks every pickle ``torch.load`` would, in its order.

A tar header's first field is its first member's name: a name such as ``}.`` makes the file a
valid pickle too. ``torch.load`` reads such a file as a tar; ``scan`` says it reads two ways.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.errors import CkptError, NotACheckpointError, UnsafePickleError
from ckpttool.formats.base import FileFormat, Findings, Parsed
from ckpttool.io.source import source_size
from ckpttool.model.records import ITEMSIZE, GlobalRef, StorageRecord
from ckpttool.pickle.emulation import STORAGE_DTYPES
from ckpttool.pickle.interpreter import SafeUnpickler, TruncatedPickleError

if TYPE_CHECKING:
    from ckpttool.pickle.policy import Verdict

BLOCK = 512
#: How ``show`` and the other commands refuse the format.
TAR_FORMAT = "torch's pre-0.4 tar format"
TAR_REFUSAL = (
    f"{TAR_FORMAT} (torch.save before torch 0.4): ckpttool reads no values from it; "
    "`ckpttool scan` lists what its pickles call (torch.load reads it only with "
    "weights_only=False, and runs them)"
)
_WINDOW = 1 << 16
_MAX_PICKLE = 1 << 30


def _checksum_ok(head: bytes) -> bool:
    """tarfile's own test of a first header (``TarInfo.frombuf``): whole, not all NUL, and its
    checksum field (octal) equal to the header's byte sum, unsigned or signed."""
    if len(head) < BLOCK or head[:BLOCK].count(0) == BLOCK:
        return False
    field = head[148:156].split(b"\x00", 1)[0]
    try:
        claimed = int(field.decode("ascii").strip() or "0", 8)
    except ValueError:
        return False
    if head[148] in (0o200, 0o377):  # base-256: not what a tar writer puts in a checksum
        return False
    unsigned = 256 + sum(struct.unpack_from("148B8x356B", head))
    signed = 256 + sum(struct.unpack_from("148b8x356b", head))
    return claimed in (unsigned, signed)


def is_torch_tar(handle: BinaryIO) -> bool:
    """Whether ``torch.load`` reads the file as its tar format: ``tarfile.open(mode="r:")``
    succeeds on it (tarfile is imported only when the first block's checksum holds)."""
    handle.seek(0)
    head = handle.read(BLOCK)
    handle.seek(0)
    if not _checksum_ok(head):
        return False
    import tarfile

    try:
        with tarfile.open(fileobj=handle, mode="r:", format=tarfile.PAX_FORMAT):
            return True
    except tarfile.TarError:  # torch goes on to read a pickle stream
        return False
    except Exception:  # torch.load fails on it as a tar, not going on: a tar to refuse
        return True
    finally:
        handle.seek(0)


Counts = list[tuple[str, str, "Verdict"]]


class _Member:
    """One member's bytes, read by windows from its start (never all at once)."""

    def __init__(self, stream: BinaryIO, size: int) -> None:
        self.stream = stream
        self.size = size
        self.pos = 0

    def walk(self, label: str, found: Counts) -> Any:
        """The next pickle's value (its globals added to ``found``), ``self.pos`` past it."""
        window = min(_WINDOW, self.size - self.pos)
        placeholder = StorageRecord("?", "uint8", 0, "cpu", "", 0)
        while True:
            self.stream.seek(self.pos)
            data = self.stream.read(window)
            unpickler = SafeUnpickler(
                data, persistent_load=lambda pid: placeholder, refuse_dangerous=False
            )
            try:
                result = unpickler.load()
            except TruncatedPickleError as error:
                if window < min(self.size - self.pos, _MAX_PICKLE):
                    window = min(window * 4, self.size - self.pos)
                    continue
                found.extend(unpickler.result.globals_seen)
                raise _labelled(error, label) from None
            except CkptError as error:  # what it named before it failed was run by torch
                found.extend(unpickler.result.globals_seen)
                raise _labelled(error, label) from None
            found.extend(result.globals_seen)
            self.pos += result.end
            return result.root

    def skip(self, count: int) -> None:
        self.pos += count

    def read(self, count: int) -> bytes:
        self.stream.seek(self.pos)
        data = self.stream.read(count)
        self.pos += len(data)
        return data


def _labelled(error: CkptError, label: str) -> CkptError:
    error.args = (f"{label}: {error}",)
    return error


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise CkptError(f"{what} is {value!r:.40}, not a count (torch.load fails here)")
    return value


def scan_tar(handle: BinaryIO) -> tuple[Counts, list[str], list[str]]:
    """The globals of every pickle ``torch.load`` unpickles from the tar, in its order; notes
    (an attack the walker refuses even in scan mode); problems (where the walk had to stop:
    ``torch.load`` stops there too, having run what came before)."""
    import tarfile

    found: Counts = []
    notes: list[str] = []
    problems: list[str] = []
    handle.seek(0)
    try:
        with tarfile.open(fileobj=handle, mode="r:", format=tarfile.PAX_FORMAT) as tar:
            _walk_members(tar, found)
    except UnsafePickleError as error:
        notes.append(str(error))
    except CkptError as error:
        problems.append(str(error))
    except (tarfile.TarError, KeyError, OSError, ValueError, struct.error) as error:
        problems.append(f"the tar archive is not fully readable ({error})")
    return found, notes, problems


def _open_member(tar: Any, name: str) -> _Member:
    info = tar.getmember(name)  # KeyError: torch.load fails there too
    stream = tar.extractfile(info)
    if stream is None:
        raise CkptError(f"tar member {name!r} is not a regular file")
    return _Member(stream, info.size)


def _walk_members(tar: Any, found: Counts) -> None:
    storages = _open_member(tar, "storages")
    for index in range(_count(storages.walk("storages", found), "the storage count")):
        args = storages.walk(f"storages, storage {index}", found)
        itemsize = _itemsize(args)
        (numel,) = struct.unpack("<q", storages.read(8) or b"\x00" * 8)
        storages.skip(max(numel, 0) * itemsize)
    storages.walk("storages, views", found)
    tensors = _open_member(tar, "tensors")
    for index in range(_count(tensors.walk("tensors", found), "the tensor count")):
        tensors.walk(f"tensors, tensor {index}", found)
        (ndim,) = struct.unpack("<i", tensors.read(4) or b"\x00" * 4)
        tensors.skip(4 + 16 * max(ndim, 0) + 8)
    _open_member(tar, "pickle").walk("pickle", found)


def _itemsize(args: Any) -> int:
    """The element size of a storage entry's type (torch reads its bytes by it)."""
    storage_type = args[2] if isinstance(args, tuple) and len(args) == 3 else None
    if isinstance(storage_type, GlobalRef) and storage_type.name in STORAGE_DTYPES:
        return ITEMSIZE.get(STORAGE_DTYPES[storage_type.name], 1)
    raise CkptError(f"storage entry {args!r:.60} names no storage type (torch.load fails here)")


class TorchTarFormat(FileFormat):
    """Refused on open (by name); scanned pickle by pickle."""

    id = "torch-tar"
    ids = ("torch-tar",)

    def recognises(self, head: bytes, file_size: int, handle: BinaryIO) -> bool:
        return is_torch_tar(handle)

    def open(
        self,
        handle: BinaryIO,
        file_size: int,
        *,
        strict: bool,
        refuse_dangerous: bool,
        track_spans: bool,
    ) -> Parsed:
        raise NotACheckpointError(TAR_REFUSAL)

    def also_reads_as(self, handle: BinaryIO, file_size: int) -> tuple[str, list[Any]] | None:
        return ("a tar archive (torch's pre-0.4 format)", []) if is_torch_tar(handle) else None

    def scan(self, path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
        """Every pickle torch.load unpickles from the tar; and, if the file reads as a pickle
        stream or as safetensors too, that reading's globals and a note saying so. None for a
        file that is no tar."""
        from ckpttool.formats.registry import format_by_id  # the other formats, by id

        with opener(path) as handle:
            if not is_torch_tar(handle):
                return None
            found, notes, problems = scan_tar(handle)
            counts = Counter(found)
            handle.seek(0)
            head = handle.read(64)
        safetensors = format_by_id("safetensors")
        other = "safetensors" if safetensors.recognises(head, len(head), handle) else None
        with opener(path) as handle:
            size = source_size(handle)
            try:
                stream: Parsed | None = format_by_id("torch-legacy").open(
                    handle, size, strict=True, refuse_dangerous=False, track_spans=False
                )
            except CkptError:
                stream = None
        if stream is not None and stream.pickle is not None:
            counts.update(stream.pickle.globals_seen)
            other = "a pickle stream"
        if other is not None:
            notes.append(
                f"ambiguous: a tar archive (torch.load reads it as torch's pre-0.4 tar format) "
                f"that is also {other}"
            )
        return Findings("torch-tar", counts, notes=notes, problems=problems)


FORMAT = TorchTarFormat()
