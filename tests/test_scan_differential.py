"""``scan`` against what torch.load really runs: every live payload flagged, nothing benign called
dangerous, no command ever running a payload.

The hostile side is :func:`tests.support.adversarial.hostile_pickles` (the code-execution payloads
in every container, frame splits and other parser differentials, pickles under any name and
first opcode, errors after a payload, the gadgets of published scanner bypasses) and the
container level, :data:`tests.support.containers.HOSTILE` (legacy streams in other protocols or
with a payload in another of their five pickles, torch's tar format, zip names differing in
case, two zip end records, a safetensors/pickle polyglot), each file with its own marker. Whether a file is live is not assumed: :mod:`tests.workers.liveness_worker` loads
each one with ``torch.load(weights_only=False)`` in a forked child of one throwaway process and
reports which markers appeared. The benign side is every fixture of the repository,
:func:`tests.support.adversarial.write_benign` (torch.save of state dicts, an optimizer, a module,
dataclass and Namespace configs, NumPy arrays, functools.partial configs; zip and legacy, pickle
protocols 2 to 5) and :data:`tests.support.containers.BENIGN` (legacy files in protocols 1 to 5,
a module and an optimizer saved whole, an archive without CRC-32s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from tests.support import adversarial, containers
from tests.support.helpers import FIXTURES

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
GOOD = FIXTURES / "minimind/pretrain_32_resume.pth"

#: Hostile files torch.load does not run, and why (every other file of the corpus is live).
NOT_LIVE = {
    "build_on_allowed_global.zip.pth": "its BUILD sets an attribute of OrderedDict: no marker",
    # torch.load opens a file that is not a zip with a buffered reader, whose peek makes the C
    # unpickler read linearly: the split frame hides nothing there (ckpttool still refuses it)
    "frame_split_argument.pkl": "read linearly by torch.load (buffered file)",
    "frame_split_argument.legacy.pth": "read linearly by torch.load (buffered file)",
    "frame_nested.legacy.pth": "read linearly by torch.load (buffered file)",
}

#: Files whose pickle has a FRAME that torch.load and a linear reader read differently.
AMBIGUOUS = [
    "frame_split_argument.zip.pth",
    "frame_split_argument.legacy.pth",
    "frame_split_argument.pkl",
    "frame_split_line.zip.pth",
    "frame_nested.zip.pth",
    "frame_nested.legacy.pth",
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """(folder of hostile files, folder of their markers, {name: {"live", "loaded"}})."""
    root = tmp_path_factory.mktemp("differential")
    files, markers = root / "files", root / "markers"
    files.mkdir()
    markers.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        built = adversarial.hostile_pickles(lambda name: markers / name)
    assert not built.keys() & containers.HOSTILE.keys()
    built |= {name: make(markers / name) for name, make in containers.HOSTILE.items()}
    for name, data in built.items():
        (files / name).write_bytes(data)
    worker = [sys.executable, "-m", "tests.workers.liveness_worker", str(files), str(markers)]
    run = subprocess.run(worker, cwd=REPO, capture_output=True, check=True, timeout=900)
    liveness = json.loads(run.stdout)
    for marker in markers.iterdir():  # from here on, any marker is ckpttool's doing
        marker.unlink()
    return files, markers, liveness


def _live(liveness: dict[str, Any]) -> list[str]:
    return sorted(name for name, seen in liveness.items() if seen["live"])


def _scan(*paths: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["scan", "--json", *map(str, paths)])
    return result.exit_code, json.loads(result.output)


def _flagged(entry: dict[str, Any]) -> bool:
    """The file's scan names something unsafe: a dangerous or unknown global, or a note."""
    return bool(entry["notes"]) or any(g["verdict"] != "safe" for g in entry["globals"])


@pytest.mark.slow
def test_the_corpus_is_live(hostile: tuple[Path, Path, dict[str, Any]]) -> None:
    """Positive control: torch.load runs every payload but the few listed, frame splits
    included (the C unpickler honours frame boundaries on a zip's data.pkl)."""
    _, _, liveness = hostile
    assert {name for name, seen in liveness.items() if not seen["live"]} == set(NOT_LIVE)
    assert len(liveness) == len(_live(liveness)) + len(NOT_LIVE) > 70


@pytest.mark.slow
def test_scan_flags_every_live_file(hostile: tuple[Path, Path, dict[str, Any]]) -> None:
    files, _, liveness = hostile
    missed = []
    for name in _live(liveness):
        code, report = _scan(files / name)
        if code != 1 or not _flagged(report["files"][0]):
            missed.append(f"{name}: exit {code}, {report['files']}")
    assert not missed, "\n".join(missed)


@pytest.mark.slow
def test_scan_flags_every_live_file_beside_a_benign_checkpoint(
    hostile: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Directory mode: nothing is skipped for its name or its first bytes."""
    files, _, liveness = hostile
    missed = []
    for name in _live(liveness):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.pth").write_bytes(GOOD.read_bytes())
        (folder / name).write_bytes((files / name).read_bytes())
        code, report = _scan(folder)
        entries = {Path(f["path"]).name: f for f in report["files"]}
        if code != 1 or name not in entries or not _flagged(entries[name]):
            missed.append(f"{name}: exit {code}, skipped {report['skipped']}")
        elif _flagged(entries["model.pth"]):
            missed.append(f"{name}: the benign checkpoint beside it was flagged")
    assert not missed, "\n".join(missed)


@pytest.mark.slow
@pytest.mark.parametrize("name", AMBIGUOUS)
def test_irregular_frames_are_ambiguous(
    hostile: tuple[Path, Path, dict[str, Any]], name: str
) -> None:
    """A frame two readers read differently: a scan finding that says so, a refusal elsewhere."""
    files, _, _ = hostile
    code, report = _scan(files / name)
    assert code == 1
    assert any(
        "FRAME at byte" in note and "irregular" in note for note in report["files"][0]["notes"]
    )
    shown = CliRunner().invoke(cli, ["show", str(files / name)])
    assert shown.exit_code == 2 and "FRAME at byte" in shown.stderr


@pytest.mark.slow
def test_no_command_runs_a_payload(
    hostile: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    files, markers, _ = hostile
    runner = CliRunner()
    for path in sorted(files.iterdir()):
        for args in (
            ["show", str(path)],
            ["verify", str(path)],
            ["diff", str(path), str(GOOD)],
            ["convert", str(path), str(tmp_path / f"{path.name}.safetensors")],
            ["scan", str(path)],
        ):
            result = runner.invoke(cli, args)
            assert result.exit_code in (0, 1, 2), (args, result.output, result.exception)
            assert "Traceback" not in result.output + result.stderr
    assert sorted(p.name for p in markers.iterdir()) == []


@pytest.fixture(scope="module")
def benign(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("benign")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths = adversarial.write_benign(folder)
        for name, make in containers.BENIGN.items():
            (folder / name).write_bytes(make())
            paths.append(folder / name)
    return paths


def test_benign_files_are_never_dangerous(benign: list[Path]) -> None:
    """Nothing torch.save writes for common objects is called dangerous (config and module
    classes are "unknown" or, torch's own, "safe"), in any format or protocol; and every
    such file is scanned to its end (never "could not scan": a legacy ``torch.save(model)``
    included, its classes reported as globals)."""
    _, report = _scan(*benign)
    dangerous = [
        (f["path"], f["notes"], [g["name"] for g in f["globals"] if g["verdict"] == "dangerous"])
        for f in report["files"]
        if f["notes"] or any(g["verdict"] == "dangerous" for g in f["globals"])
    ]
    assert not dangerous
    assert not [(f["path"], f["error"]) for f in report["files"] if f["error"]]
    assert len(report["files"]) == len(benign) == 74
    modules = [f for f in report["files"] if Path(f["path"]).name.startswith("module.legacy")]
    for entry in modules:  # the ('module', class, ...) persistent ids give back the classes
        # (torch's own layers, saved whole, are known inert: pickle.inert)
        assert {g["name"]: g["verdict"] for g in entry["globals"]}[
            "torch.nn.modules.container.Sequential"
        ] == "safe", entry
    assert len(modules) == 4


def test_fixtures_are_never_dangerous() -> None:
    """Every fixture of the repository, one directory scan: dangerous only where it is
    (the TorchScript archive, which carries code)."""
    _, report = _scan(FIXTURES)
    dangerous = {
        Path(f["path"]).relative_to(FIXTURES).as_posix()
        for f in report["files"]
        if f["notes"] or any(g["verdict"] == "dangerous" for g in f["globals"])
    }
    assert dangerous == {"special/torchscript.pt"}
    assert len(report["files"]) > 200


def _torch_tensors(obj: Any) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of the tensor at every path of what torch.load returned (a DTensor: its
    global shape); a torchao wrapper subclass, which torch.load(weights_only=True) returns once
    torchao was imported in this process (it allow-lists its classes), as its inner tensors,
    as ckpttool lists them."""
    if isinstance(obj, torch.Tensor) and type(obj).__module__.startswith("torchao."):
        names, _ = obj.__tensor_flatten__()
        return [t for name in names for t in _torch_tensors(getattr(obj, name))]
    if isinstance(obj, torch.Tensor):
        return [(tuple(obj.shape), str(obj.dtype).removeprefix("torch."))]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _torch_tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _torch_tensors(value)]
    return []


def _listed(path: Path) -> list[tuple[tuple[int, ...], str]]:
    with open_checkpoint(path) as ckpt:
        return sorted((tuple(r.shape), r.dtype) for r in ckpt.tensors() if r.kind != "ndarray")


def _weights_only(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception:  # torch's safe loader refuses it: nothing to compare with
            return None


@pytest.mark.slow
def test_show_lists_what_torch_loads(benign: list[Path]) -> None:
    """Where torch.load(weights_only=True) loads a benign file, ckpttool lists the same tensors
    (shape and dtype at each path)."""
    compared = 0
    for path in benign + sorted(FIXTURES.rglob("*.pt*")):
        loaded = _weights_only(path)
        if loaded is None or not isinstance(loaded, (dict, list, tuple)):
            continue
        assert _listed(path) == sorted(_torch_tensors(loaded)), path
        compared += 1
    assert compared > 60
