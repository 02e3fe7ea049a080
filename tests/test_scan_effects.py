"""Issue 50: ``scan`` judges what a pickle does. Every live payload of the second corpus
(callables on no block-list that run code or touch files, ``EXT`` codes after
``copyreg.add_extension``, ``STACK_GLOBAL`` names computed at load time, a cloudpickled
function: :mod:`tests.support.effect_cases`) is dangerous, alone and in a directory; the
benign files of popular libraries (a transformers Trainer output folder, Lightning, OmegaConf,
``datetime``, ``partial(torch.optim.Adam)``, a whole ``nn.Module``, ``print`` kept as a logger)
exit 0, and ``scan X && verify X`` reaches ``verify`` on a Trainer checkpoint.

Which payloads are live is not assumed: :mod:`tests.workers.liveness_worker` loads each with
``torch.load(weights_only=False)`` in a throwaway process (one process for all of them).
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

from ckpttool.cli import cli
from ckpttool.pickle.interpreter import load_pickle
from ckpttool.pickle.policy import UNRESOLVED, Verdict

torch = pytest.importorskip("torch")
from tests.support import effect_cases  # noqa: E402 - needs torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """(folder of hostile files, folder of markers, liveness by file name)."""
    root = tmp_path_factory.mktemp("effects")
    files, markers = root / "files", root / "markers"
    files.mkdir()
    markers.mkdir()
    effect_cases.write_hostile(files, markers)
    worker = [sys.executable, "-m", "tests.workers.liveness_worker", str(files), str(markers)]
    run = subprocess.run(worker, cwd=REPO, capture_output=True, check=True, timeout=600)
    liveness = json.loads(run.stdout)
    for marker in markers.iterdir():  # from here on, any marker is ckpttool's doing
        marker.unlink()
    return files, markers, liveness


def _scan(*paths: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["scan", "--json", *map(str, paths)])
    return result.exit_code, json.loads(result.output)


def _dangerous(entry: dict[str, Any]) -> list[str]:
    return [g["name"] for g in entry["globals"] if g["verdict"] == "dangerous"] + entry["notes"]


def test_every_case_is_live(hostile: tuple[Path, Path, dict[str, Any]]) -> None:
    """Positive control: torch.load runs every payload."""
    _, _, liveness = hostile
    assert {name for name, seen in liveness.items() if seen["live"]} == set(effect_cases.HOSTILE)


@pytest.mark.parametrize("name", sorted(effect_cases.HOSTILE))
def test_each_live_case_is_dangerous_alone(
    hostile: tuple[Path, Path, dict[str, Any]], name: str
) -> None:
    files, markers, _ = hostile
    code, report = _scan(files / name)
    (entry,) = report["files"]
    assert code == 1 and _dangerous(entry), entry
    assert entry["error"] is None  # judged, never "could not scan"
    assert not list(markers.iterdir())


def test_every_live_case_is_dangerous_in_a_directory(
    hostile: tuple[Path, Path, dict[str, Any]],
) -> None:
    files, markers, _ = hostile
    code, report = _scan(files)
    assert code == 1
    assert report["skipped"] == []
    by_name = {Path(f["path"]).name: f for f in report["files"]}
    assert sorted(by_name) == sorted(effect_cases.HOSTILE)
    assert [name for name, entry in by_name.items() if not _dangerous(entry)] == []
    assert not list(markers.iterdir())


def test_no_command_runs_a_case(hostile: tuple[Path, Path, dict[str, Any]]) -> None:
    """``show`` lists an unknown callable as an opaque record (or refuses the file); ``verify``
    says never to load it; neither runs anything."""
    files, markers, _ = hostile
    runner = CliRunner()
    for name in sorted(effect_cases.HOSTILE):
        shown = runner.invoke(cli, ["show", str(files / name)])
        assert "Traceback" not in shown.output
        verified = runner.invoke(cli, ["verify", str(files / name)])
        assert verified.exit_code == 1, (name, verified.output)
        assert "Traceback" not in verified.output
    assert not list(markers.iterdir())


@pytest.mark.parametrize(
    ("data", "dangerous", "unknown"),
    [
        # REDUCE of an unknown callable: a call, whatever it is
        (b"\x80\x02cmypkg\nrun\nX\x01\x00\x00\x00a\x85R.", {"mypkg.run"}, set()),
        # NEWOBJ of an unknown class, then BUILD of a plain __dict__: construction only
        (b"\x80\x02cmypkg\nConfig\n)\x81}X\x01\x00\x00\x00a\x4b\x01sb.", set(), {"mypkg.Config"}),
        # ... BUILD of a state only a __setstate__ takes: a call of it
        (b"\x80\x02cmypkg\nConfig\n)\x81X\x01\x00\x00\x00a\x85b.", {"mypkg.Config"}, set()),
        # OBJ with arguments calls the class; without, only __new__
        (b"(cmypkg\nConfig\nK\x01o.", {"mypkg.Config"}, set()),
        (b"(cmypkg\nConfig\no.", set(), {"mypkg.Config"}),
        # INST likewise
        (b"(K\x01imypkg\nConfig\n.", {"mypkg.Config"}, set()),
        # getattr(CLASS, 'name') is read as the name CLASS.name, judged as any global: called
        (b"\x80\x02cbuiltins\ngetattr\ncmypkg\nTool\nX\x03\x00\x00\x00run\x86R"
         b"X\x01\x00\x00\x00a\x85R.", {"mypkg.Tool.run"}, {"mypkg.Tool"}),
        # a known-inert class (a dataclass of settings) called: its __post_init__ runs
        (b"\x80\x02ctransformers.training_args\nTrainingArguments\n)R.",
         {"transformers.training_args.TrainingArguments"}, set()),
    ],
)  # fmt: skip
def test_a_call_of_anything_not_known_inert_is_dangerous(
    data: bytes, dangerous: set[str], unknown: set[str]
) -> None:
    seen = load_pickle(data, refuse_dangerous=False).globals_seen
    verdicts = {f"{m}.{n}": v for m, n, v in seen}
    assert {n for n, v in verdicts.items() if v is Verdict.DANGEROUS} == dangerous
    assert {n for n, v in verdicts.items() if v is Verdict.UNKNOWN} == unknown


def test_what_a_static_reading_cannot_resolve_is_dangerous_with_its_reason() -> None:
    """EXT codes and computed STACK_GLOBAL names: a dangerous ``<unresolved>`` name."""
    for data, reason in [
        (b"\x80\x02\x82\xf0)R.", "EXT1 code 240"),
        (b"\x80\x02\x83\x2c\x01.", "EXT2 code 300"),
        (b"\x80\x02\x84\x70\x11\x01\x00.", "EXT4 code 70000"),
        (b"\x80\x04K\x01K\x02\x93.", "STACK_GLOBAL at byte 6"),
    ]:
        seen = load_pickle(data, refuse_dangerous=False).globals_seen
        assert [(m, v) for m, _, v in seen] == [(UNRESOLVED, Verdict.DANGEROUS)], seen
        assert seen[0][1].startswith(reason)


def test_a_dotted_name_through_a_namespace_attribute_is_dangerous() -> None:
    data = b"\x80\x04\x8c\x0ctorch._utils\x8c\x10__builtins__.get\x93."
    seen = load_pickle(data, refuse_dangerous=False).globals_seen
    assert seen == [("torch._utils", "__builtins__.get", Verdict.DANGEROUS)]


@pytest.fixture(scope="module")
def benign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("benign")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        effect_cases.write_benign(folder)
        effect_cases.write_trainer_folder(folder / "trainer")
    return folder


def test_popular_libraries_benign_files_exit_0(benign: Path) -> None:
    code, report = _scan(benign)
    flagged = {
        f["path"]: [(g["name"], g["verdict"]) for g in f["globals"] if g["verdict"] != "safe"]
        for f in report["files"]
    }
    assert code == 0, {path: found for path, found in flagged.items() if found}
    names = {Path(f["path"]).name for f in report["files"]}
    assert {"training_args.bin", "optimizer.pt", "scheduler.pt", "fastai_style_learner.pt",
            "omegaconf.pt", "module_whole.pt", "partial_adam.pt"} <= names  # fmt: skip


def test_scan_then_verify_reaches_verify_on_a_trainer_checkpoint(benign: Path) -> None:
    (checkpoint,) = (benign / "trainer").glob("checkpoint-*")
    runner = CliRunner()
    for name in ("training_args.bin", "optimizer.pt"):
        scanned = runner.invoke(cli, ["scan", str(checkpoint / name)])
        assert scanned.exit_code == 0, scanned.output
        verified = runner.invoke(cli, ["verify", str(checkpoint / name)])
        assert verified.exit_code == 0, verified.output


def test_a_lightning_checkpoint_exits_0(tmp_path: Path) -> None:
    """Lightning's own checkpoint (hyperparameters as an AttributeDict, loops' state)."""
    import pytorch_lightning as pl

    class Model(pl.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_steps=1, default_root_dir=tmp_path, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu")  # fmt: skip
        trainer.fit(Model(), data)
    code, report = _scan(tmp_path)
    assert code == 0 and len(report["files"]) == 1, report


def test_a_checkpoint_wrapped_in_an_archive_is_scanned_or_reported(
    hostile: tuple[Path, Path, dict[str, Any]], benign: Path, tmp_path: Path
) -> None:
    """gzip, bzip2, xz and tar wrappers are opened (standard library) and what they hold is
    scanned, each finding named by its place; a 7z archive (the nullifAI pattern) is reported
    "archive not scanned", exit 1, in file and directory mode. A live case (proven above)
    unpacked from each is what torch.load would then run."""
    import bz2
    import gzip
    import lzma
    import tarfile

    files, markers, _ = hostile
    live = (files / "mailcap_findmatch.pt").read_bytes()
    folder = tmp_path / "wrapped"
    folder.mkdir()
    (folder / "model.pt.gz").write_bytes(gzip.compress(live))
    (folder / "model.pt.bz2").write_bytes(bz2.compress(live))
    (folder / "model.pt.xz").write_bytes(lzma.compress(live))
    with tarfile.open(folder / "bundle.tar.gz", "w:gz") as archive:
        archive.add(benign / "omegaconf.pt", "ok/omegaconf.pt")
        archive.add(files / "mailcap_findmatch.pt", "ok/model.pt")
    # a 7z archive's signature and header: no standard-library module opens it
    (folder / "model.7z").write_bytes(b"7z\xbc\xaf\x27\x1c\x00\x04" + bytes(24) + live)
    for path in sorted(folder.iterdir()):
        code, report = _scan(path)
        (entry,) = report["files"]
        assert code == 1 and _dangerous(entry), entry
        assert entry["format"] == "archive"
        if path.suffix == ".7z":
            assert entry["notes"][0].startswith("archive not scanned: a 7z archive")
        else:
            place = "ok/model.pt" if path.name == "bundle.tar.gz" else "model.pt"
            assert entry["places"]["mailcap.findmatch"] == [place]
    code, report = _scan(folder)
    assert code == 1 and report["skipped"] == []
    assert all(_dangerous(entry) for entry in report["files"]) and len(report["files"]) == 5
    text = CliRunner().invoke(cli, ["scan", str(folder / "model.7z")]).output
    assert "archive not scanned" in text
    with tarfile.open(tmp_path / "benign.tgz", "w:gz") as archive:
        archive.add(benign / "omegaconf.pt", "omegaconf.pt")
    assert _scan(tmp_path / "benign.tgz")[0] == 0
    assert not list(markers.iterdir())
