"""Pickled ``nn.Module`` objects (``torch.save(model)``; ultralytics' ``{'model': model, 'ema':
ema, 'epoch': ...}``) read as their ``state_dict()`` in every command: the oracle is torch's own
``model.state_dict()`` of the module saved (names, dtypes, shapes, bytes), and, for what
``edit`` writes, ``torch.load`` of the result (the modules come back whole)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

import ckpttool
from ckpttool.cli import cli
from ckpttool.commands.edit import edit_file
from ckpttool.errors import InputError


class Net(nn.Module):
    """What ``state_dict()`` keeps and leaves out: a Conv/BN stack (BN's
    ``num_batches_tracked`` is a persistent buffer), a persistent and a non-persistent buffer,
    a None buffer, a plain tensor attribute (as ultralytics' ``stride``/``anchors``), a None
    bias, nested ModuleList/ModuleDict, the old weight_norm (``weight_g``/``weight_v``
    parameters, ``weight`` an attribute) and a tied weight."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.register_buffer("persistent", torch.arange(3.0))
        self.register_buffer("transient", torch.ones(2), persistent=False)
        self.register_buffer("missing", None)
        self.anchors = torch.zeros(5)
        self.head = nn.Linear(4, 2, bias=False)
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.ModuleDict({"a": nn.Linear(2, 3)})])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
            self.norm = nn.utils.weight_norm(nn.Linear(3, 3))
        self.emb = nn.Embedding(5, 2)
        self.out = nn.Linear(2, 5, bias=False)
        self.out.weight = self.emb.weight
        self.body[1].running_mean.uniform_()
        self.body[1].num_batches_tracked += 7


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _same_tensors(
    mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], ordered: bool = True
) -> None:
    assert list(mine) == list(theirs) if ordered else sorted(mine) == sorted(theirs)
    for key, tensor in theirs.items():
        assert (mine[key].dtype, mine[key].shape) == (tensor.dtype, tensor.shape), key
        assert _bytes(mine[key]) == _bytes(tensor), key


def _training(model: Net, ema: Net) -> dict[str, Any]:
    """As ultralytics' trainer saves (``save_model``): the modules themselves beside counters,
    the optimizer's state dict and the training arguments."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {
        "epoch": 3,
        "best_fitness": 0.5,
        "model": model,
        "ema": ema,
        "updates": 12,
        "optimizer": optimizer.state_dict(),
        "train_args": {"imgsz": 64, "batch": 2},
    }


@pytest.fixture(params=[True, False], ids=["zip", "legacy"])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A torch.save(model) file, a training dict of two modules, and the model's state dict
    saved as such, in the zip format or the legacy one."""
    zipped = request.param
    model, ema = Net(0), Net(1)
    paths = {name: tmp_path / f"{name}.pt" for name in ("module", "training", "state_dict")}
    for name, value in (
        ("module", model),
        ("training", _training(model, ema)),
        ("state_dict", model.state_dict()),
    ):
        torch.save(value, paths[name], _use_new_zipfile_serialization=zipped)
    return {"model": model, "ema": ema, **paths}


def test_the_module_oracle_holds_what_state_dict_leaves_out() -> None:
    model = Net()
    keys = list(model.state_dict())
    assert "body.1.num_batches_tracked" in keys and "persistent" in keys
    assert {"norm.weight_g", "norm.weight_v"} <= set(keys) and "norm.weight" not in keys
    assert not {"transient", "missing", "anchors", "head.bias"} & set(keys)
    assert "out.weight" in keys and "emb.weight" in keys


def test_show_lists_a_pickled_module_as_its_state_dict(saved: dict[str, Any]) -> None:
    result = CliRunner().invoke(cli, ["show", "--json", str(saved["module"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    expected = saved["model"].state_dict()
    assert report["layout"] == "pickled_module"
    assert report["details"]["module_class"] == f"{__name__}.Net"
    assert [(t["key"], t["dtype"], t["shape"]) for t in report["tensors"]] == [
        (key, str(t.dtype).removeprefix("torch."), list(t.shape)) for key, t in expected.items()
    ]


def test_modules_in_a_dict_are_sections_of_their_state_dicts(saved: dict[str, Any]) -> None:
    result = CliRunner().invoke(cli, ["show", "--json", str(saved["training"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["layout"] == "training_checkpoint" and report["model_part"] == "model"
    assert report["details"]["module_classes"] == {
        "model": f"{__name__}.Net", "ema": f"{__name__}.Net",
    }  # fmt: skip
    expected = [f"{part}.{key}" for part in ("model", "ema") for key in saved[part].state_dict()]
    assert [t["key"] for t in report["tensors"]] == expected
    text = CliRunner().invoke(cli, ["show", str(saved["training"])]).output
    assert "._modules." not in text and "._parameters." not in text and "anchors" not in text


def test_open_reads_the_bytes_of_each_state_dict(saved: dict[str, Any]) -> None:
    for path, part in (
        (saved["module"], ""),
        (saved["training"], "model."),
        (saved["training"], "ema."),
    ):
        with ckpttool.open(path) as handle:
            mine = {
                key[len(part) :]: handle.get_tensor(key) for key in handle if key.startswith(part)
            }
        _same_tensors(mine, saved[part.rstrip(".") or "model"].state_dict())


@pytest.mark.parametrize("section", ["model", "ema"])
def test_load_state_dict_gives_the_state_dict_torch_gives(
    saved: dict[str, Any], section: str
) -> None:
    expected = saved[section].state_dict()
    _same_tensors(ckpttool.load_state_dict(saved["training"], section=section), expected)
    if section == "model":
        loaded = ckpttool.load_state_dict(saved["module"])
        _same_tensors(loaded, expected)
        Net(5).load_state_dict(loaded, strict=True)  # every name the module wants, no other
    assert loaded_shares(ckpttool.load_state_dict(saved["training"], section=section))


def loaded_shares(state_dict: dict[str, torch.Tensor]) -> bool:
    """The tied weight comes back as one storage under both names, as state_dict() gives it."""
    return state_dict["emb.weight"].data_ptr() == state_dict["out.weight"].data_ptr()


def test_diff_with_the_saved_state_dict_finds_them_identical(saved: dict[str, Any]) -> None:
    result = CliRunner().invoke(cli, ["diff", str(saved["state_dict"]), str(saved["module"])])
    assert result.exit_code == 0, result.output
    count = len(saved["model"].state_dict())
    assert (
        f"{count} identical, 0 differ within tolerance, 0 differ, 0 only in A, 0 only in B"
        in result.output
    )


def test_convert_writes_the_state_dict(saved: dict[str, Any], tmp_path: Path) -> None:
    for source, section in ((saved["module"], []), (saved["training"], ["--section", "ema"])):
        out = tmp_path / f"{source.stem}.safetensors"
        result = CliRunner().invoke(cli, ["convert", str(source), str(out), *section])
        assert result.exit_code == 0, result.output
        expected = saved["ema" if section else "model"].state_dict()
        written = load_file(out)
        assert set(expected) - set(written) == {"out.weight"}  # the tie, stored once
        kept = {key: t for key, t in expected.items() if key in written}
        _same_tensors(written, kept, ordered=False)


def test_verify_counts_the_attribute_tensors_as_used(saved: dict[str, Any]) -> None:
    for path in (saved["module"], saved["training"]):
        result = CliRunner().invoke(cli, ["verify", str(path)])
        assert result.exit_code == 0, result.output
        assert "no tensor uses" not in result.output


def test_for_inference_keeps_the_modules_whole(saved: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "inference.pt"
    report = edit_file(saved["training"], out, for_inference=True)
    assert report.dropped == ("optimizer",)
    assert report.tensors_before == report.tensors_after == 2 * len(saved["model"].state_dict())
    edited = torch.load(out, weights_only=False)
    assert set(edited) == {"epoch", "best_fitness", "model", "ema", "updates", "train_args"}
    for part in ("model", "ema"):
        module = edited[part]
        assert type(module) is Net
        _same_tensors(module.state_dict(), saved[part].state_dict())
        assert module._non_persistent_buffers_set == {"transient"}
        assert _bytes(module.anchors) == _bytes(saved[part].anchors)
        assert module.out.weight is module.emb.weight  # still one Parameter
        parameters = dict(module.named_parameters())
        assert list(parameters) == [n for n, _ in saved[part].named_parameters()]
        assert all(type(p) is nn.Parameter and p.requires_grad for p in parameters.values())
    with ckpttool.open(out) as handle:  # and ckpttool reads it back as it read the source
        assert list(handle.keys()) == [
            f"{p}.{k}" for p in ("model", "ema") for k in saved[p].state_dict()
        ]


def test_for_inference_on_a_whole_module_has_nothing_to_drop(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        cli, ["edit", str(saved["module"]), "--for-inference", "-o", str(tmp_path / "out.pt")]
    )
    assert result.exit_code == 0, result.output
    assert "nothing to change" in result.output and not (tmp_path / "out.pt").exists()


def test_use_ema_puts_the_ema_module_in_place_of_the_model(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "ema.pt"
    report = edit_file(saved["training"], out, use_ema="", for_inference=True)
    assert report.ema == "ema" and "ema" in report.dropped and "optimizer" in report.dropped
    edited = torch.load(out, weights_only=False)
    assert "ema" not in edited
    _same_tensors(edited["model"].state_dict(), saved["ema"].state_dict())


def test_dtype_casts_what_half_casts_in_the_state_dict(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "half.pt"
    edit_file(saved["module"], out, dtype="fp16", keep_dtype=["body.1.*"])
    edited = torch.load(out, weights_only=False)
    expected = {
        key: t if key.startswith("body.1.") or not t.is_floating_point() else t.half()
        for key, t in saved["model"].state_dict().items()
    }
    _same_tensors(edited.state_dict(), expected)
    assert edited.anchors.dtype == edited.transient.dtype == torch.float32  # attributes as saved


@pytest.mark.parametrize(
    ("option", "value"),
    [("drop", ["model.head.*"]), ("keep", ["model.body.*"]), ("rename", ["head=neck"])],
)
def test_edits_inside_a_module_are_refused_saying_why(
    saved: dict[str, Any], tmp_path: Path, option: str, value: list[str]
) -> None:
    with pytest.raises(
        InputError, match=r"tensor of the pickled .*Net in 'model', which edit writes back whole"
    ):
        edit_file(saved["training"], tmp_path / "out.pt", **{option: value})
    assert not (tmp_path / "out.pt").exists()


def test_objects_shows_the_modules_as_pickled(saved: dict[str, Any]) -> None:
    runner = CliRunner()
    tree = runner.invoke(cli, ["show", "--tree", str(saved["training"])])
    objects = runner.invoke(
        cli, ["show", "--objects", "--section", "model", str(saved["training"])]
    )
    assert tree.exit_code == objects.exit_code == 0, tree.output + objects.output
    assert "anchors" not in tree.output and "_modules" not in tree.output
    assert objects.output.startswith(f"<{__name__}.Net>")
    for attribute in ("_non_persistent_buffers_set", "anchors: tensor float32[5]", "transient"):
        assert attribute in objects.output
    as_json = json.loads(
        runner.invoke(cli, ["show", "--objects", "--json", str(saved["module"])]).output
    )
    assert as_json["__class__"] == f"{__name__}.Net" and as_json["anchors"] == "<tensor float32[5]>"


def test_a_parametrized_module_is_read_from_its_state_dict(tmp_path: Path) -> None:
    """torch refuses to pickle a parametrized module; its state_dict() is an ordinary one."""
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(3, 3))
    nn.utils.parametrize.register_parametrization(layer, "bias", nn.Identity())
    with pytest.raises(RuntimeError, match="only supported through state_dict"):
        torch.save(layer, tmp_path / "refused.pt")
    torch.save(layer.state_dict(), tmp_path / "state_dict.pt")
    expected = layer.state_dict()
    assert "parametrizations.weight.original0" in expected
    _same_tensors(ckpttool.load_state_dict(tmp_path / "state_dict.pt"), expected)
