"""What a damaged legacy torch.save file or bare pickle still holds (:meth:`LegacyFormat.recover`).

A legacy file is five pickles (magic number, protocol, system info, the object, the list of
storage keys), then each storage as an 8-byte little-endian element count and its bytes, in the
list's order. Nothing is checksummed: a storage counts as intact when its count is the one the
object's persistent id gives and its whole extent lies in the file. The storages are found by
hopping over the counts, so the walk stops at the first storage that is cut short (everything
after it is lost: a cut file). The five pickles must be whole, or nothing can be rebuilt. A
flipped byte inside a storage's data cannot be told from a good one.

A bare pickle (its first pickle is not the magic number) holds no tensor storage: what can be
recovered is the pickle up to its STOP opcode, trailing bytes cut away; one cut before its STOP
has lost its end and nothing can be rebuilt.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, BinaryIO

from ckpttool.errors import CorruptCheckpointError, LayoutError, UnrecoverableError
from ckpttool.formats.base import Recovered
from ckpttool.formats.torch_legacy.reader import (
    PROTOCOL_VERSION,
    _parse_pid,
    is_magic,
    module_class,
    read_growing,
)
from ckpttool.formats.torch_legacy.writer import write_legacy
from ckpttool.model.records import ITEMSIZE, StorageRecord
from ckpttool.pickle.interpreter import PickleResult, TruncatedPickleError, load_pickle

_PICKLES = (
    "the magic number",
    "the protocol version",
    "the system info",
    "the object pickle",
    "the storage key list",
)
_COPY_CHUNK = 1 << 20


def recover_pickle_stream(handle: BinaryIO, file_size: int) -> Recovered:
    """The tree of a damaged legacy file and its storages that are whole, or a bare pickle
    with its trailing bytes cut away."""
    reached = [0]  # which pickle the last parse got to

    def parse(data: bytes) -> tuple[list[PickleResult], dict[str, tuple[str, int, str]]]:
        reached[0] = 0
        results = [load_pickle(data, 0)]
        claimed: dict[str, tuple[str, int, str]] = {}
        if not is_magic(results[0].root):
            return results, claimed

        def record_pid(pid: Any) -> Any:
            cls = module_class(pid)
            if cls is not None:  # written back as a global: torch.load imports it alike
                return cls
            key, dtype, location, numel = _parse_pid(pid)
            claimed.setdefault(key, (dtype, numel, location))
            return StorageRecord(key, dtype, numel, location, "", 0)

        for stage in range(1, len(_PICKLES)):
            reached[0] = stage
            load = record_pid if stage == 3 else None
            results.append(load_pickle(data, results[-1].end, persistent_load=load))
        return results, claimed

    try:
        results, claimed = read_growing(handle, file_size, parse)
    except TruncatedPickleError:
        stage = reached[0]
        what = "the pickle" if stage == 0 else f"{_PICKLES[stage]} (pickle {stage + 1} of 5)"
        raise UnrecoverableError(
            f"{what} is cut before its end: nothing to rebuild the tree from (resume from the "
            "previous checkpoint)"
        ) from None
    except CorruptCheckpointError as error:  # a refused (unsafe) pickle is refused as it is
        what = _PICKLES[reached[0]] if len(_PICKLES) > reached[0] > 0 else "the pickle"
        raise UnrecoverableError(
            f"{what} is unreadable ({error}): nothing to rebuild the tree from"
        ) from None
    if len(results) == 1:
        return _bare_pickle(handle, file_size, results[0])
    return _legacy(handle, file_size, results, claimed)


def _bare_pickle(handle: BinaryIO, file_size: int, result: PickleResult) -> Recovered:
    end = result.end
    damage = []
    if end < file_size:
        damage.append(f"{file_size - end:,} bytes after the pickle's STOP opcode (trailing bytes)")

    def write(out: BinaryIO, root: Any, read: Callable[[str], bytes]) -> None:
        """The pickle's own bytes, up to and with its STOP opcode."""
        handle.seek(0)
        left = end
        while left:
            chunk = handle.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise UnrecoverableError("the file changed while it was copied")
            out.write(chunk)
            left -= len(chunk)

    return Recovered(format="pickle", root=result.root, intact={}, damage=damage, write=write)


def _legacy(
    handle: BinaryIO,
    file_size: int,
    results: list[PickleResult],
    claimed: dict[str, tuple[str, int, str]],
) -> Recovered:
    _, protocol, sys_info, _, listed = results
    if protocol.root != PROTOCOL_VERSION:
        raise UnrecoverableError(f"unsupported legacy protocol version {protocol.root!r:.40}")
    info = sys_info.root if isinstance(sys_info.root, dict) else {}
    if not info.get("little_endian", True):
        raise LayoutError("a big-endian legacy file: only little-endian is rebuilt")
    keys = listed.root
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise UnrecoverableError("the storage key list is malformed: the storages cannot be found")
    unknown = [key for key in keys if key not in claimed]
    if unknown:
        raise UnrecoverableError(
            f"the storage key list names {unknown[0]!r:.40}, which the object does not use: "
            "the storages cannot be found"
        )
    intact, damage = _walk_storages(handle, file_size, listed.end, keys, claimed)
    unlisted = sorted(set(claimed) - set(keys))
    if unlisted:
        damage.append(f"storages {unlisted[:3]} are not in the storage key list")

    storages: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> Any:
        cls = module_class(pid)
        if cls is not None:
            return cls
        key, dtype, location, numel = _parse_pid(pid)
        found = storages.get(key)
        if found is None:
            span = intact.get(key)
            found = storages[key] = StorageRecord(
                key, dtype, numel, location, f"legacy:{key}", span[1] if span else 0
            )
        return found

    handle.seek(0)
    data = handle.read(results[3].end)
    result = load_pickle(data, results[2].end, persistent_load=persistent_load)
    return Recovered(
        format="torch-legacy", root=result.root, intact=intact, damage=damage, write=write_legacy
    )


def _walk_storages(
    handle: BinaryIO,
    file_size: int,
    offset: int,
    keys: list[str],
    claimed: dict[str, tuple[str, int, str]],
) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Each storage whose count and whole extent are there, in the key list's order, up to
    the first one that is not; and what is wrong."""
    intact: dict[str, tuple[int, int]] = {}
    damage: list[str] = []
    for index, key in enumerate(keys):
        dtype, numel, _ = claimed[key]
        handle.seek(offset)
        head = handle.read(8)
        after = len(keys) - index - 1
        later = f" (and the {after:,} after it)" if after else ""
        if len(head) < 8:
            damage.append(f"the file ends before storage {key!r}{later}: cut short")
            return intact, damage
        (count,) = struct.unpack("<q", head)
        if count != numel:
            damage.append(
                f"storage {key!r} (byte {offset:,}): its element count {count:,} is not the "
                f"{numel:,} the object gives it: it{later} cannot be found"
            )
            return intact, damage
        nbytes = count * ITEMSIZE.get(dtype, 1)
        if offset + 8 + nbytes > file_size:
            damage.append(
                f"storage {key!r} (from byte {offset:,}) is cut short{later}: its last "
                f"{offset + 8 + nbytes - file_size:,} bytes are missing"
            )
            return intact, damage
        intact[key] = (offset + 8, nbytes)
        offset += 8 + nbytes
    if offset < file_size:
        damage.append(f"{file_size - offset:,} bytes after the last storage")
    return intact, damage
