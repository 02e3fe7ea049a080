"""`ckpttool verify` and `ckpttool scan`: what they find, their exit codes, their output."""

from __future__ import annotations

import contextlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from ckpttool.formats.torch_zip import member_span
from tests import adversarial
from tests.helpers import FIXTURES, fixture_files, fixture_id

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
    assert run("verify", tmp_path / "notes.txt").exit_code == 2


# --- scan -------------------------------------------------------------------------------


def test_scan_clean_file() -> None:
    result = run("scan", RESUME)
    assert result.exit_code == 0
    assert result.stdout.startswith("clean: only safe data constructs referenced")


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
    unknown = {
        g["name"] for f in report["files"] for g in f["globals"] if g["verdict"] == "unknown"
    }
    assert unknown == {"argparse.Namespace", "tests.fixtures.generate.TrainConfig"}
    allowed = run("scan", target, "--allow", "argparse.Namespace",
                  "--allow", "tests.fixtures.generate.TrainConfig")  # fmt: skip
    assert allowed.exit_code == 0, allowed.output


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
