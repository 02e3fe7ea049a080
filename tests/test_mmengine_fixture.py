"""mmengine's ``Runner`` checkpoint (tests/fixtures/mmengine, written by
``tools/mmengine_fixture.py``): its message hub pickles ``getattr(HistoryBuffer, 'min')``, an
unknown method read as a stub, so every command reads the ``state_dict`` tensors, equal byte for
byte to what mmengine's loader reads (``torch.load(weights_only=False)``, live, and the frozen
manifest), and the counters ``epoch`` and ``iter`` from ``meta``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckpttool
from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.show import build_report
from ckpttool.commands.trend import trend
from tests.support.helpers import FIXTURES

FOLDER = FIXTURES / "mmengine"
CHECKPOINT = FOLDER / "iter_2.pth"
MANIFEST = json.loads((FOLDER / "manifest.json").read_text())


def _sha256(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _described(tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
         "sha256": _sha256(t)}
        for key, t in tensors.items()
    ]  # fmt: skip


def test_the_manifest_is_what_mmengines_loader_reads() -> None:
    checkpoint = torch.load(CHECKPOINT, map_location="cpu", weights_only=False)
    history = checkpoint["message_hub"]["log_scalars"]["train/loss"]  # the real class, imported
    assert type(history).__module__ == "mmengine.logging.history_buffer"
    assert list(checkpoint) == MANIFEST["keys"]
    assert _described(checkpoint["state_dict"]) == MANIFEST["state_dict"]
    assert {k: checkpoint["meta"][k] for k in ("epoch", "iter")} == MANIFEST["meta"]


def test_load_state_dict_is_mmengines_state_dict_byte_for_byte() -> None:
    assert _described(ckpttool.load_state_dict(CHECKPOINT)) == MANIFEST["state_dict"]


def test_show_lists_the_state_dict_and_the_counters() -> None:
    with open_checkpoint(CHECKPOINT) as ckpt:
        report = build_report(ckpt)
    assert report.model_part == "state_dict"
    keys = [info.record.key for info in report.tensors]
    expected = [f"state_dict.{entry['key']}" for entry in MANIFEST["state_dict"]]
    assert keys[: len(expected)] == expected
    assert report.fields["meta.epoch"] == 0 and report.fields["meta.iter"] == 2
    assert report.num_parameters == sum(
        torch.Size(e["shape"]).numel() for e in MANIFEST["state_dict"]
    )
    result = CliRunner().invoke(cli, ["show", str(CHECKPOINT)])
    assert result.exit_code == 0, result.output
    assert "meta:       epoch=0, iter=2" in result.output
    assert "HistoryBuffer" in result.output  # a stub, shown by its class name


def test_convert_writes_the_state_dict_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(CHECKPOINT), str(out)])
    assert result.exit_code == 0, result.output
    by_key = lambda entry: entry["key"]  # noqa: E731  (safetensors sorts its keys)
    assert sorted(_described(load_file(out)), key=by_key) == sorted(
        MANIFEST["state_dict"], key=by_key
    )


def test_verify_and_scan(tmp_path: Path) -> None:
    assert CliRunner().invoke(cli, ["verify", str(CHECKPOINT)]).exit_code == 0
    result = CliRunner().invoke(cli, ["scan", str(CHECKPOINT), "--json"])
    verdicts = {g["name"]: g["verdict"] for g in json.loads(result.stdout)["files"][0]["globals"]}
    history = "mmengine.logging.history_buffer.HistoryBuffer"
    assert {name for name, verdict in verdicts.items() if verdict != "safe"} == {
        history,
        *(f"{history}.{method}" for method in ("min", "max", "mean", "current")),
    }
    assert verdicts["builtins.getattr"] == "safe"  # resolved by name, reported as what it names
    assert result.exit_code == 1  # unknown classes: torch.load would import them


def test_trend_orders_runner_checkpoints_by_meta_iter(tmp_path: Path) -> None:
    later = tmp_path / "a" / "iter_2.pth"
    earlier = tmp_path / "b" / "iter_2.pth"
    later.parent.mkdir()
    earlier.parent.mkdir()
    shutil.copyfile(CHECKPOINT, later)
    checkpoint = torch.load(CHECKPOINT, map_location="cpu", weights_only=False)
    checkpoint["meta"]["iter"] = 1
    torch.save(checkpoint, earlier)
    report = trend([later, earlier])
    assert report.order == "step"
    assert [Path(point.path) for point in report.checkpoints] == [earlier, later]


def test_edit_for_inference_writes_the_message_hub_back(tmp_path: Path) -> None:
    """Issue 51, item 5: the message hub holds ``HistoryBuffer.min`` (a class's function, a
    GlobalRef to the reader); ``edit --for-inference`` wrote "cannot write a GlobalRef". It is
    written back as protocol 2 names it (``getattr(HistoryBuffer, 'min')``): torch.load and
    mmengine's own loading into a model read the output, everything but the optimizer as it was
    (mmengine's ``load_checkpoint`` calls ``torch.load`` with torch's default
    ``weights_only=True``, which refuses the source file as well)."""
    from mmengine.runner.checkpoint import _load_checkpoint_to_model
    from torch import nn

    output = tmp_path / "inference.pth"
    result = CliRunner().invoke(
        cli, ["edit", "--for-inference", str(CHECKPOINT), "-o", str(output)]
    )
    assert result.exit_code == 0, result.output
    source = torch.load(CHECKPOINT, map_location="cpu", weights_only=False)
    edited = torch.load(output, map_location="cpu", weights_only=False)
    assert "optimizer" in source and "optimizer" not in edited
    assert list(edited) == [key for key in source if key != "optimizer"]
    assert edited["meta"] == source["meta"]
    assert edited["param_schedulers"] == source["param_schedulers"]
    hub, original = edited["message_hub"], source["message_hub"]
    assert hub["runtime_info"] == original["runtime_info"]
    assert list(hub["log_scalars"]) == list(original["log_scalars"])
    for name, history in hub["log_scalars"].items():
        assert type(history) is type(original["log_scalars"][name])
        state, before = history.__getstate__(), original["log_scalars"][name].__getstate__()
        assert set(state) == set(before)
        methods = state["statistics_methods"]  # the functions the GlobalRefs name
        assert methods == before["statistics_methods"] and methods["min"] is type(history).min
        for field, value in state.items():
            if field != "statistics_methods":
                assert repr(value) == repr(before[field]), field
    assert _described(edited["state_dict"]) == MANIFEST["state_dict"]

    class TinyNet(nn.Module):  # the fixture's model (tools/mmengine_fixture.py)
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.head = nn.Linear(8, 2)

    model = TinyNet()
    _load_checkpoint_to_model(model, edited, strict=True)
    assert _described(model.state_dict()) == MANIFEST["state_dict"]
