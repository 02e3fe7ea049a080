"""Containers of checkpoint files no plug-in names (issue 51, item 6; docs/formats.md,
"Containers of checkpoint files"): a zip of ``.pth`` members (stable-baselines3's ``model.zip``,
written here by stable-baselines3 itself) and a folder of differently named checkpoint files are
one checkpoint of named parts; a folder of one series of checkpoint files stays a run.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

import ckpttool
from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.errors import InputError, NotACheckpointError
from ckpttool.frameworks.container import files as container_files
from tests.support.helpers import FIXTURES


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def sb3_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model.save()`` of a PPO on CartPole after one short rollout and update (so that the
    optimizer has state), written by stable-baselines3 itself."""
    from stable_baselines3 import PPO

    folder = tmp_path_factory.mktemp("sb3_zip")
    torch.manual_seed(0)
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1, seed=0,
                policy_kwargs={"net_arch": [8]}, device="cpu")  # fmt: skip
    model.learn(16)
    model.save(str(folder / "model.zip"))
    return folder / "model.zip"


def _policy_state(path: Path) -> dict[str, torch.Tensor]:
    from stable_baselines3 import PPO

    return PPO.load(str(path), device="cpu").policy.state_dict()


def test_sb3_zip_stores_its_members_uncompressed(sb3_zip: Path) -> None:
    """The premise of reading members in place: stable-baselines3 writes them ZIP_STORED."""
    with zipfile.ZipFile(sb3_zip) as archive:
        kinds = {info.filename: info.compress_type for info in archive.infolist()}
    assert {"data", "policy.pth", "policy.optimizer.pth", "pytorch_variables.pth"} <= set(kinds)
    assert set(kinds.values()) == {zipfile.ZIP_STORED}


def test_show_lists_every_member_of_an_sb3_zip_as_a_part(sb3_zip: Path) -> None:
    result = run("show", sb3_zip)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    parts = {line.split()[0]: line.split()[1:] for line in lines if line.startswith("  ")}
    assert parts["policy"][:2] == ["policy.pth", "torch-zip"]
    assert parts["policy.optimizer"][:2] == ["policy.optimizer.pth", "torch-zip"]
    assert parts["pytorch_variables"][:2] == ["pytorch_variables.pth", "torch-zip"]
    assert parts["data"][:4] == ["data", "not", "a", "checkpoint"]
    policy = _policy_state(sb3_zip)
    assert f"{len(policy)} tensors (key prefix 'policy.')" in " ".join(parts["policy"])
    listed = json.loads(run("show", "--json", sb3_zip).stdout)
    assert "policy.action_net.weight" in {t["key"] for t in listed["tensors"]}


def test_convert_component_of_an_sb3_zip_is_what_sb3_loads(sb3_zip: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy.safetensors"
    result = run("convert", sb3_zip, out, "--component", "policy")
    assert result.exit_code == 0, result.output
    written = load_file(out)
    expected = _policy_state(sb3_zip)
    assert written.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(written[key], value), key


def test_load_state_dict_component_of_an_sb3_zip(sb3_zip: Path) -> None:
    loaded = ckpttool.load_state_dict(sb3_zip, component="policy")
    expected = _policy_state(sb3_zip)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], value) for key, value in expected.items())
    with pytest.raises(InputError, match=r"component 'data' .* has no weights"):
        ckpttool.load_state_dict(sb3_zip, component="data")


def test_verify_checks_each_member_and_finds_a_damaged_one(sb3_zip: Path, tmp_path: Path) -> None:
    clean = run("verify", sb3_zip)
    assert clean.exit_code == 0, clean.output
    assert "3 checkpoint members verified one by one" in clean.stdout
    damaged = tmp_path / "model.zip"
    data = bytearray(sb3_zip.read_bytes())
    with zipfile.ZipFile(sb3_zip) as archive, sb3_zip.open("rb") as handle:
        info = archive.getinfo("policy.pth")
        offset = container_files._locate(handle, info, len(data)).offset
    with zipfile.ZipFile(sb3_zip) as outer, outer.open("policy.pth") as member:
        inner = zipfile.ZipFile(member)
        record = next(i for i in inner.infolist() if "/data/" in i.filename and i.file_size >= 8)
        inner_header = record.header_offset
    # a byte of the record's data: past its local header (30 bytes + name + extra)
    local = data[offset + inner_header : offset + inner_header + 30]
    start = offset + inner_header + 30 + local[26] + (local[27] << 8) + local[28] + (local[29] << 8)
    data[start + 1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    result = run("verify", damaged)
    assert result.exit_code == 1, result.output
    assert "policy.pth: CRC-32 mismatch" in result.stdout
    assert f"policy.pth: {record.filename}: CRC-32 is" in result.stdout  # the member's own check


def test_a_compressed_member_is_inflated_when_small_and_refused_when_large(
    sb3_zip: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deflated = tmp_path / "model.zip"
    with zipfile.ZipFile(sb3_zip) as source, zipfile.ZipFile(deflated, "w") as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info), compress_type=zipfile.ZIP_DEFLATED)
    loaded = ckpttool.load_state_dict(deflated, component="policy")
    expected = _policy_state(sb3_zip)
    assert all(torch.equal(loaded[key], value) for key, value in expected.items())
    monkeypatch.setattr(container_files, "MAX_INFLATED", 100)
    result = run("show", deflated)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {deflated}: member ")
    assert "is compressed" in result.stderr and "unzip the archive" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_zip_without_checkpoint_members_keeps_its_refusal(tmp_path: Path) -> None:
    path = tmp_path / "notes.zip"
    with zipfile.ZipFile(path, "w") as out:
        out.writestr("readme.txt", "hello")
    with pytest.raises(NotACheckpointError, match=r"a zip archive with no data\.pkl"):
        open_checkpoint(path)


# --- folders --------------------------------------------------------------------------------


@pytest.fixture
def parts_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "parts"
    folder.mkdir()
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2)}, folder / "encoder.pt")
    torch.save({"w": torch.ones(3, 2)}, folder / "decoder.pt")
    (folder / "config.json").write_text('{"hidden": 3}')
    return folder


def test_a_folder_of_differently_named_checkpoint_files_is_one_of_parts(
    parts_folder: Path, tmp_path: Path
) -> None:
    shown = run("show", parts_folder)
    assert shown.exit_code == 0, shown.output
    rows = [line.split() for line in shown.stdout.splitlines() if line.startswith("  ")]
    named = {row[0]: row for row in rows}
    assert named["encoder"][1:3] == ["encoder.pt", "torch-zip"]
    assert named["decoder"][1:3] == ["decoder.pt", "torch-zip"]
    assert named["config.json"][1:5] == ["config.json", "not", "a", "checkpoint"]  # listed
    out = tmp_path / "encoder.safetensors"
    converted = run("convert", parts_folder, out, "--component", "encoder")
    assert converted.exit_code == 0, converted.output
    expected = torch.load(parts_folder / "encoder.pt")
    written = load_file(out)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    # verify walks a folder of parts file by file (each part is a checkpoint file of its own)
    verified = run("verify", parts_folder)
    assert verified.exit_code == 0, verified.output
    assert f"{parts_folder / 'encoder.pt'}: OK (torch-zip)" in verified.stdout
    assert f"{parts_folder / 'decoder.pt'}: OK (torch-zip)" in verified.stdout
    assert "member files verified one by one" not in verified.stdout
    (parts_folder / "decoder.pt").write_bytes(b"")  # a torn part: its own verdict names it
    torn = run("verify", parts_folder)
    assert torn.exit_code == 1, torn.output
    assert f"{parts_folder / 'encoder.pt'}: OK (torch-zip)" in torn.stdout
    assert f"{parts_folder / 'decoder.pt'}: PROBLEMS" in torn.stdout


def test_a_folder_of_one_series_stays_a_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step in (100, 200):
        torch.save({"w": torch.full((4,), float(step))}, run_dir / f"ckpt-{step}.pt")
    shown = run("show", run_dir)
    assert shown.exit_code == 2
    assert (
        "2 checkpoint files: ckpt-100.pt, ckpt-200.pt (one run's checkpoints: `ckpttool "
        "trend` follows them); name one of them" in shown.stderr
    )
    converted = run("convert", run_dir, tmp_path / "out.safetensors")
    assert converted.exit_code == 2 and "name one of them" in converted.stderr
    trended = run("trend", "--json", run_dir)
    assert trended.exit_code == 0, trended.output
    assert len(json.loads(trended.stdout)["checkpoints"]) == 2


def test_scan_walks_each_checkpoint_member_of_a_zip(sb3_zip: Path, tmp_path: Path) -> None:
    """The members a zip of checkpoint files holds are torch.load-ed by whoever reads it: scan
    walks each, naming where a global is (before, a zip without data.pkl scanned clean)."""
    listed = json.loads(run("scan", "--json", sb3_zip).stdout)["files"][0]
    assert "policy.pth › archive/data.pkl" in listed["places"]["torch._utils._rebuild_tensor_v2"]
    inner = tmp_path / "inner.pth"
    with zipfile.ZipFile(inner, "w") as out:  # a torch.save zip whose pickle calls os.system
        out.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00idq\x01\x85R.")
        out.writestr("archive/version", b"3\n")
    hostile = tmp_path / "model.zip"
    with zipfile.ZipFile(sb3_zip) as source, zipfile.ZipFile(hostile, "w") as out:
        for info in source.infolist():
            data = inner.read_bytes() if info.filename == "policy.pth" else source.read(info)
            out.writestr(info.filename, data)
    result = run("scan", hostile)
    assert result.exit_code == 1, result.output
    assert "os.system in policy.pth › archive/data.pkl" in result.stdout
    shown = run("show", hostile)
    assert shown.exit_code == 2 and "the pickle calls os.system" in shown.stderr


@pytest.mark.parametrize("command", [["edit", "--for-inference", "-o"], ["repair", "-o"]])
def test_edit_and_repair_refuse_a_zip_of_checkpoint_files_as_such(
    sb3_zip: Path, tmp_path: Path, command: list[str]
) -> None:
    """They rewrite one checkpoint file: a zip of them is refused for what it is (before: "data.pkl
    is lost", as if a torch.save file were damaged), and nothing is written."""
    out = tmp_path / "out.zip"
    result = run(command[0], sb3_zip, *command[1:], out)
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"Error: {sb3_zip}: a zip of checkpoint files, not one torch.save file: this command "
        "rewrites one checkpoint file (unzip it and name one; convert --component NAME takes a "
        "part)\n"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("fixture", "title"),
    [
        ("frameworks/trainer_1proc/output/checkpoint-8", "Hugging Face Trainer checkpoint"),
        ("frameworks/accelerate_1proc/state", "accelerate save_state folder"),
    ],
)
def test_a_framework_folder_missing_its_weights_stays_the_framework_s(
    fixture: str, title: str, tmp_path: Path
) -> None:
    """The container is asked last and never claims a framework's folder, whole or missing a
    file: repair of a Trainer checkpoint or accelerate folder whose weights file is gone reports
    the damage and exits 1 (before: the container's run of files, "INTACT", exit 0); verify too."""
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fixture, src)
    (src / "model.safetensors").unlink()
    repaired = run("repair", src, "--dry-run")
    assert repaired.exit_code == 1, repaired.output
    assert f"DAMAGED ({title})" in repaired.stdout
    assert (
        "the model weights (model.safetensors or pytorch_model.bin) is missing" in repaired.stdout
    )
    verified = run("verify", src)
    assert verified.exit_code == 1, verified.output
    assert "model.safetensors" in verified.stdout


def test_a_folder_of_parts_is_repaired_as_its_files(parts_folder: Path) -> None:
    """repair of a folder of parts judges each file as one of a run's (not the folder as one
    checkpoint, which verify walks file by file)."""
    intact = run("repair", parts_folder, "--dry-run")
    assert intact.exit_code == 0, intact.output
    assert "INTACT (directory of checkpoint files)" in intact.stdout


def test_verify_walks_a_folder_of_parts_inside_a_tree_file_by_file(tmp_path: Path) -> None:
    """A folder of parts under a directory verify walks is walked too, a verdict per file (not
    one input that verify then could not check)."""
    parts = tmp_path / "runs" / "parts"
    parts.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, parts / "encoder.pt")
    torch.save({"w": torch.ones(2)}, parts / "decoder.pt")
    torch.save({"w": torch.ones(3)}, tmp_path / "runs" / "best.pt")
    verified = run("verify", tmp_path / "runs")
    assert verified.exit_code == 0, verified.output
    for path in (parts / "encoder.pt", parts / "decoder.pt", tmp_path / "runs" / "best.pt"):
        assert f"{path}: OK (torch-zip)" in verified.stdout
