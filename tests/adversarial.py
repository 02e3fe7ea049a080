"""Hostile inputs, built byte by byte: code-execution payloads, resource bombs, broken archives.

Used by the security tests; ``python -m tests.adversarial OUT_DIR`` writes the whole corpus to
a folder so any tool can be tried on it. Every code-execution payload, if it ran, would create
the file named by ``marker`` — tests assert that file never appears.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from ckpttool.formats.torch_legacy import MAGIC_NUMBER, PROTOCOL_VERSION


def _text(s: str) -> bytes:
    return s.encode()


def _binunicode(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _short_unicode(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _command(marker: Path) -> str:
    return f"touch {marker}"


# --- code-execution payloads: name -> builder(marker) -> pickle bytes -----------------------


def global_reduce_p0(marker: Path, module: str = "os", name: str = "system") -> bytes:
    return _text(f"c{module}\n{name}\n(S'{_command(marker)}'\ntR.")


def global_reduce_p2(marker: Path, module: str = "posix", name: str = "system") -> bytes:
    return b"\x80\x02" + _text(f"c{module}\n{name}\n") + _binunicode(_command(marker)) + b"\x85R."


def stack_global_p4(marker: Path) -> bytes:
    body = _short_unicode("os") + _short_unicode("system") + b"\x93"
    body += _short_unicode(_command(marker)) + b"\x85R."
    return b"\x80\x04" + body


def inst_p0(marker: Path) -> bytes:
    return _text(f"(S'{_command(marker)}'\nios\nsystem\n.")


def obj_p1(marker: Path) -> bytes:
    return _text(f"(cos\nsystem\nS'{_command(marker)}'\no.")


def memo_indirection_p2(marker: Path) -> bytes:
    # the callable goes into the memo, is popped, and comes back through BINGET
    return b"\x80\x02cos\nsystem\nq\x070" + b"h\x07" + _binunicode(_command(marker)) + b"\x85R."


def builtins_eval_p2(marker: Path) -> bytes:
    code = f"__import__('os').system('{_command(marker)}')"
    return b"\x80\x02cbuiltins\neval\n" + _binunicode(code) + b"\x85R."


def subprocess_popen_p2(marker: Path) -> bytes:
    args = b"](" + _binunicode("touch") + _binunicode(str(marker)) + b"e"
    return b"\x80\x02csubprocess\nPopen\n" + args + b"\x85R."


def nested_in_checkpoint_p2(marker: Path) -> bytes:
    """A plausible checkpoint dict with one entry that calls os.system."""
    payload = global_reduce_p2(marker, "os", "system")[2:-1]  # without PROTO and STOP
    return b"\x80\x02}(" + _binunicode("epoch") + b"K\x01" + _binunicode("config") + payload + b"u."


PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    "global_reduce_p0_os_system": global_reduce_p0,
    "global_reduce_p2_posix_system": global_reduce_p2,
    "stack_global_p4_os_system": stack_global_p4,
    "inst_p0_os_system": inst_p0,
    "obj_p1_os_system": obj_p1,
    "memo_indirection_p2": memo_indirection_p2,
    "builtins_eval_p2": builtins_eval_p2,
    "subprocess_popen_p2": subprocess_popen_p2,
    "nested_in_checkpoint_p2": nested_in_checkpoint_p2,
}


def build_on_allowed_global() -> bytes:
    """BUILD aimed at a class the reader knows: would set attributes on the real class."""
    return b"\x80\x02ccollections\nOrderedDict\n}" + _binunicode("__repr__") + b"K\x01sb."


# --- resource bombs --------------------------------------------------------------------


def memo_bomb() -> bytes:
    return b"\x80\x02N" + b"r" + struct.pack("<I", 0x7FFFFFFF) + b"."


def binbytes8_terabyte() -> bytes:
    return b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"abc."


def deep_nesting(depth: int = 100_000) -> bytes:
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def deep_marks(depth: int = 1_000_000) -> bytes:
    return b"\x80\x02" + b"(" * depth + b"."


def self_reference() -> bytes:
    return b"\x80\x02]q\x00h\x00a."


# --- containers for a pickle: torch zip, legacy stream -----------------------------------


def torch_zip(
    pickle_bytes: bytes, records: dict[str, bytes] | None = None, prefix: str = "archive"
) -> bytes:
    """A torch-style zip: ``<prefix>/data.pkl`` + ``<prefix>/data/<key>`` records, stored."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{prefix}/data.pkl", pickle_bytes)
        archive.writestr(f"{prefix}/byteorder", "little")
        for key, data in (records or {}).items():
            archive.writestr(f"{prefix}/data/{key}", data)
        archive.writestr(f"{prefix}/version", "3\n")
    return buffer.getvalue()


def legacy_stream(pickle_bytes: bytes) -> bytes:
    head = pickle.dumps(MAGIC_NUMBER, protocol=2) + pickle.dumps(PROTOCOL_VERSION, protocol=2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True}, protocol=2)
    return head + pickle_bytes + pickle.dumps([], protocol=2)


def tensor_pickle(storage_key: str, storage_numel: int, shape: tuple[int, ...]) -> bytes:
    """data.pkl for {"w": float32 tensor of ``shape``} on storage ``storage_key``."""
    pid = (
        b"(" + _binunicode("storage") + b"ctorch\nFloatStorage\n" + _binunicode(storage_key)
        + _binunicode("cpu") + _int(storage_numel) + b"tQ"
    )  # fmt: skip
    stride = []
    acc = 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    size_t = b"(" + b"".join(_int(n) for n in shape) + b"t"
    stride_t = b"(" + b"".join(_int(s) for s in reversed(stride)) + b"t"
    tensor = (
        b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid + b"K\x00" + size_t + stride_t
        + b"\x89ccollections\nOrderedDict\n)Rt" + b"R"
    )  # fmt: skip
    return b"\x80\x02}" + _binunicode("w") + tensor + b"s."


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def storage_larger_than_record() -> bytes:
    return torch_zip(tensor_pickle("0", 1000, (1000,)), {"0": b"\x00" * 16})


def extent_past_storage() -> bytes:
    return torch_zip(tensor_pickle("0", 4, (1000,)), {"0": b"\x00" * 16})


def duplicate_data_pkl() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"a": 1}, protocol=2))
        archive.writestr("archive/data.pkl", pickle.dumps({"a": 2}, protocol=2))
    return buffer.getvalue()


def safetensors_file(header: dict[str, object], data: bytes, length: int | None = None) -> bytes:
    """A safetensors file from a header dict and data bytes; ``length`` overrides N."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _entry(begin: int, end: int, shape: list[int]) -> dict[str, object]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


SAFETENSORS_BROKEN: dict[str, Callable[[], bytes]] = {
    "overlap": lambda: safetensors_file(
        {"a": _entry(0, 8, [2]), "b": _entry(4, 12, [2])}, bytes(12)
    ),
    "gap": lambda: safetensors_file({"a": _entry(0, 8, [2]), "b": _entry(12, 20, [2])}, bytes(20)),
    "trailing": lambda: safetensors_file({"a": _entry(0, 8, [2])}, bytes(12)),
    "size_mismatch": lambda: safetensors_file({"a": _entry(0, 8, [3])}, bytes(8)),
    "header_past_end": lambda: safetensors_file({"a": _entry(0, 8, [2])}, bytes(8), length=4096),
    "header_over_100mb": lambda: safetensors_file(
        {"a": _entry(0, 8, [2])}, bytes(8), length=200_000_000
    ),
}


def write_corpus(out: Path, marker: Path) -> list[Path]:
    """Write every hostile input under ``out`` (used by ``python -m tests.adversarial``)."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    for name, build in PAYLOADS.items():
        payload = build(marker)
        files[f"{name}.pkl"] = payload
        files[f"{name}.zip.pth"] = torch_zip(payload)
        files[f"{name}.legacy.pth"] = legacy_stream(payload)
    files["build_on_allowed_global.pth"] = torch_zip(build_on_allowed_global())
    files["memo_bomb.pth"] = torch_zip(memo_bomb())
    files["binbytes8_terabyte.pth"] = torch_zip(binbytes8_terabyte())
    files["deep_nesting.pth"] = torch_zip(deep_nesting())
    files["deep_marks.pkl"] = deep_marks()
    files["self_reference.pth"] = torch_zip(self_reference())
    files["storage_larger_than_record.pth"] = storage_larger_than_record()
    files["extent_past_storage.pth"] = extent_past_storage()
    files["duplicate_data_pkl.pth"] = duplicate_data_pkl()
    for name, build_broken in SAFETENSORS_BROKEN.items():
        files[f"safetensors_{name}.safetensors"] = build_broken()
    paths = []
    for name, data in files.items():
        path = out / name
        path.write_bytes(data)
        paths.append(path)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "adversarial-corpus")
    written = write_corpus(target, target / "PWNED")
    print(f"wrote {len(written)} files to {target}")
