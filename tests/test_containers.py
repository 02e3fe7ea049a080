"""Container-level parser differentials: ckpttool reads a file the way torch.load would.

For every hostile file of :mod:`tests.support.containers`: ``torch.load(weights_only=False)``
in a throwaway process runs its payload (the marker appears: the file is live), ``ckpttool
scan`` flags it (exit 1), no command runs it, and show, convert and diff refuse those that read
two ways, naming the ambiguity (exit 2). For the benign files torch writes for the same classes
(legacy files in pickle protocols 2 to 5, ``torch.save(model)`` and ``torch.save(optimizer)``
in the legacy format, an archive saved without CRC-32s): ckpttool reads what
``torch.load(weights_only=True)`` (or, for pickled objects, ``weights_only=False``) reads.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.scan import scan
from ckpttool.commands.verify import verify
from ckpttool.errors import AmbiguousFileError, NotACheckpointError
from ckpttool.formats.torch_zip.zip_index import AmbiguousZipError, ZipIndex
from tests.support import containers
from tests.support.fuzz_targets import LOADABLE_ZIP_MUTATIONS, mutate
from tests.support.helpers import FIXTURES

HOSTILE = sorted(containers.HOSTILE)
REPO = Path(__file__).resolve().parents[1]
#: Callables on no deny-list: scan flags them as unknown, the other commands read the file
#: (keeping each as an opaque object, never calling it), as for any pickle.
UNLISTED = {f"legacy_payload_in_{what}.pth" for what in ("magic", "version", "sys_info", "keys")}


def _write(tmp_path: Path, name: str) -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    path = tmp_path / name
    path.write_bytes(containers.HOSTILE[name](marker))
    return path, marker


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_files_are_live_under_torch_load(tmp_path: Path, name: str) -> None:
    """Positive control: torch.load(weights_only=False) does run each payload."""
    path, marker = _write(tmp_path, name)
    code = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the unlisted callable is this repo's
    subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, check=False, cwd=REPO, env=env
    )
    assert marker.exists()


@pytest.mark.parametrize("name", HOSTILE)
def test_scan_flags_and_no_command_runs_it(tmp_path: Path, name: str) -> None:
    path, marker = _write(tmp_path, name)
    report = scan([path])
    assert report.found and not report.clean
    flagged = report.files[0]
    names = {use.qualname for use in flagged.flagged}
    if name in UNLISTED:
        assert names == {"tests.support.adversarial.touch_marker"}, flagged
        names.add("builtins.open")
    if name in containers.AMBIGUOUS:
        assert any(
            note.startswith("ambiguous: ") and containers.AMBIGUOUS[name] in note
            for note in flagged.notes
        ), flagged.notes
    if "builtins.open" not in names:  # a zip directory read two ways: the ambiguity alone
        assert name in ("zip_two_directories.pth", "zip_two_zip64_records.pth"), flagged
    runner = CliRunner()
    assert runner.invoke(cli, ["scan", str(path)]).exit_code == 1
    for args in (
        ["show", str(path)],
        ["verify", str(path)],
        ["convert", str(path), str(tmp_path / "out.safetensors")],
        ["diff", str(path), str(path)],
        ["rescale-step", str(path), "--world-size", "2", "--dry-run"],
    ):
        result = runner.invoke(cli, args)
        assert result.exit_code in ((0, 1, 2) if name in UNLISTED else (1, 2)), args
        assert "Traceback" not in result.output + result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(containers.AMBIGUOUS))
def test_ambiguous_files_are_refused_by_name(tmp_path: Path, name: str) -> None:
    path, marker = _write(tmp_path, name)
    runner = CliRunner()
    if name.startswith("tar_"):  # refused as the tar format whatever else it is
        expected = "pre-0.4 tar format"
    else:
        (result,) = verify([path])  # verify: a problem naming it
        assert any(containers.AMBIGUOUS[name] in problem for problem in result.problems)
        expected = f"ambiguous file, refused: .*{containers.AMBIGUOUS[name]}"
        with pytest.raises(AmbiguousFileError):
            open_checkpoint(path, refuse_dangerous=False)
    for args in (
        ["show", str(path)],
        ["convert", str(path), str(tmp_path / "out.safetensors")],
        ["diff", str(path), str(path)],
        ["rescale-step", str(path), "--world-size", "2", "--dry-run"],
    ):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.count("\n") == 1
        assert re.search(expected, result.stderr), result.stderr
    assert not marker.exists()


# --- 1, 2: legacy streams ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_legacy_files_of_every_protocol_read_as_torch_reads_them(
    tmp_path: Path, protocol: int
) -> None:
    import torch

    path = tmp_path / "legacy.pth"
    path.write_bytes(containers.legacy_state_dict(protocol))
    # torch's weights-only unpickler reads protocols 2 and 3 only (no LONG in 1, no FRAME in
    # 4 and 5): this file is torch's own, so the full unpickler may read it. (Protocol 0 is
    # unreadable to torch.load itself: its persistent ids are text.)
    expected = torch.load(path, weights_only=protocol in (2, 3))
    with open_checkpoint(path) as ckpt:
        assert ckpt.format == "torch-legacy"
        records = {record.key: record for record in ckpt.tensors()}
        assert list(records) == list(expected)
        for key, tensor in expected.items():
            record = records[key]
            assert record.dtype == str(tensor.dtype).removeprefix("torch.")
            assert record.shape == tuple(tensor.shape)
            data, _ = ckpt.read_bytes(record)
            assert bytes(data) == tensor.numpy().tobytes()
    assert scan([path]).clean
    assert verify([path])[0].ok


def test_globals_of_every_legacy_pickle_are_reported() -> None:
    """Each of the five pickles may name a callable; scan sees it wherever it is."""
    for index in (0, 1, 2, 4):
        data = containers.legacy_payload_in(index)(Path("/nonexistent/marker"))
        with io.BytesIO(data) as handle:
            from ckpttool.formats.torch_legacy.reader import read_pickle_stream

            parsed = read_pickle_stream(
                handle, len(data), refuse_dangerous=False, track_spans=False
            )
        assert parsed.format == "torch-legacy"
        assert parsed.pickle is not None
        named = [(m, n) for m, n, _ in parsed.pickle.globals_seen]
        assert ("tests.support.adversarial", "touch_marker") in named


# --- 8: torch.save(model), torch.save(optimizer) -----------------------------------------


@pytest.mark.parametrize("builder", [containers.saved_model, containers.saved_optimizer])
def test_pickled_objects_read_alike_in_both_formats(tmp_path: Path, builder) -> None:  # type: ignore[no-untyped-def]
    views = []
    for legacy in (True, False):
        path = tmp_path / f"{legacy}.pth"
        path.write_bytes(builder(legacy))
        with open_checkpoint(path) as ckpt:
            assert ckpt.format == ("torch-legacy" if legacy else "torch-zip")
            views.append(
                [
                    (r.key.split(">")[-1], r.dtype, r.shape, bytes(ckpt.read_bytes(r)[0]))
                    for r in ckpt.tensors()
                ]
            )
    assert views[0] == views[1] and views[0]


def test_optimizer_state_keyed_by_parameters_is_named_by_storage(tmp_path: Path) -> None:
    path = tmp_path / "optimizer.pth"
    path.write_bytes(containers.saved_optimizer(legacy=True))
    with open_checkpoint(path) as ckpt:
        keys = [r.key for r in ckpt.tensors()]
    assert any(k.startswith("state.<parameter ") and k.endswith(">.momentum_buffer") for k in keys)


# --- 3: the tar format -------------------------------------------------------------------


def test_tar_format_is_refused_by_name_and_walked_by_scan(tmp_path: Path) -> None:
    path = tmp_path / "old.pth"
    path.write_bytes(containers.torch_tar(containers.BENIGN_PICKLE))
    with pytest.raises(NotACheckpointError, match=r"pre-0\.4 tar format"):
        open_checkpoint(path)
    report = scan([path])
    assert report.clean and report.files[0].format == "torch-tar"


def test_a_tar_torch_cannot_open_is_not_the_tar_format(tmp_path: Path) -> None:
    """torch goes on to the pickle stream when tarfile.open fails: so does ckpttool."""
    data = bytearray(containers.torch_tar(containers.BENIGN_PICKLE))
    data[148:156] = b"0000000\x00"  # a wrong checksum
    path = tmp_path / "not_tar.pth"
    path.write_bytes(bytes(data))
    with pytest.raises(NotACheckpointError, match="compressed or tar archive"):
        open_checkpoint(path)


def test_tar_member_storages_walked_in_torch_order(tmp_path: Path) -> None:
    """A storage entry's bytes are skipped by its element size, as torch reads them."""
    buffer = io.BytesIO()
    entry = b"\x80\x02(X\x01\x00\x00\x00kX\x03\x00\x00\x00cpuctorch\nFloatStorage\ntq\x00."
    storages = pickle.dumps(1, 2) + entry + struct.pack("<q", 2) + bytes(8)
    storages += containers.payload(tmp_path / "ran")  # the views pickle
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (
            ("storages", storages),
            ("tensors", pickle.dumps(0, 2)),
            ("pickle", containers.BENIGN_PICKLE),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "t.pth"
    path.write_bytes(buffer.getvalue())
    flagged = scan([path]).files[0]
    assert [use.qualname for use in flagged.flagged] == ["builtins.open"]
    assert "torch.FloatStorage" in [use.qualname for use in flagged.globals]


# --- 4, 5: zip archives ------------------------------------------------------------------


def test_upper_case_data_pkl_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    data = containers._zip(
        [("archive/DATA.PKL", containers.BENIGN_PICKLE), ("archive/version", b"3\n")]
    )
    path = tmp_path / "upper.pth"
    path.write_bytes(data)
    with open_checkpoint(path) as ckpt:
        assert ckpt.root == {"w": 1}


def test_storage_records_are_found_ignoring_case(tmp_path: Path) -> None:
    from tests.support.adversarial import tensor_pickle

    data = containers._zip(
        [
            ("archive/data.pkl", tensor_pickle("0", 4, (4,))),
            ("archive/DATA/0", bytes(range(16))),
            ("archive/version", b"3\n"),
        ]
    )
    path = tmp_path / "upper_storage.pth"
    path.write_bytes(data)
    with open_checkpoint(path) as ckpt:
        (record,) = ckpt.tensors()
        assert bytes(ckpt.read_bytes(record)[0]) == bytes(range(16))


def test_an_end_record_signature_in_the_last_bytes_is_ambiguous() -> None:
    data = containers._zip([("archive/data.pkl", containers.BENIGN_PICKLE)])
    with pytest.raises(AmbiguousZipError, match="last 21 bytes"):
        ZipIndex(io.BytesIO(data + b"PK\x05\x06" + bytes(10)))


def test_two_end_records_reaching_the_end_are_ambiguous() -> None:
    """An end record whose comment holds a second one: both reach the file's end exactly (a
    reader taking the first complete record and one taking the last read different ones)."""
    data = containers._zip([("archive/data.pkl", containers.BENIGN_PICKLE)])
    real = data[-22:-2]
    fake = real + (3).to_bytes(2, "little") + b"abc"
    doubled = data[:-22] + real + len(fake).to_bytes(2, "little") + fake
    with pytest.raises(AmbiguousZipError, match="two end-of-central-directory records"):
        ZipIndex(io.BytesIO(doubled))


# --- 6: safetensors polyglots -------------------------------------------------------------


def test_safetensors_polyglot_is_safetensors_to_the_safetensors_library(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    path.write_bytes(containers.safetensors_pickle_polyglot(tmp_path / "ran"))
    assert list(load_file(path)) == ["t"]
    with pytest.raises(AmbiguousFileError, match="also a pickle stream"):
        open_checkpoint(path)
    assert scan([path]).found


def test_a_plain_safetensors_file_is_not_ambiguous(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "model.bin"
    save_file({"w": torch.arange(4, dtype=torch.float32)}, path)
    with open_checkpoint(path) as ckpt:
        assert "ambiguous" not in ckpt.details
    assert scan([path]).clean


# --- 7: archives saved without CRC-32s -----------------------------------------------------


def test_crc_less_archive_reads_and_verify_says_so(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "nocrc.pth"
    path.write_bytes(containers.crc_less_zip())
    expected = torch.load(path, weights_only=True)
    with open_checkpoint(path) as ckpt:
        assert [r.key for r in ckpt.tensors()] == list(expected)
    (result,) = verify([path])
    assert result.ok, result.problems
    assert any("CRC-32s were not computed" in line for line in result.checked)
    assert scan([path]).clean


def test_a_zeroed_crc_among_computed_ones_is_still_a_mismatch(tmp_path: Path) -> None:
    """Only an archive whose every CRC is 0 counts as CRC-less."""
    import torch

    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, buffer)
    data = bytearray(buffer.getvalue())
    index = ZipIndex(io.BytesIO(bytes(data)))
    member = next(m for m in index.infolist() if m.filename.endswith("/data/0"))
    raw = bytes(data)
    at = raw.index(member.filename.encode(), raw.index(b"PK\x01\x02")) - 46
    data[at + 16 : at + 20] = bytes(4)  # its CRC in the directory
    path = tmp_path / "zeroed.pth"
    path.write_bytes(bytes(data))
    (result,) = verify([path])
    assert not result.ok and any("CRC-32 is" in p for p in result.problems)


# --- zip mutations that keep a file loadable by torch (fuzz/) -----------------------------


@pytest.mark.parametrize("kind", LOADABLE_ZIP_MUTATIONS)
@pytest.mark.parametrize("seed", range(4))
def test_loadable_zip_mutations_read_as_torch_reads_them(
    tmp_path: Path, kind: str, seed: int
) -> None:
    import random

    import torch

    source = FIXTURES / "special/views.pth"
    path = tmp_path / "mutated.pth"
    path.write_bytes(mutate(source.read_bytes(), kind, random.Random(seed), []))
    assert path.read_bytes() != source.read_bytes()
    expected = torch.load(path, weights_only=True)
    with open_checkpoint(path) as ckpt, open_checkpoint(source) as original:
        assert [r.key for r in ckpt.tensors()] == [r.key for r in original.tensors()]
        for record, same in zip(ckpt.tensors(), original.tensors()):
            assert bytes(ckpt.read_bytes(record)[0]) == bytes(original.read_bytes(same)[0])
    assert expected.keys() == torch.load(source, weights_only=True).keys()
    (result,) = verify([path])
    assert result.ok, result.problems
