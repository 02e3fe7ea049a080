"""Container-level parser differentials: files ``torch.load`` and a naive reader read apart.

Each hostile builder returns bytes that ``torch.load(weights_only=False)`` reads as something
that runs ``builtins.open(marker, "w")`` (creating the file ``marker``: the tests' evidence that
the payload is live), while a reader following another rule (the legacy format sniffed by its
protocol-2 bytes, Python's ``zipfile``, case-sensitive names, the safetensors format by content)
sees something harmless. ``python -m tests.support.containers OUT_DIR`` writes them all, with
the benign files torch itself writes for the same classes (see :func:`corpus`).

The benign builders use torch's own API; the hostile ones are built byte by byte (torch never
writes them), each with the rule it exploits in its docstring (docs/safety.md, "Parser
differentials").
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpttool.formats.torch_legacy.reader import MAGIC_NUMBER, PROTOCOL_VERSION

SYS_INFO = {"protocol_version": PROTOCOL_VERSION, "little_endian": True, "type_sizes": {}}


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def open_call(marker: Path) -> bytes:
    """Opcodes (no PROTO, no STOP) that push ``builtins.open(marker, "w")``."""
    return b"cbuiltins\nopen\n(" + _unicode(str(marker)) + _unicode("w") + b"tR"


def payload(marker: Path) -> bytes:
    """A whole pickle whose value is ``builtins.open(marker, "w")``."""
    return b"\x80\x02" + open_call(marker) + b"."


def unlisted_call(marker: Path) -> bytes:
    """Opcodes that push ``tests.support.adversarial.touch_marker(marker)``: a callable no
    deny-list names (``scan`` calls it unknown; the other commands keep it as an opaque
    object, never calling it)."""
    return b"ctests.support.adversarial\ntouch_marker\n(" + _unicode(str(marker)) + b"tR"


def _then(marker: Path, value: object, call: Callable[[Path], bytes] = open_call) -> bytes:
    """A pickle that makes ``call`` (``open(marker, "w")``), drops the result and gives
    ``value``: torch checks the value (the magic number, the protocol version), not what ran
    before it."""
    return b"\x80\x02" + call(marker) + b"0" + pickle.dumps(value, protocol=2)[2:]


# --- 1, 2: the legacy pickle stream --------------------------------------------------------


def legacy_stream(obj: bytes, protocol: int = 2, pickles: dict[int, bytes] | None = None) -> bytes:
    """magic, protocol version, sys info, ``obj`` (a whole pickle), storage keys: the five
    pickles ``torch.load`` reads, the others pickled in ``protocol``; ``pickles`` replaces
    any of them by index (0 to 4)."""
    parts = [
        pickle.dumps(MAGIC_NUMBER, protocol=protocol),
        pickle.dumps(PROTOCOL_VERSION, protocol=protocol),
        pickle.dumps(SYS_INFO, protocol=protocol),
        obj,
        pickle.dumps([], protocol=protocol),
    ]
    for index, replacement in (pickles or {}).items():
        parts[index] = replacement
    return b"".join(parts)


def legacy_protocol_payload(marker: Path, protocol: int = 4) -> bytes:
    """A legacy stream in protocol 4 (FRAMEs): its first bytes are not protocol 2's, so a
    reader that sniffs the format by them reads one integer and stops."""
    return legacy_stream(bytes([0x80, protocol]) + open_call(marker) + b".", protocol)


def legacy_payload_in(index: int) -> Callable[[Path], bytes]:
    """A legacy stream whose pickle ``index`` (0 magic, 1 version, 2 sys info, 4 keys) calls
    a callable on no deny-list (:func:`unlisted_call`) and still gives torch the value it
    checks: only a reader walking that pickle with the full policy sees it."""
    values: list[Any] = [MAGIC_NUMBER, PROTOCOL_VERSION, SYS_INFO, None, []]

    def build(marker: Path) -> bytes:
        legit = pickle.dumps({"w": 1}, protocol=2)
        return legacy_stream(legit, pickles={index: _then(marker, values[index], unlisted_call)})

    build.__name__ = f"legacy_payload_in_pickle_{index}"
    return build


# --- 3: torch's pre-0.4 tar format ---------------------------------------------------------


def torch_tar(pickle_member: bytes, first: str | None = None) -> bytes:
    """A tar ``torch.load`` reads (no storages, no tensors) whose ``pickle`` member is
    ``pickle_member``; ``first``: a member put first (its name opens the file)."""
    buffer = io.BytesIO()
    members = [("storages", pickle.dumps(0, 2) + pickle.dumps([], 2)),
               ("tensors", pickle.dumps(0, 2)), ("pickle", pickle_member)]  # fmt: skip
    if first is not None:
        members.insert(0, (first, b""))
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tar_payload(marker: Path) -> bytes:
    """The tar format, its ``pickle`` member the payload."""
    return torch_tar(payload(marker))


def tar_payload_in_storages(marker: Path) -> bytes:
    """The payload in the tar's ``storages`` member, the first thing torch unpickles there."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (("storages", _then(marker, 0) + pickle.dumps([], 2)),
                           ("tensors", pickle.dumps(0, 2)),
                           ("pickle", pickle.dumps({"w": 1}, 2))):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tar_pickle_polyglot(marker: Path) -> bytes:
    """A tar whose first member is named ``}.``: its first bytes are also a pickle of ``{}``
    (a reader that sniffs a pickle by its first byte reads an empty dict); torch tries the tar
    first and runs the ``pickle`` member."""
    return torch_tar(payload(marker), first="}.")


# --- 4, 5: zip archives torch's reader (miniz) reads apart from zipfile ---------------------


def _zip(records: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, data)
    return buffer.getvalue()


BENIGN_PICKLE = pickle.dumps({"w": 1}, protocol=2)


def zip_upper_case_only(marker: Path) -> bytes:
    """``archive/DATA.PKL`` and no ``data.pkl``: torch finds it (names ignore case)."""
    return _zip([("archive/DATA.PKL", payload(marker)), ("archive/version", b"3\n")])


def zip_upper_case_beside(marker: Path) -> bytes:
    """``archive/data.PKL`` (the payload) before a benign ``archive/data.pkl``: torch's lookup
    finds one of the two (which one depends on its binary search: here the first)."""
    return _zip([("archive/data.PKL", payload(marker)), ("archive/data.pkl", BENIGN_PICKLE),
                 ("archive/version", b"3\n")])  # fmt: skip


def _split(data: bytes) -> tuple[bytes, bytes]:
    """(local records, central directory) of a zip zipfile wrote (no comment, no zip64)."""
    end = data.rindex(b"PK\x05\x06")
    size, offset = struct.unpack_from("<LL", data, end + 12)
    return data[:offset], data[offset : offset + size]


def _shift(directory: bytes, by: int) -> bytes:
    """A central directory with every local header offset moved by ``by``."""
    out = bytearray(directory)
    at = 0
    while at < len(out):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", out, at + 28)
        (offset,) = struct.unpack_from("<L", out, at + 42)
        struct.pack_into("<L", out, at + 42, offset + by)
        at += 46 + name_len + extra_len + comment_len
    return bytes(out)


def _eocd(count: int, size: int, offset: int) -> bytes:
    return struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, offset, 0)


def zip_two_directories(marker: Path) -> bytes:
    """Two central directories: the end record's offset names the first (the payload's: torch
    reads it there), but it lies just before the second (a benign archive's), so zipfile, which
    shifts offsets by data it supposes in front of the archive, reads the second."""
    hostile = [("archive/data.pkl", payload(marker)), ("archive/version", b"3\n")]
    benign = [("archive/data.pkl", BENIGN_PICKLE), ("archive/version", b"3\n")]
    records_h, directory_h = _split(_zip(hostile))
    records_b, directory_b = _split(_zip(benign))
    assert len(directory_h) == len(directory_b)
    body = records_h + records_b + directory_h
    # zipfile's shift (concat) is len(directory_h): its offsets are read that much further on
    moved = _shift(directory_b, len(records_h) - len(directory_h))
    return body + moved + _eocd(2, len(moved), len(records_h + records_b))


def _zip64_end(count: int, size: int, offset: int) -> bytes:
    return struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, offset)


def zip_two_zip64_records(marker: Path) -> bytes:
    """Two zip64 end records: the locator points at the first (the payload's directory: torch
    reads it), zipfile reads the one just before the locator (a benign directory)."""
    hostile = [("archive/data.pkl", payload(marker)), ("archive/version", b"3\n")]
    benign = [("archive/data.pkl", BENIGN_PICKLE), ("archive/version", b"3\n")]
    records_h, directory_h = _split(_zip(hostile))
    records_b, directory_b = _split(_zip(benign))
    records = records_h + records_b
    directory_b = _shift(directory_b, len(records_h))
    first_at = len(records)
    first = _zip64_end(2, len(directory_h), first_at + 56)
    body = records + first + directory_h + directory_b
    second = _zip64_end(2, len(directory_b), first_at + 56 + len(directory_h))
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, first_at, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return body + second + locator + end


# --- 6: safetensors that is also a pickle ---------------------------------------------------


def safetensors_pickle_polyglot(marker: Path) -> bytes:
    """A valid safetensors file whose bytes are also a legacy pickle stream running the payload.

    Its 8-byte header length starts with ``B`` (BINBYTES): the pickle swallows the length's
    other bytes and the JSON header's opening as a bytes object, resumes inside a metadata
    string made of SHORT_BINBYTES chunks (``C`` + a length byte + filler, all valid JSON text)
    that swallow the rest of the header, and its five pickles follow as the bytes of the one
    (uint8) tensor. ``torch.load`` unpickles it under any name but ``*.safetensors``."""
    stream = b"0\x8a\x0a" + MAGIC_NUMBER.to_bytes(10, "little") + b"."  # POP, the magic
    stream += pickle.dumps(PROTOCOL_VERSION, 2) + pickle.dumps(SYS_INFO, 2)
    stream += payload(marker) + pickle.dumps([], 2)
    opening = b'{"__metadata__":{"p":"'
    swallowed = 3 + len(opening)  # the length's last 3 bytes, then the JSON up to the string
    header_len = 0x42 + (swallowed << 8)  # b"B" and BINBYTES' 4-byte length, little-endian
    tail = b'"},"t":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (
        len(stream), len(stream))  # fmt: skip
    # the string: POP, then chunks C <k> <k bytes> POP, the last one without its POP and
    # ending with the JSON's tail, to the header's last byte exactly
    sizes = []  # each chunk's length byte: 0x20 to 0x7F (JSON text), not '"' nor '\\'
    left = header_len - len(opening) - 1
    while left - 2 > 0x7F:
        take = 0x7F if left - 3 - 0x7F >= 2 + len(tail) else left - 5 - len(tail)
        take -= take in (0x22, 0x5C)
        sizes.append(take)
        left -= 3 + take
    sizes.append(left - 2)
    assert all(0x20 <= k <= 0x7F and k not in (0x22, 0x5C) for k in sizes), sizes
    assert sizes[-1] >= len(tail)
    chunks = bytearray(b"0")
    for k in sizes[:-1]:
        chunks += b"C" + bytes([k]) + b"a" * k + b"0"
    chunks += b"C" + bytes([sizes[-1]]) + b"a" * (sizes[-1] - len(tail)) + tail
    header = opening + bytes(chunks)
    assert len(header) == header_len
    return struct.pack("<Q", header_len) + header + stream


# --- torch-written files (benign) -----------------------------------------------------------


def _torch_bytes(save: Callable[[Any], None]) -> bytes:
    buffer = io.BytesIO()
    save(buffer)
    return buffer.getvalue()


def _module() -> Any:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():  # dyadic values, the same on every machine
        for index, parameter in enumerate(model.parameters()):
            values = torch.arange(parameter.numel(), dtype=torch.float32) / 64 - index
            parameter.copy_(values.reshape(parameter.shape))
    return model


def legacy_state_dict(protocol: int) -> bytes:
    """``torch.save(state_dict, _use_new_zipfile_serialization=False, pickle_protocol=N)``."""
    import torch

    state = _module().state_dict()
    state["step"] = torch.tensor(7, dtype=torch.int64)
    return _torch_bytes(lambda f: torch.save(state, f, _use_new_zipfile_serialization=False,
                                             pickle_protocol=protocol))  # fmt: skip


def saved_model(legacy: bool) -> bytes:
    """``torch.save(model)`` (the module object), legacy or zip."""
    import torch

    return _torch_bytes(
        lambda f: torch.save(_module(), f, _use_new_zipfile_serialization=not legacy)
    )


def saved_optimizer(legacy: bool) -> bytes:
    """``torch.save(optimizer)`` after one SGD step with momentum (its ``state`` is keyed by
    the parameters)."""
    import torch

    model = _module()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return _torch_bytes(
        lambda f: torch.save(optimizer, f, _use_new_zipfile_serialization=not legacy)
    )


def crc_less_zip() -> bytes:
    """``torch.save`` with ``torch.serialization.config.save.compute_crc32 = False``."""
    import torch
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        return _torch_bytes(lambda f: torch.save(_module().state_dict(), f))
    finally:
        config.save.compute_crc32 = previous


#: Hostile files by name: each runs the payload under torch.load(weights_only=False). The
#: suffix is the name torch.load is given (a safetensors polyglot is live under any other).
HOSTILE: dict[str, Callable[[Path], bytes]] = {
    "legacy_protocol4_payload.pth": legacy_protocol_payload,
    "legacy_payload_in_magic.pth": legacy_payload_in(0),
    "legacy_payload_in_version.pth": legacy_payload_in(1),
    "legacy_payload_in_sys_info.pth": legacy_payload_in(2),
    "legacy_payload_in_keys.pth": legacy_payload_in(4),
    "tar_payload.pth": tar_payload,
    "tar_payload_in_storages.pth": tar_payload_in_storages,
    "tar_pickle_polyglot.pth": tar_pickle_polyglot,
    "zip_upper_case_only.pth": zip_upper_case_only,
    "zip_upper_case_beside.pth": zip_upper_case_beside,
    "zip_two_directories.pth": zip_two_directories,
    "zip_two_zip64_records.pth": zip_two_zip64_records,
    "safetensors_pickle_polyglot.bin": safetensors_pickle_polyglot,
}

#: Those that read two ways: scan names the ambiguity; show, convert and diff refuse them.
AMBIGUOUS = {
    "tar_pickle_polyglot.pth": "also a pickle stream",
    "zip_upper_case_beside.pth": "ignores case in names",
    "zip_two_directories.pth": "where zipfile reads it",
    "zip_two_zip64_records.pth": "zip64 locator points at",
    "safetensors_pickle_polyglot.bin": "a safetensors file that is also a pickle stream",
}

#: Benign files torch writes for the same classes.
BENIGN: dict[str, Callable[[], bytes]] = {
    **{f"legacy_protocol{p}.pth": (lambda p=p: legacy_state_dict(p)) for p in (1, 2, 3, 4, 5)},
    "legacy_model.pth": lambda: saved_model(legacy=True),
    "zip_model.pth": lambda: saved_model(legacy=False),
    "legacy_optimizer.pth": lambda: saved_optimizer(legacy=True),
    "zip_optimizer.pth": lambda: saved_optimizer(legacy=False),
    "crc_less.pth": crc_less_zip,
}


def corpus(marker: Path) -> dict[str, bytes]:
    """Every hostile file (payload creating ``marker``) and every benign one, by file name."""
    files = {name: build(marker) for name, build in HOSTILE.items()}
    files.update({name: build() for name, build in BENIGN.items()})
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in corpus(out / "MARKER").items():
        (out / name).write_bytes(data)
    print(f"wrote {len(HOSTILE) + len(BENIGN)} files to {out}")
