"""``scan`` against torch's other loaders (torch.export, torch.package, TorchScript): every payload
their loader really runs flagged, in file and directory mode, the benign archive of each kind
reporting nothing dangerous beyond what its kind implies, no command ever running a payload, and
every command naming the kind.

The archives are torch-written with one member replaced or added
(:mod:`tests.support.loader_archives`); which ones are live is not assumed:
:mod:`tests.workers.loader_worker` opens each with its real loader in a throwaway process. The
differential test of issue 25 (:mod:`tests.test_scan_differential`), extended to these loaders.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.formats.torch_zip import kinds
from ckpttool.formats.torch_zip.scan import MAX_DEPTH
from tests.support import adversarial
from tests.support.helpers import FIXTURES
from tests.test_json_schemas import assert_valid

torch = pytest.importorskip("torch")
from tests.support import loader_archives  # noqa: E402 - needs torch

REPO = Path(__file__).resolve().parents[1]
GOOD = FIXTURES / "minimind/pretrain_32_resume.pth"

#: Where each hostile archive's finding is, below the archive's root folder.
PLACES = {
    "pt2_sample_inputs.pt2": "data/sample_inputs/model.pt › model/data.pkl",
    "pt2_sample_inputs_legacy.pt2": "data/sample_inputs/model.pt",
    "pt2_pickled_weight.pt2": "data/weights/weight_0 › archive/data.pkl",
    "pt2_pickled_constant.pt2": "data/constants/tensor_0 › archive/data.pkl",
    "pt2_opaque_object.pt2": "data/constants/opaque_obj_0",
    "package_pickle.pt": "weights/state.pkl",
    "package_text_resource.pt": "weights/notes.txt",
}
KIND = {".pt2": "torch-export", "package": "torch-package", "torchscript": "torchscript"}


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """(folder of archives, folder of markers, {name: {"live", "loaded"}})."""
    root = tmp_path_factory.mktemp("loaders")
    files, markers = root / "files", root / "markers"
    files.mkdir()
    markers.mkdir()
    loaders = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (build, loader) in loader_archives.HOSTILE.items():
            build(files / name, markers / name)
            loaders[name] = loader
        for name, (benign, loader) in loader_archives.BENIGN.items():
            benign(files / name)
            loaders[name] = loader
    (root / "loaders.json").write_text(json.dumps(loaders))
    worker = [sys.executable, "-m", "tests.workers.loader_worker", str(files), str(markers),
              str(root / "loaders.json")]  # fmt: skip
    run = subprocess.run(worker, cwd=REPO, capture_output=True, check=True, timeout=600)
    liveness = json.loads(run.stdout)
    for marker in markers.iterdir():  # from here on, any marker is ckpttool's doing
        marker.unlink()
    return files, markers, liveness


def _scan(*paths: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["scan", "--json", *map(str, paths)])
    return result.exit_code, json.loads(result.output)


def _dangerous(entry: dict[str, Any]) -> bool:
    return bool(entry["notes"]) or any(g["verdict"] == "dangerous" for g in entry["globals"])


def test_every_hostile_archive_is_live_and_no_benign_one(
    archives: tuple[Path, Path, dict[str, Any]],
) -> None:
    """Positive control: the real loader runs each payload, and loads each benign archive
    without a marker."""
    _, _, liveness = archives
    assert {name for name, seen in liveness.items() if seen["live"]} == set(loader_archives.HOSTILE)
    assert all(liveness[name]["loaded"] for name in loader_archives.BENIGN)


@pytest.mark.parametrize("name", sorted(loader_archives.HOSTILE))
def test_scan_flags_each_payload_and_names_its_place(
    archives: tuple[Path, Path, dict[str, Any]], name: str
) -> None:
    files, _, _ = archives
    code, report = _scan(files / name)
    entry = report["files"][0]
    assert code == 1 and _dangerous(entry), entry
    assert entry["format"] == next(kind for key, kind in KIND.items() if key in name)
    if name in PLACES:
        dangerous = [g["name"] for g in entry["globals"] if g["verdict"] == "dangerous"]
        root = Path(name).stem
        assert [entry["places"][qualname] for qualname in dangerous] == [[f"{root}/{PLACES[name]}"]]
        shown = CliRunner().invoke(cli, ["scan", str(files / name)])
        assert f"in {root}/{PLACES[name]}" in shown.output
    if name == "package_source.pt":  # the shipped module, named, however harmless its pickle
        assert entry["notes"] == [
            "a torch.package archive that ships Python source PackageImporter imports (runs) "
            "when a pickle or the user names it: configs"
        ]


def test_scan_flags_every_payload_in_a_directory(
    archives: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Directory mode, each archive beside a benign checkpoint and under a neutral name."""
    files, _, _ = archives
    for name in loader_archives.HOSTILE:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(GOOD, folder / "model.pth")
        shutil.copy(files / name, folder / "download.bin")
        code, report = _scan(folder)
        entries = {Path(f["path"]).name: f for f in report["files"]}
        assert code == 1 and _dangerous(entries["download.bin"]), (name, report)
        assert not _dangerous(entries["model.pth"])


def test_benign_archives_report_only_what_their_kind_implies(
    archives: tuple[Path, Path, dict[str, Any]],
) -> None:
    """An exported model with sample inputs and a package of tensors are clean; a scripted
    module is dangerous only by its note (it carries code), its classes unknown."""
    files, _, _ = archives
    for name in ("exported.pt2", "tensors_package.pt"):
        code, report = _scan(files / name)
        entry = report["files"][0]
        assert (code, entry["notes"], entry["error"]) == (0, [], None), entry
        assert entry["globals"] and all(g["verdict"] == "safe" for g in entry["globals"])
    code, report = _scan(files / "scripted.pt")
    entry = report["files"][0]
    assert code == 1 and entry["format"] == "torchscript"
    assert entry["notes"] == [
        "a TorchScript archive: it carries code that torch.jit.load would run"
    ]
    assert not [g for g in entry["globals"] if g["verdict"] == "dangerous"]
    exported = _scan(files / "exported.pt2")[1]["files"][0]
    assert exported["format"] == "torch-export"
    root = "exported/data/sample_inputs/model.pt › archive/data.pkl"  # as torch.save writes it
    assert exported["places"]["torch._utils._rebuild_tensor_v2"] == [root]


COMMANDS = ("show", "verify", "diff", "convert", "edit", "repair", "scan")


def _command(command: str, path: Path, out: Path) -> list[str]:
    return {
        "show": ["show", str(path)],
        "verify": ["verify", str(path)],
        "diff": ["diff", str(path), str(GOOD)],
        "convert": ["convert", str(path), str(out / f"{path.name}.safetensors")],
        "edit": ["edit", str(path), "--drop", "x", "-o", str(out / f"{path.name}.edited")],
        "repair": ["repair", str(path)],
        "scan": ["scan", str(path)],
    }[command]


def test_no_command_runs_a_payload_and_each_names_the_kind(
    archives: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """No command runs a payload. A .pt2's weights are read by show, verify, diff and convert
    (or, where one is a pickle, refused by that name); edit and repair refuse a .pt2 by name,
    never as damaged; every command refuses a package or a TorchScript archive by name."""
    files, markers, _ = archives
    runner = CliRunner()
    for path in sorted(files.iterdir()):
        kind = kinds.archive_kind(zipfile.ZipFile(path).namelist())
        named = kinds.KIND_NAMES[kind].split(" (")[0].removeprefix("a ")
        for command in COMMANDS:
            result = runner.invoke(cli, _command(command, path, tmp_path))
            text = result.output + result.stderr
            assert "Traceback" not in text and loader_archives.MARKER_TEXT not in text
            if command == "scan":  # a finding's place may be a nested archive's data.pkl
                assert result.exit_code in (0, 1), text
                continue
            assert "damaged" not in text and "data.pkl" not in text, (command, path.name, text)
            if kind == kinds.TORCH_EXPORT and command in ("show", "verify", "diff", "convert"):
                assert result.exit_code in (0, 1, 2), (command, path.name, text)
                assert result.exit_code != 2 or named in text, (command, path.name, text)
            else:
                assert result.exit_code in (1, 2), (command, path.name, text)
                assert named in text, (command, path.name, text)
    assert sorted(p.name for p in markers.iterdir()) == []


def test_a_pt2_reads_as_torch_export_load_gives_it(
    archives: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A .pt2's weights and tensor constants, by FQN, byte-equal to what torch.export.load
    gives (the archive is benign: loaded here); show names the kind, convert writes them all."""
    from ckpttool import load_state_dict

    files, _, _ = archives
    path = files / "exported.pt2"
    program = torch.export.load(path)
    expected = {**program.state_dict, **program.constants}
    read = load_state_dict(path)
    assert list(read) == list(expected) == ["linear.weight", "linear.bias", "offset", "scale"]
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert read[name].contiguous().view(torch.uint8).tolist() == (
            tensor.detach().contiguous().view(torch.uint8).tolist()
        ), name
    shown = CliRunner().invoke(cli, ["show", str(path)])
    assert shown.exit_code == 0 and "torch-export" in shown.output
    assert "export:     3 weights, 1 tensor constants (model: model)" in shown.output
    assert "pickles:    data/sample_inputs/model.pt: not read" in shown.output
    as_json = json.loads(CliRunner().invoke(cli, ["show", "--json", str(path)]).output)
    assert as_json["format"] == "torch-export"
    assert_valid("show", as_json)
    for archive in sorted(files.iterdir()):  # scan --json of every archive, per its schema
        assert_valid("scan", _scan(archive)[1])
    verified = CliRunner().invoke(cli, ["verify", str(path)])
    assert verified.exit_code == 0 and "storage records no tensor uses" not in verified.output
    out = tmp_path / "weights.safetensors"
    assert CliRunner().invoke(cli, ["convert", str(path), str(out)]).exit_code == 0
    from safetensors.torch import load_file

    converted = load_file(out)
    assert all(torch.equal(converted[name], tensor.detach()) for name, tensor in expected.items())


def test_a_torn_pt2_weight_is_found_by_verify(
    archives: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    files, _, _ = archives
    data = bytearray((files / "exported.pt2").read_bytes())
    with zipfile.ZipFile(files / "exported.pt2") as archive:
        info = archive.getinfo("exported/data/weights/weight_0")
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_length + extra_length  # past the local header
    data[at] ^= 0xFF
    torn = tmp_path / "torn.pt2"
    torn.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["verify", str(torn)])
    assert result.exit_code == 1 and "weight_0" in result.output, result.output


def test_a_pt2_cut_short_is_still_named_by_repair(
    archives: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    files, _, _ = archives
    data = (files / "exported.pt2").read_bytes()
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(data[:600])
    result = CliRunner().invoke(cli, ["repair", str(cut)])
    assert result.exit_code == 2 and "a torch.export archive (.pt2" in result.stderr


def test_nesting_is_bounded(tmp_path: Path) -> None:
    """A torch.save zip inside a .pt2's sample inputs, nested past MAX_DEPTH: could not scan,
    and a payload at the deepest level scanned is still found."""
    marker = tmp_path / "marker"
    payload = adversarial.torch_zip(adversarial.global_reduce_p2(marker))

    def pt2(inner: bytes) -> bytes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = loader_archives.exported(tmp_path / "wrap.pt2")
        loader_archives._rewrite(
            path, lambda name, data: inner if name.startswith("data/sample_inputs/") else data, {}
        )
        return path.read_bytes()

    shallow = tmp_path / "shallow.pt2"
    shallow.write_bytes(pt2(payload))
    assert _scan(shallow)[0] == 1
    deep = payload
    for _ in range(MAX_DEPTH):  # a .pt2 whose sample inputs are a .pt2...: at the bound
        deep = pt2(deep)
    path = tmp_path / "deep.pt2"
    path.write_bytes(deep)
    assert _scan(path)[0] == 1
    path.write_bytes(pt2(deep))  # one past it
    code, report = _scan(path)
    assert code == 2 and "nested over" in report["files"][0]["error"]
    assert not marker.exists()


def test_an_unreadable_payload_config_walks_every_payload(tmp_path: Path) -> None:
    """A weights config torch.export.load could not parse either: every weight is walked, the
    raw ones reported as not readable as pickles (could not scan), a pickled one flagged."""
    marker = tmp_path / "marker"
    path = tmp_path / "broken.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader_archives.exported(path)
    nested = adversarial.torch_zip(adversarial.global_reduce_p2(marker))

    def change(inner: str, data: bytes) -> bytes:
        if inner == "data/weights/model_weights_config.json":
            return b"{not json"
        return nested if inner == "data/weights/weight_0" else data

    loader_archives._rewrite(path, change, {})
    code, report = _scan(path)
    entry = report["files"][0]
    assert code == 1 and "unreadable payload config" in entry["error"]
    assert {g["name"] for g in entry["globals"] if g["verdict"] == "dangerous"} == {"posix.system"}
