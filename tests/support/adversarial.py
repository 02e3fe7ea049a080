"""Hostile inputs, built byte by byte: code-execution payloads, resource bombs, broken archives.

Used by the security tests and by ``tests/cli/test_adversarial_cli.py`` (every command on every
file); ``python -m tests.support.adversarial OUT_DIR`` writes the whole corpus (:func:`corpus`)
to a folder so any tool can be tried on it. Besides files built from scratch it holds damaged
copies of real fixtures (a flipped byte, a renamed local header, 20 truncations each of a zip, a
legacy and a safetensors file). Every code-execution payload, if it ran, would create the file
named by ``marker`` — tests assert that file never appears.
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
from tests.support.helpers import FIXTURES


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


def frame_memoize_p4(marker: Path) -> bytes:
    """Protocol 4 as CPython writes it: a FRAME, MEMOIZE, STACK_GLOBAL, the callable via BINGET."""
    body = _short_unicode("os") + b"\x94" + _short_unicode("system") + b"\x94\x93\x94" + b"0"
    body += b"h\x02" + _short_unicode(_command(marker)) + b"\x85R."
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


def pydoc_pipepager_p2(marker: Path) -> bytes:
    """A gadget outside the usual block lists: pydoc.pipepager(text, cmd) runs a shell."""
    return (
        b"\x80\x02cpydoc\npipepager\n" + _binunicode("") + _binunicode(_command(marker)) + b"\x86R."
    )


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
    "frame_memoize_p4": frame_memoize_p4,
    "pydoc_pipepager_p2": pydoc_pipepager_p2,
}


def touch_marker(path: str) -> None:
    """A callable no deny-list names: what an unknown gadget looks like to the reader."""
    Path(path).touch()


def unlisted_callable_p2(marker: Path) -> bytes:
    """Calls tests.support.adversarial.touch_marker: not on any deny-list, so the reader does
    not refuse the file; it must record the call as an opaque object and still never make it."""
    return (
        b"\x80\x02ctests.support.adversarial\ntouch_marker\n" + _binunicode(str(marker)) + b"\x85R."
    )


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
    """A list holding itself: legitimate (a parent link is the same construct), read with a
    back-reference where it meets itself."""
    return b"\x80\x02]q\x00h\x00a."


def reference_bomb() -> bytes:
    """A 3 KB "billion laughs": 19 references to 1,000 references to a list of 1,000 ints."""
    body = b"\x80\x02]q\x00(" + b"K\x01" * 1000 + b"e0"
    body += b"]q\x01(" + b"h\x00" * 1000 + b"e0"
    return body + b"]q\x02(" + b"h\x01" * 19 + b"e."


def tensor_reference_bomb() -> bytes:
    """1.4 KB of pickle naming one tensor 316 x 316 times: 100,000 rows for every consumer."""
    tensor = tensor_pickle("0", 4, (4,))
    tensor = tensor[tensor.index(b"ctorch._utils") : -2]  # the value of {"w": ...}
    body = b"\x80\x02" + tensor + b"q\x000" + b"]q\x01(" + b"h\x00" * 316 + b"e0"
    return torch_zip(body + b"]q\x02(" + b"h\x01" * 316 + b"e.", {"0": bytes(16)})


def huge_int() -> bytes:
    """{"step": an integer of 5,000 digits}: Python refuses to print it (ValueError)."""
    value = 10**5000
    raw = value.to_bytes((value.bit_length() >> 3) + 1, "little", signed=True)
    return b"\x80\x02}" + _binunicode("step") + b"\x8b" + struct.pack("<i", len(raw)) + raw + b"s."


def text_line_flood(lines: int = 100_000) -> bytes:
    """A protocol-0 list of 100,000 text INTs: each opcode reads a line; must stay linear."""
    return b"(" + b"I1\n" * lines + b"l."


def zip_bomb_data_pkl(inflated: int = 256 << 20) -> bytes:
    """A deflated data.pkl of ~250 KB that inflates to 256 MB (torch never compresses)."""
    buffer = io.BytesIO()
    with (
        zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("archive/data.pkl", "w", force_zip64=True) as record,
    ):
        record.write(b"\x80\x02N.")
        chunk = bytes(1 << 20)
        for _ in range(inflated >> 20):
            record.write(chunk)
    return buffer.getvalue()


def record_size_lie() -> bytes:
    """The central directory says data/0 holds 4 GiB (the file has 16 bytes); the pickle's
    storage agrees, so the sizes match each other and only the file's size exposes the lie."""
    from ckpttool.formats.zip_writer import TorchZipWriter

    buffer = io.BytesIO()
    writer = TorchZipWriter(buffer)
    writer.write("archive/data.pkl", tensor_pickle("0", 1 << 30, (1 << 30,)))
    writer.write("archive/data/0", bytes(16))
    writer.entries[-1].size = 1 << 32
    writer.close()
    return buffer.getvalue()


def deflated_storage() -> bytes:
    """A re-zipped checkpoint: its storage record deflated (torch.load reads it; mmap cannot)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", tensor_pickle("0", 4, (4,)))
        archive.writestr("archive/data/0", bytes(16))
    return buffer.getvalue()


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


#: Archives that are structurally broken, with the message the reader gives for each.
BROKEN_ARCHIVES: list[tuple[Callable[[], bytes], str]] = [
    (storage_larger_than_record, "claims 4,000 bytes but the file holds 16"),
    (extent_past_storage, "reaches byte 4,000 of its storage, which has 16"),
    (duplicate_data_pkl, "two records named 'archive/data.pkl'"),
]


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
    # JSON that Python's decoder itself chokes on: RecursionError, ValueError (int digits)
    "deep_json": lambda: _raw_safetensors(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "huge_int": lambda: _raw_safetensors(
        b'{"a":{"dtype":"F32","shape":[' + b"7" * 5000 + b'],"data_offsets":[0,4]}}', bytes(4)
    ),
    "unhashable_dtype": lambda: safetensors_file(
        {"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4)
    ),
    "huge_shape": lambda: safetensors_file(
        {"a": {"dtype": "F32", "shape": [2**62] * 200, "data_offsets": [0, 4]}}, bytes(4)
    ),
}


def _raw_safetensors(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


# --- damaged copies of real fixtures --------------------------------------------------------

#: The real files the corpus damages: a MiniMind resume (torch zip), a legacy file, safetensors.
TRUNCATED_SOURCES = {
    "resume": FIXTURES / "minimind/pretrain_32_resume.pth",
    "legacy": FIXTURES / "legacy/resume_bigkeys.pth",
    "safetensors": FIXTURES / "safetensors/model.safetensors",
}


def truncation_offsets(size: int, count: int = 20) -> list[int]:
    """``count`` cut points: inside the first header, spread over the file, in the zip's tail."""
    fixed = [1, 8, 30, 100, size - 100, size - 22, size - 1]
    spread = [size * k // (count - len(fixed) + 1) for k in range(1, count - len(fixed) + 1)]
    offsets = sorted(set(fixed + spread))
    assert len(offsets) == count and offsets[0] > 0 and offsets[-1] < size
    return offsets


def truncated(source: Path, offset: int) -> bytes:
    return source.read_bytes()[:offset]


def _record_data_start(data: bytes, suffix: str) -> int:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    return info.header_offset + 30 + name_len + extra_len


def bad_crc() -> bytes:
    """The MiniMind resume fixture with one byte of a storage flipped: only a CRC shows it."""
    data = bytearray(TRUNCATED_SOURCES["resume"].read_bytes())
    data[_record_data_start(bytes(data), "/data/5") + 3] ^= 0xFF
    return bytes(data)


def local_header_mismatch() -> bytes:
    """The resume fixture with a local header naming a record other than the directory does."""
    data = bytearray(TRUNCATED_SOURCES["resume"].read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/3"))
    data[info.header_offset + 30 + len(info.filename) - 1] = ord("9")
    return bytes(data)


def corpus(marker: Path) -> dict[str, bytes]:
    """Every hostile input by file name. The suffix tells the container (``.pkl`` bare pickle,
    ``.zip.pth``/``.pth`` torch zip, ``.legacy.pth`` legacy stream, ``.safetensors``)."""
    files: dict[str, bytes] = {}
    for name, build in {**PAYLOADS, "unlisted_callable_p2": unlisted_callable_p2}.items():
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
    files["reference_bomb.pkl"] = reference_bomb()
    files["tensor_reference_bomb.pth"] = tensor_reference_bomb()
    files["huge_int.pth"] = torch_zip(huge_int())
    files["text_line_flood.pkl"] = text_line_flood()
    files["zip_bomb_data_pkl.pth"] = zip_bomb_data_pkl()
    files["record_size_lie.pth"] = record_size_lie()
    files["deflated_storage.pth"] = deflated_storage()
    files["storage_larger_than_record.pth"] = storage_larger_than_record()
    files["extent_past_storage.pth"] = extent_past_storage()
    files["duplicate_data_pkl.pth"] = duplicate_data_pkl()
    files["bad_crc.pth"] = bad_crc()
    files["local_header_mismatch.pth"] = local_header_mismatch()
    files["torchscript.pt"] = (FIXTURES / "special/torchscript.pt").read_bytes()
    for name, build_broken in SAFETENSORS_BROKEN.items():
        files[f"safetensors_{name}.safetensors"] = build_broken()
    for kind, source in TRUNCATED_SOURCES.items():
        for offset in truncation_offsets(source.stat().st_size):
            files[f"truncated_{kind}_{offset}{source.suffix}"] = truncated(source, offset)
    return files


def write_corpus(out: Path, marker: Path) -> list[Path]:
    """Write every hostile input under ``out`` (used by ``python -m tests.support.adversarial``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in corpus(marker).items():
        path = out / name
        path.write_bytes(data)
        paths.append(path)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "adversarial-corpus")
    written = write_corpus(target, target / "PWNED")
    print(f"wrote {len(written)} files to {target}")
