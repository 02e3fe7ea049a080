"""`ckpttool verify` and `ckpttool scan`: what they find, their exit codes, their output."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from ckpttool.formats.torch_zip.reader import member_span
from tests.support import adversarial
from tests.support.helpers import FIXTURES, fixture_files, fixture_id

RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


# --- verify -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", fixture_files(), ids=fixture_id)
def test_verify_every_fixture_is_clean(path: Path) -> None:
    result = run("verify", path)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{path}: OK (")


def _record_data_offset(path: Path, name_suffix: str) -> int:
    with open(path, "rb") as handle:
        infos = zipfile.ZipFile(handle).infolist()
        info = next(i for i in infos if i.filename.endswith(name_suffix))
        return member_span(handle, info)[0]


def test_verify_counts_one_tensor_in_the_singular(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "one.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    result = run("verify", path)
    assert result.exit_code == 0, result.output
    assert "  checked: structure (safetensors), 1 tensor extent\n" in result.stdout


def test_verify_finds_a_flipped_byte_by_crc(tmp_path: Path) -> None:
    path = tmp_path / "flipped.pth"
    shutil.copy(RESUME, path)
    offset = _record_data_offset(path, "/data/5")
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    assert run("show", path).exit_code == 0  # metadata alone cannot see it
    result = run("verify", path)
    assert result.exit_code == 1
    assert "/data/5: CRC-32 is" in result.stdout
    assert "altered or damaged" in result.stdout


def test_verify_names_the_tensors_of_a_damaged_record(tmp_path: Path) -> None:
    path = tmp_path / "tied.pth"
    shutil.copy(FIXTURES / "ckpttool/pretrain_32_resume.pth", path)
    offset = _record_data_offset(path, "/data/0")  # the tied embedding and lm_head
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run("verify", path)
    assert result.exit_code == 1
    problem = next(line for line in result.stdout.splitlines() if "CRC-32 is" in line)
    assert problem.startswith("  problem: archive/data/0: CRC-32 is ")
    assert problem.endswith(
        "(the bytes were altered or damaged); it stores model.model.embed_tokens.weight, "
        "model.lm_head.weight"
    )


def _flipped_copy(path: Path) -> Path:
    shutil.copy(RESUME, path)
    offset = _record_data_offset(path, "/data/5")
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_verify_gives_every_path_its_own_verdict(tmp_path: Path) -> None:
    model_dir = tmp_path / "hf_model_dir"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{\n "architectures": ["MiniMind"]\n}\n')
    shutil.copy(FIXTURES / "safetensors/model.safetensors", model_dir / "model.safetensors")
    flipped = _flipped_copy(model_dir / "resume.pth")
    missing = model_dir / "missing.pth"
    paths = [model_dir / "config.json", missing, model_dir / "model.safetensors", flipped]
    result = run("verify", *paths)
    assert result.exit_code == 1  # a problem found wins over a path it could not check
    assert f"{model_dir / 'model.safetensors'}: OK (safetensors)" in result.stdout
    assert f"{flipped}: PROBLEMS (torch-zip)" in result.stdout
    # a file that is there but is no checkpoint: a problem found, not a path left unchecked
    assert f"{model_dir / 'config.json'}: PROBLEMS (unreadable)" in result.stdout
    assert result.stdout.endswith("4 paths: 1 OK, 2 with problems, 1 could not be checked\n")
    assert result.stderr.splitlines() == [f"Error: {missing}: no such file"]
    report = json.loads(run("verify", *paths, "--json").stdout)
    assert [(f["ok"], f["format"], f["error"] is not None) for f in report["files"]] == [
        (False, None, False), (False, None, True), (True, "safetensors", False),
        (False, "torch-zip", False),
    ]  # fmt: skip
    assert report["files"][0]["problems"] == [
        "not a checkpoint: unrecognised format (first bytes b'{\\n \"arch'); ckpttool reads "
        "torch.save files (zip or legacy), safetensors, GGUF and pickles"
    ]
    assert report["files"][1]["error"] == "no such file"
    assert not report["ok"]


@pytest.mark.parametrize(
    ("names", "exit_code"),
    [
        (["good"], 0),
        (["good", "missing"], 2),  # could not check one: not a clean result
        (["good", "config.json"], 1),  # there, but no checkpoint: a problem
        (["config.json", "missing"], 1),
        (["missing", "good", "flipped"], 1),  # a problem found wins
    ],
)
def test_verify_exit_code_sums_up_the_paths(
    tmp_path: Path, names: list[str], exit_code: int
) -> None:
    shutil.copy(RESUME, tmp_path / "good")
    (tmp_path / "config.json").write_text("{}\n")
    _flipped_copy(tmp_path / "flipped")
    result = run("verify", *(tmp_path / name for name in names))
    assert result.exit_code == exit_code
    as_json = run("verify", *(tmp_path / name for name in names), "--json")
    assert as_json.exit_code == exit_code
    assert len(json.loads(as_json.stdout)["files"]) == len(names)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "the file is empty (an interrupted save?)"),
        (b"abc", "not a checkpoint: unrecognised format (first bytes b'abc')"),
        (b"PK\x03", "not a checkpoint: unrecognised format"),
    ],
    ids=["empty", "3-bytes", "zip-magic-cut"],
)
def test_verify_a_file_too_short_to_be_a_checkpoint_is_a_problem_found(
    tmp_path: Path, content: bytes, fragment: str
) -> None:
    path = tmp_path / "model.pth"
    path.write_bytes(content)
    result = run("verify", path)
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith(f"{path}: PROBLEMS (unreadable)\n  problem: {fragment}")
    assert result.stderr == ""
    data = json.loads(run("verify", path, "--json").stdout)["files"][0]
    assert data["error"] is None and data["problems"] and data["format"] is None


def test_verify_a_plain_directory_verifies_each_checkpoint_in_it(tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    (folder / "old").mkdir(parents=True)
    shutil.copy(RESUME, folder / "resume.pth")
    _flipped_copy(folder / "old" / "flipped.pth")
    shutil.copytree(FIXTURES / "frameworks/hf_model", folder / "hf")  # one checkpoint, whole
    (folder / "README.md").write_text("notes\n")  # not a checkpoint: passed over, as by scan
    (folder / "torn.pt").write_bytes(b"")  # named like one: an interrupted save
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    verdicts = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert verdicts == [
        f"{folder / 'hf'}: OK (directory)",
        f"{folder / 'old' / 'flipped.pth'}: PROBLEMS (torch-zip)",
        f"{folder / 'resume.pth'}: OK (torch-zip)",
        f"{folder / 'torn.pt'}: PROBLEMS (unreadable)",
        "4 paths: 2 OK, 2 with problems, 0 could not be checked",
    ]
    (folder / "old" / "flipped.pth").unlink()
    (folder / "torn.pt").unlink()
    assert run("verify", folder).exit_code == 0
    empty = tmp_path / "nothing"
    empty.mkdir()
    (empty / "README.md").write_text("notes\n")
    nothing = run("verify", empty)
    assert nothing.exit_code == 2
    assert (
        nothing.stderr == f"Error: {empty}: a directory holding no checkpoint file ckpttool reads\n"
    )


def test_show_of_a_plain_directory_names_the_checkpoint_files_in_it(tmp_path: Path) -> None:
    """A run's checkpoints (names that differ only by a number) are no container of parts
    (tests/test_checkpoint_parts.py): show names them, and trend."""
    shutil.copy(RESUME, tmp_path / "resume-100.pth")
    shutil.copy(RESUME, tmp_path / "resume-200.pth")
    (tmp_path / "README.md").write_text("notes\n")
    result = run("show", tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"Error: {tmp_path}: is a directory, but not a checkpoint layout ckpttool knows (a "
        "Hugging Face model or Trainer checkpoint, a PEFT adapter, an accelerate save_state "
        "folder, a DeepSpeed save or tag directory, a Megatron save, a torchtitan or torchtune "
        "checkpoint, a set of per-rank state dicts, a DCP directory, a folder of differently "
        "named checkpoint files without subfolders); it holds 2 checkpoint files: "
        "resume-100.pth, resume-200.pth (one run's checkpoints: `ckpttool trend` follows them); "
        "name one of them (verify and scan take the whole directory)"
    ]


def test_verify_finds_local_header_disagreeing_with_directory(tmp_path: Path) -> None:
    path = tmp_path / "renamed.pth"
    shutil.copy(RESUME, path)
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/3"))
    start = info.header_offset + 30
    name = data[start : start + len(info.filename)]
    patched = name[:-1] + b"9"  # the local header now names data/9
    path.write_bytes(data[:start] + patched + data[start + len(name) :])
    result = run("verify", path)
    assert result.exit_code == 1
    assert "central directory and local headers disagree" in result.stdout


def _without_utf8_flag(data: bytearray) -> bytearray:
    """Clear flag bit 11 (names are UTF-8) in every local header and directory entry."""
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        infos, directory = archive.infolist(), archive.start_dir
    for info in infos:
        data[info.header_offset + 7] &= ~0x08  # bit 11: bit 3 of the flags' second byte
    for _ in infos:
        data[directory + 9] &= ~0x08
        name_len, extra_len, comment_len = struct.unpack_from("<3H", data, directory + 28)
        directory += 46 + name_len + extra_len + comment_len
    return data


def test_verify_decodes_names_without_the_utf8_flag_as_cp437(tmp_path: Path) -> None:
    """A non-ASCII record name without flag bit 11 (the zip spec's cp437 names) reads as cp437
    in the directory and in every local header, as zipfile reads it: no false disagreement."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(RESUME) as source, zipfile.ZipFile(buffer, "w") as renamed:
        for info in source.infolist():
            name = "modèle/" + info.filename.partition("/")[2]
            renamed.writestr(name, source.read(info))
    path = tmp_path / "modèle.pth"
    path.write_bytes(_without_utf8_flag(bytearray(buffer.getvalue())))
    with zipfile.ZipFile(path) as archive:
        assert "modèle".encode().decode("cp437") + "/data.pkl" in archive.namelist()
    result = run("verify", path)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{path}: OK (torch-zip")


@pytest.mark.parametrize(("build", "fragment"), adversarial.BROKEN_ARCHIVES)
def test_verify_structural_problems(tmp_path: Path, build, fragment: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "broken.pth"
    with (
        pytest.warns(UserWarning)
        if build is adversarial.duplicate_data_pkl
        else contextlib.nullcontext()
    ):
        path.write_bytes(build())
    result = run("verify", path)
    assert result.exit_code == 1
    assert fragment in result.stdout


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("overlap", "overlaps the tensor before it by 4 bytes"),
        ("gap", "4 unused bytes before it (a gap)"),
        ("trailing", "4 trailing bytes after the last tensor"),
        ("size_mismatch", "holds 8 bytes, but float32[3] needs 12"),
        ("header_past_end", "header claims 4,096 bytes"),
        ("header_over_100mb", "the format's limit is 100,000,000"),
    ],
)
def test_verify_safetensors_rules(tmp_path: Path, name: str, fragment: str) -> None:
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(adversarial.SAFETENSORS_BROKEN[name]())
    result = run("verify", path)
    assert result.exit_code == 1
    assert fragment in result.stdout
    show = run("show", path)
    assert show.exit_code == 2 and show.stderr.count("\n") == 1


@pytest.mark.parametrize("cut", [100, 5000, 60_000, 200_000])
def test_verify_truncated_file(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "cut.pth"
    path.write_bytes(RESUME.read_bytes()[:cut])
    result = run("verify", path)
    assert result.exit_code == 1
    assert "problem:" in result.stdout
    assert "Traceback" not in result.output


def test_verify_reports_leftover_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "pretrain_32_resume.pth"
    shutil.copy(RESUME, path)
    (tmp_path / ".pretrain_32_resume.pth.abc123.ckpttool-tmp").write_bytes(b"partial")
    (tmp_path / "pretrain_32_resume.pth.tmp").write_bytes(b"partial")  # MiniMind's temp name
    result = run("verify", path, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)["files"][0]
    assert report["problems"] == []
    assert [Path(p).name for p in report["leftover_temp_files"]] == [
        ".pretrain_32_resume.pth.abc123.ckpttool-tmp",
        "pretrain_32_resume.pth.tmp",
    ]


def test_verify_values_finds_nan(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "nan.pth"
    torch.save({"w": torch.tensor([1.0, float("nan"), float("inf")])}, path)
    assert run("verify", path).exit_code == 0
    result = run("verify", path, "--values")
    assert result.exit_code == 1
    assert "w: 1 NaN and 1 Inf values" in result.stdout


def test_verify_dangerous_pickle_is_a_problem_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pth"
    path.write_bytes(adversarial.torch_zip(adversarial.nested_in_checkpoint_p2(marker)))
    result = run("verify", path)
    assert result.exit_code == 1
    assert "the pickle calls os.system" in result.stdout
    assert not marker.exists()


def test_verify_cannot_check(tmp_path: Path) -> None:
    result = run("verify", tmp_path / "missing.pth")
    assert result.exit_code == 2 and result.stderr.startswith("Error: ")
    (tmp_path / "notes.txt").write_text("hello\n")
    assert run("verify", tmp_path / "notes.txt").exit_code == 1  # there: not a checkpoint


# --- scan -------------------------------------------------------------------------------


def test_scan_clean_file() -> None:
    result = run("scan", RESUME)
    assert result.exit_code == 0
    assert result.stdout.startswith("clean: only safe data constructs referenced")
    assert result.stdout.splitlines()[-1] == "1 file scanned, 0 findings"


def test_scan_summary_counts_in_the_plural_as_needed(tmp_path: Path) -> None:
    target = tmp_path / "models"
    target.mkdir()
    shutil.copy(FIXTURES / "special/namespace_config.pth", target / "run.pth")
    shutil.copy(RESUME, target / "resume.pth")
    (target / "README.md").write_text("not a checkpoint\n")
    result = run("scan", target)
    assert result.stdout.splitlines()[-1] == (
        "2 files scanned, 1 finding, 1 non-checkpoint file skipped"
    )


@pytest.mark.parametrize("container", ["bare", "zip", "legacy"])
@pytest.mark.parametrize("payload", sorted(adversarial.PAYLOADS))
def test_scan_flags_payloads_without_running_them(
    tmp_path: Path, payload: str, container: str
) -> None:
    marker = tmp_path / "ran"
    wrap = {"bare": lambda b: b, "zip": adversarial.torch_zip, "legacy": adversarial.legacy_stream}
    path = tmp_path / f"{payload}.{container}"
    path.write_bytes(wrap[container](adversarial.PAYLOADS[payload](marker)))
    result = run("scan", path, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)["files"][0]
    dangerous = {g["name"] for g in report["globals"] if g["verdict"] == "dangerous"}
    assert dangerous & {
        "os.system", "posix.system", "builtins.eval", "subprocess.Popen", "pydoc.pipepager"
    }  # fmt: skip
    assert not marker.exists()


def test_scan_directory_recursively_with_allow(tmp_path: Path) -> None:
    target = tmp_path / "models"
    (target / "nested").mkdir(parents=True)
    shutil.copy(FIXTURES / "special/namespace_config.pth", target / "nested/run.pth")
    shutil.copy(RESUME, target / "resume.pth")
    (target / "README.md").write_text("not a checkpoint\n")
    result = run("scan", target, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["skipped"] == [str(target / "README.md")]
    verdicts = {g["name"]: g["verdict"] for f in report["files"] for g in f["globals"]}
    unknown = {name for name, verdict in verdicts.items() if verdict == "unknown"}
    assert unknown == {"tests.fixtures.generate.TrainConfig"}
    assert verdicts["argparse.Namespace"] == "safe"  # plain data, read as its attributes
    allowed = run("scan", target, "--allow", "argparse.Namespace",
                  "--allow", "tests.fixtures.generate.TrainConfig")  # fmt: skip
    assert allowed.exit_code == 0, allowed.output


def test_scan_of_nothing_is_not_clean(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("scan", empty)
    assert result.exit_code == 2
    assert "clean" not in result.stdout
    assert result.stdout.splitlines()[2].split() == [
        str(empty), "-", "no", "checkpoint", "found", "no", "file", "in", "it", "is", "a",
        "checkpoint",
    ]  # fmt: skip
    assert json.loads(run("scan", empty, "--json").stdout)["clean"] is False
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "README.md").write_text("not a checkpoint\n")
    report = json.loads(run("scan", docs, "--json").stdout)
    assert report["no_checkpoint_found"] == [str(docs)]
    assert report["skipped"] == [str(docs / "README.md")]
    assert report["clean"] is False
    assert run("scan", docs).exit_code == 2


def test_scan_goes_on_after_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pth"
    result = run("scan", missing, RESUME, "--json")
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert [(f["path"], f["error"]) for f in report["files"]] == [
        (str(missing), "no such file or directory"), (str(RESUME), None)
    ]  # fmt: skip


def test_scan_torchscript_is_flagged() -> None:
    result = run("scan", FIXTURES / "special/torchscript.pt")
    assert result.exit_code == 1
    assert "TorchScript archive" in result.stdout


def test_scan_exit_2_when_it_cannot_scan(tmp_path: Path) -> None:
    assert run("scan", tmp_path / "missing").exit_code == 2
    path = tmp_path / "deep.pth"
    path.write_bytes(adversarial.torch_zip(adversarial.deep_nesting()))
    result = run("scan", path)
    assert result.exit_code == 2
    assert "could not scan" in result.stdout
