"""Writing a checkpoint's tree again in its own format, checked: what ``repair`` and ``edit``
share.

The format's :meth:`~ckpttool.formats.base.FileFormat.recover` gives the tree, where each
storage's bytes lie and a writer of the same format; :func:`write_checked` writes a tree (the
source's, pruned, renamed...) atomically and reads it back before it replaces anything: every
tensor as the same view of a storage holding the bytes it was written from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, ReadBackError
from ckpttool.formats.base import Checkpoint, Recovered
from ckpttool.io.atomic import atomic_group
from ckpttool.io.blocks import crc_range
from ckpttool.model.records import StorageRecord, TensorRecord, walk


def write_checked(
    found: Recovered,
    root: Any,
    output: Path,
    read_range: Callable[[str, int, int], bytes],
    read: Callable[[str], bytes],
    derived_crcs: dict[str, int] | None = None,
) -> list[tuple[str, TensorRecord]]:
    """Write ``root`` (a tree of ``found``'s records) to ``output`` in ``found``'s format,
    atomically, read back by :func:`read_back` before it replaces anything; the tensors written,
    by key. ``read(key)`` / ``read_range(key, start, length)`` give a source storage's bytes.
    ``derived_crcs``: storage key -> the CRC-32 of the bytes ``read`` gave for a storage that
    is not the source's (``edit``'s casts), filled by the time the file is written: such a
    storage is read back by its CRC-32, not compared with ``read_range``'s bytes."""
    kept = [(key, record) for key, record in walk(root) if isinstance(record, TensorRecord)]
    extra = derived_crcs if derived_crcs is not None else {}
    with atomic_group(
        [output],
        check=lambda temps: read_back(
            temps[0], found.format, kept, read_range, {**found.crcs, **extra}
        ),
    ) as (out,):
        found.write(out, root, read)
    return kept


def read_back(
    path: Path,
    fmt: str,
    kept: list[tuple[str, TensorRecord]],
    read_range: Callable[[str, int, int], bytes],
    crcs: dict[str, int],
) -> None:
    """The written file opens as a file of format ``fmt``, and holds every salvaged (or
    filled) tensor, as the same view of its storage, with the bytes it was written from, and
    no other tensor. A storage copied whole from the source is read back once and checked
    against the CRC-32 its source bytes were checked with (``crcs``, by source storage key;
    a derived storage's: of the bytes it was written from); other tensors are compared with the source's bytes. A window at a time: memory stays
    bounded."""
    from ckpttool.checkpoint import open_checkpoint

    try:
        with open_checkpoint(path) as written:
            if written.format != fmt:
                raise ReadBackError(f"the repaired file reads as {written.format}, not {fmt}")
            # by the keys of the tree as pickled: a pickled nn.Module is written back as one
            records = {
                key: record
                for key, record in walk(written.objects)
                if isinstance(record, TensorRecord)
            }
            if set(records) != {key for key, _ in kept}:
                missing = sorted({key for key, _ in kept} - set(records))
                extra = sorted(set(records) - {key for key, _ in kept})
                raise ReadBackError(
                    f"the repaired file's tensors differ (missing {missing[:3]}, extra {extra[:3]})"
                )
            copied: dict[str, tuple[StorageRecord, str, str]] = {}  # written storage -> source
            for key, record in kept:
                storage = record.storage
                if storage is None:
                    continue
                theirs = records[key]
                same_view = (theirs.dtype, theirs.shape, theirs.stride, theirs.storage_offset) == (
                    record.dtype, record.shape, record.stride, record.storage_offset
                )  # fmt: skip
                if (theirs.dtype, theirs.shape) != (record.dtype, record.shape):
                    raise ReadBackError(f"tensor {key!r} does not read back as salvaged")
                if storage.key in crcs and same_view and theirs.storage is not None:
                    source = copied.setdefault(
                        theirs.storage.key, (theirs.storage, storage.key, key)
                    )
                    if source[1] != storage.key:  # two source storages written as one
                        raise ReadBackError(f"tensor {key!r} does not read back as salvaged")
                elif not _same_bytes(written, theirs, record, read_range):
                    raise ReadBackError(f"tensor {key!r} does not read back as salvaged")
            for storage, source_key, key in copied.values():
                offset, length = written.storage_span(storage)
                if length != storage.nbytes or _crc_of(written, offset, length) != crcs[source_key]:
                    raise ReadBackError(f"tensor {key!r} does not read back as salvaged")
    except ReadBackError:
        raise
    except CkptError as error:
        raise ReadBackError(f"the repaired file does not read back: {error}") from None


_COMPARED = 4 << 20  # bytes of each side compared at a time


def _crc_of(written: Checkpoint, offset: int, length: int) -> int | None:
    """CRC-32 of ``length`` bytes of the written file from ``offset`` (None: it ends before),
    a block at a time into reused buffers (:mod:`ckpttool.io.blocks`)."""
    return crc_range(written.read_file_into, offset, length)


def _same_bytes(
    written: Checkpoint,
    theirs: TensorRecord,
    record: TensorRecord,
    read_range: Callable[[str, int, int], bytes],
) -> bool:
    """The written tensor ``theirs`` holds the bytes the source's ``record`` was salvaged with:
    from its first element to past its last (a view's whole span), a window at a time where
    the written bytes are one range of the file."""
    assert record.storage is not None
    if record.inline_data is not None:  # a NumPy array's bytes, inside the pickle
        return theirs.inline_data == record.inline_data and theirs.stride == record.stride
    first = record.storage_offset * record.itemsize
    length = max(record.stored_extent_bytes - first, 0)
    span = written.file_span(theirs) if theirs.stride == record.stride else None
    if span is None or span[1] != length:  # read whole (a format that assembles its bytes)
        data, offset = written.read_bytes(theirs)
        start = offset * theirs.itemsize
        ours = bytes(data[start : start + theirs.nbytes])
        return ours == read_range(record.storage.key, first, len(ours))
    offset, _ = span
    for at in range(0, length, _COMPARED):
        n = min(_COMPARED, length - at)
        if written.read_file(offset + at, n) != read_range(record.storage.key, first + at, n):
            return False
    return True
