"""GGUF files (issue 29, part 4): read lazily as a format plug-in, shown, verified, scanned,
diffed and converted to safetensors, against the ``gguf`` package (gguf-py 0.19.0): its
reader for what a file holds, ``gguf.quants.dequantize`` for the values, bit for bit.

The fixtures (tests/fixtures/gguf/) are written by ``GGUFWriter``; damaged and unusual files are
made here, in tmp_path: by ``GGUFWriter`` where it can write them, else by :func:`raw_gguf`,
which lays out the bytes of a GGUF file as the format describes them.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli.app import cli
from ckpttool.errors import CkptError
from ckpttool.formats.gguf import reader
from tests.fixtures.gguf import GGUF_FILES, QUANTIZED
from tests.support.helpers import FIXTURES

GGUF = FIXTURES / "gguf"
LLAMA = GGUF / "llama_f32.gguf"
Q8 = GGUF / "q8_0.gguf"


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def raw_gguf(
    tensors: list[tuple[str, tuple[int, ...], int, int]],
    data: bytes,
    *,
    kv: bytes = b"",
    n_kv: int = 0,
    version: int = 3,
    alignment: int = 32,
) -> bytes:
    """A GGUF file: ``tensors`` as (name, ne, GGML type id, offset), ``kv`` the encoded
    key/values (``n_kv`` of them), the data section at the next multiple of ``alignment``."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), n_kv) + kv
    for name, ne, type_id, offset in tensors:
        out += _string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + data


def f32(name: str, count: int, offset: int) -> tuple[str, tuple[int, ...], int, int]:
    return (name, (count,), 0, offset)


def two_vectors(**changes: Any) -> bytes:
    """Two F32 [8] tensors, each 32 bytes, at offsets 0 and 32: a valid file to damage."""
    tensors = [f32("a.weight", 8, 0), f32("b.weight", 8, 32)]
    data = np.arange(16, dtype=np.float32).tobytes()
    return raw_gguf(changes.pop("tensors", tensors), changes.pop("data", data), **changes)


def written(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def gguf_tensors(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


# -- reading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GGUF_FILES)
def test_every_fixture_reads_as_the_gguf_package_reads_it(name: str) -> None:
    """Names, GGML types, shapes in torch's order (gguf-py's ``shape`` is ``ne``, innermost
    first: reversed), byte sizes and absolute data offsets."""
    path = GGUF / name
    expected = gguf_tensors(path)
    with open_checkpoint(path) as ckpt:
        assert ckpt.format == "gguf"
        records = ckpt.tensors()
        assert [r.key for r in records] == list(expected)
        for record in records:
            want = expected[record.key]
            kind = want.tensor_type.name
            assert record.dtype == reader.PLAIN_TYPES.get(kind, kind)
            assert list(record.shape) == [int(n) for n in reversed(want.shape)]
            assert record.stored_nbytes == want.n_bytes
            assert record.storage is not None
            assert ckpt.storage_span(record.storage) == (want.data_offset, want.n_bytes)
            assert (record.quant is not None) == (kind not in reader.PLAIN_TYPES)


def _every_value_type(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", -0.25)
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc"])
    writer.add_array("t.long", list(range(100)))
    writer.add_tensor("w", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_metadata_of_every_value_type(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    _every_value_type(path)
    with open_checkpoint(path) as ckpt:
        metadata = ckpt.details["gguf_metadata"]
    assert metadata == {
        "general.architecture": "llama",
        "t.u8": 200, "t.i8": -100, "t.u16": 60000, "t.i16": -30000, "t.u32": 4_000_000_000,
        "t.i32": -2_000_000_000, "t.f32": 0.5, "t.bool": True, "t.str": "héllo",
        "t.u64": 2**63 + 5, "t.i64": -(2**62), "t.f64": -0.25,
        "t.ints": {"array": "INT32", "length": 3, "items": [1, 2, 3]},
        "t.strs": {"array": "STRING", "length": 2, "items": ["a", "bc"]},
        "t.long": {"array": "INT32", "length": 100},  # long: its type and length only
    }  # fmt: skip


def test_version_2_reads_as_version_3(tmp_path: Path) -> None:
    data = bytearray(Q8.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path = written(tmp_path, bytes(data))
    with open_checkpoint(path) as ckpt, open_checkpoint(Q8) as original:
        assert ckpt.details["gguf_version"] == 2
        assert ckpt.tensors() == original.tensors()


def test_a_vocabulary_is_stepped_over_not_held(tmp_path: Path) -> None:
    """150,000 tokens: the file is listed with the vocabulary's length, and listing holds far
    less than the list of strings would (tens of MB)."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"token_{i:06d}" for i in range(150_000)])
    writer.add_tensor("w", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tracemalloc.start()
    try:
        with open_checkpoint(path) as ckpt:
            details = ckpt.details
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert details["gguf_model"]["vocabulary"] == 150_000
    assert details["gguf_metadata"]["tokenizer.ggml.tokens"] == {
        "array": "STRING",
        "length": 150_000,
    }
    assert peak < 6 << 20  # the strings as a list: ~13 MB


def test_listing_reads_no_tensor_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of the header region ends before the data section (chunks of one byte: each
    read is exactly what the reader asked for)."""
    reads: list[tuple[int, int]] = []
    original = reader.read_range

    def recording(source: Any, length: int, offset: int) -> bytearray:
        reads.append((offset, length))
        return original(source, length, offset)

    monkeypatch.setattr(reader, "CHUNK", 1)
    monkeypatch.setattr(reader, "read_range", recording)
    with open_checkpoint(LLAMA) as ckpt:
        ckpt.tensors()
        data_offset = ckpt.details["data_offset"]
    assert reads and max(offset + length for offset, length in reads) <= data_offset


def test_read_over_http_as_locally(tmp_path: Path) -> None:
    from tests.support.range_server import RangeServer

    server = RangeServer().start()
    try:
        url = server.add("q8_0.gguf", Q8.read_bytes())
        remote = json.loads(run("show", url, "--json", "--stats").stdout)
        local = json.loads(run("show", Q8, "--json", "--stats").stdout)
        remote.pop("file"), local.pop("file")
        assert remote == local
        result = run("convert", url, tmp_path / "r.safetensors", "--dequantize")
        assert result.exit_code == 0, result.output
    finally:
        server.stop()
    assert run("convert", Q8, tmp_path / "l.safetensors", "--dequantize").exit_code == 0
    assert (tmp_path / "r.safetensors").read_bytes() == (tmp_path / "l.safetensors").read_bytes()


# -- show -------------------------------------------------------------------------------------


def test_show_lists_ggml_types_and_the_model_facts_not_the_vocabulary() -> None:
    result = run("show", LLAMA)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "format:     gguf" in out
    assert "model:      llama, context 64, blocks 1, embedding 64, vocabulary 40" in out
    assert "ggml types: F32 x3, F16 x1, BF16 x1" in out
    assert "tokenizer.ggml.tokens = [40 x STRING]" in out
    assert "general.tags = ['tiny', 'test']" in out
    assert "tok39" not in out  # the vocabulary is not dumped
    assert "blk.0.attn_q.weight     float16   [64, 64]" in out


@pytest.mark.parametrize("stem", QUANTIZED)
def test_show_names_each_quantized_type_and_its_bytes(stem: str) -> None:
    path = GGUF / f"{stem}.gguf"
    report = json.loads(run("show", path, "--json").stdout)
    row = next(t for t in report["tensors"] if t["key"] == "blk.0.attn_q.weight")
    want = gguf_tensors(path)["blk.0.attn_q.weight"]
    assert row["dtype"] == stem.upper() == want.tensor_type.name
    assert row["nbytes"] == want.n_bytes
    assert report["bytes_by_dtype"][stem.upper()] == want.n_bytes
    assert report["details"]["ggml_types"] == {stem.upper(): 1, "F32": 1}


def iq_file(tmp_path: Path) -> Path:
    """An IQ2_XXS tensor (random blocks: ckpttool names the type, does not decode it)."""
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    blocks = np.random.RandomState(0).randint(0, 256, size=(2, 66)).astype(np.uint8)
    writer.add_tensor("blk.0.attn_k.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_iq_types_are_named_and_refused_when_their_values_are_needed(tmp_path: Path) -> None:
    path = iq_file(tmp_path)
    result = run("show", path)
    assert result.exit_code == 0, result.output
    assert "IQ2_XXS  [2, 256]" in result.stdout
    out = tmp_path / "out.safetensors"
    result = run("convert", path, out, "--dequantize")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"Error: {path}: blk.0.attn_k.weight: ckpttool does not decode IQ2_XXS blocks (it "
        "decodes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K); leave the tensor out "
        "with --filter"
    ]
    assert list(tmp_path.iterdir()) == [path]


# -- verify and scan --------------------------------------------------------------------------


@pytest.mark.parametrize("name", GGUF_FILES)
def test_the_fixtures_verify_clean(name: str) -> None:
    result = run("verify", GGUF / name)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            {"tensors": [f32("a.weight", 8, 0), f32("b.weight", 8, 36)], "data": bytes(100)},
            "tensor 'b.weight': its offset 36 is not a multiple of the alignment 32",
        ),
        (
            {"tensors": [f32("a.weight", 8, 0), f32("b.weight", 16, 0)], "data": bytes(64)},
            "tensor 'b.weight': overlaps tensor 'a.weight' by 32 bytes",
        ),
        ({"data": bytes(64 + 40)}, "40 trailing bytes after the last tensor"),
        ({"data": bytes(48)}, "tensor 'b.weight': ends at byte 192, past the end of the file"),
        (
            {"tensors": [f32("a.weight", 8, 0), ("b.weight", (8,), 99, 32)]},
            "tensor 'b.weight': unknown GGML type 99",
        ),
        (
            {"tensors": [f32("a.weight", 8, 0), ("b.weight", (40,), 8, 32)]},
            "tensor 'b.weight': its rows of 40 values are not whole Q8_0 blocks of 32",
        ),
    ],
    ids=["misaligned", "overlap", "trailing", "cut-short", "unknown-type", "partial-block"],
)
def test_verify_finds_damage(tmp_path: Path, damage: dict[str, Any], problem: str) -> None:
    path = written(tmp_path, two_vectors(**damage))
    result = run("verify", path, "--json")
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["files"][0]["problems"]
    assert any(p.startswith(problem) for p in problems), problems
    # every other command refuses it, naming the file and the tensor, and writes nothing
    refused = run("convert", path, tmp_path / "out.safetensors")
    assert refused.exit_code == 2
    assert refused.stderr.splitlines() == [f"Error: {path}: invalid GGUF file: {problems[0]}"]
    assert list(tmp_path.iterdir()) == [path]


def test_the_data_section_start_is_aligned_to_general_alignment(tmp_path: Path) -> None:
    kv = _string("general.alignment") + struct.pack("<II", 4, 64)
    data = np.arange(8, dtype=np.float32).tobytes()
    path = written(tmp_path, raw_gguf([f32("a", 8, 0)], data, kv=kv, n_kv=1, alignment=64))
    with open_checkpoint(path) as ckpt:
        assert ckpt.details["alignment"] == 64
        assert ckpt.details["data_offset"] % 64 == 0
    assert gguf.GGUFReader(str(path)).tensors[0].data.tolist() == list(range(8))
    result = run("diff", path, path)
    assert result.exit_code == 0, result.output


def test_scan_finds_no_pickle() -> None:
    result = run("scan", Q8, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["clean"]
    assert report["files"] == [
        {"path": str(Q8), "format": "gguf", "error": None, "notes": [], "places": {}, "globals": []}
    ]


# -- diff -------------------------------------------------------------------------------------


def test_diff_compares_decoded_values(tmp_path: Path) -> None:
    assert run("diff", Q8, Q8).exit_code == 0
    converted = tmp_path / "q8.safetensors"
    assert run("convert", Q8, converted, "--dequantize").exit_code == 0
    same = run("diff", Q8, converted, "--json")
    assert same.exit_code == 0, same.output  # Q8_0 against its float32 values: equal
    # another quantization of other values differs, value by value
    result = run("diff", Q8, GGUF / "q4_0.gguf", "--json")
    assert result.exit_code == 1
    entry = next(
        t for t in json.loads(result.stdout)["tensors"] if t["key"] == "blk.0.attn_q.weight"
    )
    assert entry["status"] == "differ" and "dtype Q8_0 -> Q4_0" in entry["changes"]


# -- convert ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", QUANTIZED)
@pytest.mark.parametrize("dtype", ["keep", "bf16", "fp16"])
def test_dequantized_values_equal_the_gguf_packages(tmp_path: Path, stem: str, dtype: str) -> None:
    """Every decoded type, bit for bit, as ``gguf.quants.dequantize`` gives it (float32 by
    default; cast to the dtype asked for, compared after the same cast)."""
    path = GGUF / f"{stem}.gguf"
    out = tmp_path / "out.safetensors"
    result = run("convert", path, out, "--dequantize", "--dtype", dtype)
    assert result.exit_code == 0, result.output
    got = load_file(str(out))
    target = {"keep": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for name, tensor in gguf_tensors(path).items():
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        assert got[name].dtype == target
        assert torch.equal(got[name], want.to(target)), name


def test_plain_types_are_copied_or_cast(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = run("convert", LLAMA, out)
    assert result.exit_code == 0, result.output
    got = load_file(str(out))
    for name, tensor in gguf_tensors(LLAMA).items():
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        kind = tensor.tensor_type.name
        assert str(got[name].dtype) == "torch." + reader.PLAIN_TYPES[kind]  # copied as stored
        assert torch.equal(got[name].float(), want)
    cast = tmp_path / "cast.safetensors"
    assert run("convert", LLAMA, cast, "--dtype", "fp32").exit_code == 0
    assert {str(t.dtype) for t in load_file(str(cast)).values()} == {"torch.float32"}


def test_quantized_tensors_need_dequantize(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = run("convert", Q8, out)
    assert result.exit_code == 2
    assert "add --dequantize" in result.stderr and "blk.0.attn_q.weight" in result.stderr
    assert not out.exists()
    result = run("convert", Q8, tmp_path / "out.pth")  # torch cannot hold GGML blocks either
    assert result.exit_code == 2 and "add --dequantize" in result.stderr


# -- bad input --------------------------------------------------------------------------------


def _header(n_tensors: int = 0, n_kv: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"GGUX" + bytes(60), "not a checkpoint: unrecognised format"),
        (_header(version=1), "a GGUF v1 file: ckpttool reads GGUF v2 and v3 only"),
        (_header(version=4), "GGUF version 4 is not one ckpttool reads (v2, v3)"),
        (
            b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
            "a big-endian GGUF file (version 3): ckpttool reads little-endian GGUF v2 and v3 only",
        ),
        (b"GGUF\x03\x00", "GGUF header cut short: no version"),
        (_header()[:15], "GGUF tensor count needs 8 bytes at byte 8, but the file has 7 left"),
        (
            _header(n_kv=1) + _string("general.name") + struct.pack("<I", 8) + b"\xff" * 8,
            "GGUF metadata 'general.name' needs 18,446,744,073,709,551,615 bytes at byte 56",
        ),
        (
            _header(n_kv=1) + _string("general.name") + struct.pack("<IQ", 8, 1 << 20) + b"x",
            "GGUF metadata 'general.name' needs 1,048,576 bytes at byte 56, but the file has 1 left",
        ),
        (
            _header(n_kv=1) + _string("t.a") + struct.pack("<IIQ", 9, 8, 10**12),
            "GGUF array 't.a' of 1,000,000,000,000 STRING needs 8,000,000,000,000 bytes",
        ),
        (_header(n_tensors=10**15), "GGUF header of 0 key/values, 1,000,000,000,000,000 tensors"),
        (
            _header(n_kv=1) + _string("k") + struct.pack("<I", 77) + bytes(8),
            "GGUF metadata 'k' has unknown value type 77",
        ),
        (
            raw_gguf([("big", (1 << 20, 1 << 20), 0, 0)], b""),
            "invalid GGUF file: tensor 'big': ends at byte 4,398,046,511,200, past the end",
        ),
        (
            raw_gguf([("big", (1 << 40, 1 << 40), 0, 0)], b""),
            "invalid GGUF file: tensor 'big': its shape [1099511627776, 1099511627776] is too",
        ),
    ],
    ids=[
        "bad-magic", "v1", "v4", "big-endian", "no-version", "cut-header", "string-2**64",
        "string-past-end", "array-past-end", "tensor-count", "value-type", "tensor-past-end",
        "huge-shape",
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = written(tmp_path, data)
    for command in (["show"], ["convert", "--dequantize"], ["diff", path]):
        args = [command[0], path, *command[1:]]
        if command[0] == "convert":
            args.append(tmp_path / "out.safetensors")
        result = run(*args)
        assert result.exit_code == 2, (command, result.output)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: {message}"), lines
    assert list(tmp_path.iterdir()) == [path]


def test_a_lying_length_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    """A metadata string that claims 1 TB in a 100-byte file: refused from the file's size,
    with next to nothing allocated."""
    data = _header(n_kv=1) + _string("k") + struct.pack("<IQ", 8, 1 << 40) + bytes(40)
    path = written(tmp_path, data)
    tracemalloc.start()
    try:
        with pytest.raises(CkptError, match="needs 1,099,511,627,776 bytes"):
            open_checkpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_a_string_longer_than_any_gguf_holds_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the file but longer than the cap (16 MiB; 100 bytes here): a damaged file."""
    monkeypatch.setattr(reader, "MAX_STRING", 100)
    path = written(
        tmp_path, _header(n_kv=1) + _string("k") + struct.pack("<IQ", 8, 101) + bytes(101)
    )
    result = run("show", path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"Error: {path}: GGUF metadata 'k' claims a string of 101 bytes (at most 100 read)"
    ]


def test_ggml_types_are_no_torch_dtypes_to_a_pickle(tmp_path: Path) -> None:
    """The dtype table's GGML rows are not ``torch.<name>`` globals: a pickle naming
    ``torch.Q8_0`` names something torch does not have (unknown), as before they were rows."""
    for name, verdict in (("Q8_0", "unknown"), ("float32", "safe")):
        path = written(tmp_path, b"\x80\x02ctorch\n" + name.encode() + b"\nq\x00.", f"{name}.pkl")
        report = json.loads(run("scan", path, "--json").stdout)
        assert report["files"][0]["globals"][0]["verdict"] == verdict


def test_dequantized_tensors_are_decoded_once_and_verified_by_crc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``convert`` decodes each quantized tensor once (bench/gguf.py: a second decoding was a
    quarter of the time) and verifies the output read back against the CRC-32 of the bytes
    written: a damaged read-back is still caught, and nothing is left."""
    import ckpttool.commands.convert.run as convert_module
    from ckpttool.formats.gguf import quants

    decoded: list[str] = []
    decode = quants.decode

    def counting(record: Any, data: Any) -> Any:
        decoded.append(record.key)
        return decode(record, data)

    monkeypatch.setattr(quants, "decode", counting)
    out = tmp_path / "out.safetensors"
    assert run("convert", Q8, out, "--dequantize").exit_code == 0
    assert decoded == ["blk.0.attn_q.weight"]
    stored = convert_module._stored_bytes

    def damaged(written: Any, record: Any) -> Any:
        got = stored(written, record)
        return None if got is None else memoryview(bytes(got)[:-1] + bytes([got[-1] ^ 1]))

    monkeypatch.setattr(convert_module, "_stored_bytes", damaged)
    result = run("convert", Q8, tmp_path / "again.safetensors", "--dequantize")
    assert result.exit_code == 1, result.output
    assert "does not read back bit-for-bit equal" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]


def test_verify_values_finds_a_nan_scale(tmp_path: Path) -> None:
    """A Q8_0 block whose fp16 scale is NaN decodes to 32 NaN values: ``verify --values``
    reports them (the type's other files verify clean)."""
    data = bytearray(Q8.read_bytes())
    offset = gguf_tensors(Q8)["blk.0.attn_q.weight"].data_offset  # the first block's scale
    data[offset : offset + 2] = np.float16(np.nan).tobytes()
    path = written(tmp_path, bytes(data))
    assert run("verify", Q8, "--values").exit_code == 0
    result = run("verify", path, "--values", "--json")
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["files"][0]["problems"]
    assert problems == ["blk.0.attn_q.weight: 32 NaN and 0 Inf values"]
    assert run("verify", iq_file(tmp_path), "--values").exit_code == 0  # not decoded: not checked


def test_a_tensor_past_the_end_is_refused_when_read_never_allocated(tmp_path: Path) -> None:
    """Opened leniently (as verify opens), a tensor that claims 4 TB at an offset past the file
    is a problem listed, and reading it is refused before anything is allocated for it."""
    path = written(tmp_path, raw_gguf([("w", (1 << 20, 1 << 20), 0, 1 << 62)], b""))
    with open_checkpoint(path, strict=False) as ckpt:
        assert any("past the end of the file" in problem for problem in ckpt.problems)
        with pytest.raises(CkptError, match="w: extends past its storage's bytes"):
            ckpt.read_bytes(ckpt.tensors()[0])


def test_a_nan_scale_decodes_to_nan_without_a_warning(tmp_path: Path) -> None:
    import warnings

    data = bytearray(Q8.read_bytes())
    offset = gguf_tensors(Q8)["blk.0.attn_q.weight"].data_offset
    data[offset : offset + 2] = np.float16(np.inf).tobytes()  # an infinite scale
    data[offset + 2] = 0  # times 0: NaN, NumPy's "invalid value" when not silenced
    data[offset + 34 : offset + 36] = np.float16(np.nan).tobytes()
    path = written(tmp_path, bytes(data))
    with open_checkpoint(path) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("error")
        values = ckpt.dequantize(ckpt.tensors()[0]).reshape(-1)
    assert np.isnan(values[0]) and np.isinf(values[1:32]).all() and np.isnan(values[32:64]).all()
