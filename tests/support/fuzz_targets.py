"""What the fuzzers do to fixture bytes, and what they run on the result.

Shared by the bounded hypothesis test (``tests/test_fuzz.py``) and the long-running fuzzer
(``fuzz/fuzz_reader.py``). Mutations are structure-aware where that finds more: besides
truncation, bit flips, inserted and deleted bytes, they overwrite length-like fields with
boundary integers, swap or duplicate whole zip records (so the central directory points at
the wrong bytes) and splice in bytes of another fixture.

:func:`exercise` is the property: whatever the bytes, opening the file, building and rendering
``show``'s report (with ``--stats``, which reads every tensor), ``verify`` and ``scan`` raise nothing but
:class:`~ckpttool.errors.CkptError`.

``SEEDS``, ``MUTATIONS``, :func:`mutate` and :func:`exercise` are the API ``fuzz/`` imports:
change them with ``fuzz/fuzz_reader.py``.
"""

from __future__ import annotations

import io
import json
import random
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError
from tests.support.helpers import FIXTURES

#: Seeds: one of each format and layout the reader knows (kept small: every example reads one).
SEEDS = [
    FIXTURES / name
    for name in (
        "minimind/pretrain_32_resume.pth",  # torch zip, MiniMind resume
        "minimind/pretrain_32.pth",  # torch zip, fp16 state dict
        "ckpttool/pretrain_32.pth",  # tied storage
        "legacy/state_dict.pth",  # legacy stream
        "legacy/resume_bigkeys.pth",
        "safetensors/model.safetensors",
        "lightning/epoch=1-step=40.ckpt",
        "special/nested_generic.pth",  # every plain type, bf16, 0-dim, empty tensors
        "special/numpy_rng.pth",  # NumPy arrays, dtypes and scalars
        "special/namespace_config.pth",  # opaque objects
        "special/views.pth",  # offsets, strides, shared storages
        "special/custom_prefix.pth",
        "gguf/q8_0.gguf",  # GGUF: metadata, tensor infos, Q8_0 blocks decoded by --stats
        "gguf/q4_k.gguf",
    )
]
#: Integers that break length, offset and count fields.
BOUNDARY = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]
#: Byte-level mutations, usable anywhere in a file.
BYTE_MUTATIONS = ("truncate", "flip", "insert", "delete", "boundary_int", "splice")
#: Structure-aware ones: zip records moved about, and the payloads behind a checksum or a
#: length field (data.pkl inside the zip, the safetensors JSON header) mutated and re-wrapped
#: with a valid CRC / length, so the pickle walker and the header checks see the damage.
#: ``frame`` puts a FRAME opcode (protocol 4) into data.pkl at a random offset with a random
#: length, so the walker's frame check sees frames that do and do not end on an opcode.
#: The last three keep a torch zip loadable by torch (they change only what its reader
#: ignores or reads alike: a name's ASCII case, an archive comment, zip64 end records),
#: so the reader must read the same tensors (``tests/test_containers.py``).
LOADABLE_ZIP_MUTATIONS = ("name_case", "archive_comment", "zip64_end")
MUTATIONS = (
    *BYTE_MUTATIONS, "swap_records", "duplicate_record", "inner_pickle", "header_json", "frame",
    *LOADABLE_ZIP_MUTATIONS,
)  # fmt: skip


def zip_records(data: bytes | bytearray) -> list[tuple[int, int]]:
    """(start, end) of each span that begins with a zip local header, up to the next one."""
    starts = []
    at = data.find(b"PK\x03\x04")
    while at >= 0:
        starts.append(at)
        at = data.find(b"PK\x03\x04", at + 4)
    central = data.find(b"PK\x01\x02")
    ends = [*starts[1:], central if central > (starts[-1] if starts else 0) else len(data)]
    return list(zip(starts, ends))


def mutate(data: bytes, kind: str, rng: random.Random, others: list[bytes]) -> bytes:
    """One mutation of ``kind``; positions and sizes from ``rng`` (reproducible from a seed)."""
    out = bytearray(data)
    size = len(out)
    at = rng.randrange(size + 1)
    if kind == "truncate":
        return bytes(out[:at])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            if out:
                bit = rng.randrange(size * 8)
                out[bit >> 3] ^= 1 << (bit & 7)
    elif kind == "insert":
        out[at:at] = rng.randbytes(rng.choice([1, 2, 4, 8, rng.randint(1, 512)]))
    elif kind == "delete":
        del out[at : at + rng.choice([1, 2, 4, 8, rng.randint(1, 4096)])]
    elif kind == "boundary_int":
        width = rng.choice([1, 2, 4, 8])
        value = rng.choice(BOUNDARY) & ((1 << (8 * width)) - 1)
        out[at : at + width] = value.to_bytes(width, "little")
    elif kind in ("swap_records", "duplicate_record"):
        records = zip_records(out)
        if len(records) >= 2:
            (a0, a1), (b0, b1) = sorted(rng.sample(records, 2))
            if kind == "swap_records":
                out[a0:b1] = out[b0:b1] + out[a1:b0] + out[a0:a1]
            else:
                out[b0:b0] = out[a0:a1]
    elif kind == "splice":
        other = rng.choice(others)
        start = rng.randrange(len(other))
        out[at : at + rng.randint(0, 4096)] = other[start : start + rng.randint(1, 8192)]
    elif kind == "inner_pickle":
        return _mutate_data_pkl(data, rng, others)
    elif kind == "frame":
        return _mutate_data_pkl(data, rng, others, insert_frame)
    elif kind == "header_json":
        return _mutate_header(data, rng)
    elif kind in LOADABLE_ZIP_MUTATIONS:
        return _loadable_zip_mutation(data, kind, rng)
    else:
        raise ValueError(f"unknown mutation {kind!r}")
    return bytes(out)


def insert_frame(data: bytes, rng: random.Random) -> bytes:
    """``data`` with a FRAME inserted at a random offset (after the PROTO), of a random length
    up to the end."""
    at = rng.randrange(2, len(data)) if len(data) > 2 else len(data)
    length = rng.randrange(len(data) - at + 1)
    return data[:at] + b"\x95" + length.to_bytes(8, "little") + data[at:]


def _mutate_data_pkl(
    data: bytes, rng: random.Random, others: list[bytes], change: Any = None
) -> bytes:
    """Rebuild a torch zip with its data.pkl mutated (CRCs recomputed) by ``change(payload,
    rng)`` (default: a byte mutation); else a plain flip."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    except Exception:  # not a readable zip (any more): a plain flip instead
        return mutate(data, "flip", rng, others)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names, after a duplicate_record
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            for name, payload in records:
                if name.endswith("data.pkl") and payload and change is not None:
                    payload = change(payload, rng)
                elif name.endswith("data.pkl") and payload:
                    payload = mutate(payload, rng.choice(BYTE_MUTATIONS), rng, others)
                archive.writestr(name, payload)
    return buffer.getvalue()


def _central_entries(data: bytes) -> list[tuple[int, int, int]] | None:
    """(entry start, name length, local header offset) of each central directory entry of an
    archive whose end record is its last 22 bytes; None for anything else."""
    end = len(data) - 22
    if end < 0 or data[end : end + 4] != b"PK\x05\x06":
        return None
    size, offset = struct.unpack_from("<LL", data, end + 12)
    entries = []
    at = offset
    while at + 46 <= min(offset + size, len(data)) and data[at : at + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        (local,) = struct.unpack_from("<L", data, at + 42)
        entries.append((at, name_len, local))
        at += 46 + name_len + extra_len + comment_len
    return entries


def _loadable_zip_mutation(data: bytes, kind: str, rng: random.Random) -> bytes:
    """One of :data:`LOADABLE_ZIP_MUTATIONS` on a torch zip (a plain flip on anything else)."""
    entries = _central_entries(data)
    if not entries:
        return mutate(data, "flip", rng, [data])
    out = bytearray(data)
    end = len(out) - 22
    if kind == "name_case":  # one ASCII letter of one name upper-cased, in both its headers
        at, name_len, local = rng.choice(entries)
        name = out[at + 46 : at + 46 + name_len]
        # not in the folder: torch requires every record in the first one's, case and all
        letters = [i for i, c in enumerate(name) if 0x61 <= c <= 0x7A and i > name.find(b"/")]
        if letters and out[local + 30 : local + 30 + name_len] == name:
            i = rng.choice(letters)
            out[at + 46 + i] -= 0x20
            out[local + 30 + i] -= 0x20
    elif kind == "archive_comment":  # what miniz and zipfile both skip
        comment = bytes(rng.randrange(0x20, 0x7F) for _ in range(rng.randint(1, 300)))
        struct.pack_into("<H", out, end + 20, len(comment))
        out += comment
    elif out[end - 20 : end - 16] == b"PK\x06\x07":  # zip64_end: torch writes them: drop
        if (0xFFFF in struct.unpack_from("<HH", out, end + 8)
                or 0xFFFFFFFF in struct.unpack_from("<LL", out, end + 12)):  # fmt: skip
            return bytes(out)  # the 32-bit fields do not hold the values
        del out[end - 76 : end]
    else:  # zip64_end: a zip64 end record and its locator before the end record
        count, size, offset = struct.unpack_from("<HLL", out, end + 10)
        record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count,
                             size, offset)  # fmt: skip
        locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
        out[end:end] = record + locator
    return bytes(out)


def _mutate_header(data: bytes, rng: random.Random) -> bytes:
    """A safetensors file with one value of its JSON header replaced, length field fixed."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        assert isinstance(header, dict) and header
    except (struct.error, ValueError, AssertionError, RecursionError):
        return mutate(data, "boundary_int", rng, [data])
    name = rng.choice(list(header))
    entry = header[name]
    weird = [None, -1, 0, 2**64, "F32", "X9", [], {}, [1, 2, 3], [2**62, 2**62], 1.5, True]
    if isinstance(entry, dict) and entry and rng.random() < 0.8:
        field = rng.choice(list(entry))
        value = entry[field]
        if isinstance(value, list) and value and rng.random() < 0.5:
            value[rng.randrange(len(value))] = rng.choice(weird)
        else:
            entry[field] = rng.choice(weird)
    elif rng.random() < 0.5:
        del header[name]
    else:
        header[name] = rng.choice(weird)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + length :]


def exercise(path: Path) -> None:
    """Open, show (report, table, JSON, tree, stats) and verify ``path``.

    Raises only :class:`CkptError`; any other exception is a bug the fuzzer reports.
    """
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.commands.show import build_report
    from ckpttool.commands.verify import verify_file
    from ckpttool.render import show as show_render
    from ckpttool.render import show_tree

    for strict in (True, False):
        try:
            with open_checkpoint(path, strict=strict, refuse_dangerous=strict) as ckpt:
                report = build_report(ckpt, stats=strict)
                show_render.render_text(report)
                json.dumps(show_render.render_json(report), allow_nan=False)  # clean --json
                show_tree.render_text(ckpt.root, 4)
                json.dumps(show_tree.render_json(ckpt.root), allow_nan=False)
        except CkptError:
            pass
    try:
        verify_file(path, values=True)
    except CkptError:
        pass
    from ckpttool.commands.scan import scan_file

    scan_file(path)  # scan mode: its own walk of what the reader refuses, the linear names
