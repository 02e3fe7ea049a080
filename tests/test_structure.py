"""Parts found by their structure, whatever the script called them (issue #51, items 3, 4, 7, 8).

An optimizer state at ``opt`` or ``state.optimizers.Adam``, RNG states by their shapes, the
model beside them; ``show``, ``convert``, ``load_state_dict`` and ``edit --for-inference`` all
use the one finding (ckpttool/model/structure.py). Fixtures: ignite's own ``Checkpoint``
handler, a learner's ``{'model', 'opt'}`` and torch-built Composer state
(tests/support/composer_state.py says why not Composer itself), torchtune's recipe_state.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

import ckpttool
from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli.app import cli
from ckpttool.errors import LayoutError
from ckpttool.model.structure import find_parts, is_module_state_dict
from tests.support.composer_state import ComposerClassifier, composer_checkpoint, trained
from tests.support.helpers import FIXTURES

RECIPE_STATE = FIXTURES / "frameworks/torchtune/output/recipe_state/recipe_state.pt"


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def shown(path: Path) -> dict[str, Any]:
    result = run("show", path, "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _trained_net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    return net, opt


def _root(tmp_path: Path, obj: Any) -> Any:
    path = tmp_path / "tree.pt"
    torch.save(obj, path)
    with open_checkpoint(path) as ckpt:
        return ckpt.root


# -- the finders, on the reader's trees ------------------------------------------------------


def test_an_optimizer_state_is_found_under_any_key_and_depth(tmp_path: Path) -> None:
    net, opt = _trained_net()
    tree = {"weights": net.state_dict(), "run": {"train": {"o": opt.state_dict()}}, "epoch": 3}
    parts = find_parts(_root(tmp_path, tree))
    assert parts.optimizers == ("run.train.o",)
    assert parts.model == "weights"


def test_rng_states_are_found_by_their_shapes_and_types(tmp_path: Path) -> None:
    net, opt = _trained_net()
    tree = {
        "net": net.state_dict(),
        "o": opt.state_dict(),
        "gen_cpu": torch.get_rng_state(),  # uint8[5056]
        "np_legacy": np.random.get_state(),  # ('MT19937', uint32[624], pos, has_gauss, cached)
        "np_generator": np.random.default_rng(
            1
        ).bit_generator.state,  # {'bit_generator': 'PCG64'...}
        "py": random.getstate(),  # (3, 625 ints, None)
        "per_device": [torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)],
        "ranks": [{"python": random.getstate(), "torch": torch.get_rng_state()}],
    }
    parts = find_parts(_root(tmp_path, tree))
    assert parts.rng == ("gen_cpu", "np_legacy", "np_generator", "py", "per_device", "ranks")
    assert (parts.model, parts.optimizers) == ("net", ("o",))


def test_a_parameter_named_state_and_a_uint8_buffer_stay_weights(tmp_path: Path) -> None:
    """Negative cases: a model parameter ``state``, a submodule ``param_groups``, a uint8
    buffer of torch's RNG state size: all the model's, none an optimizer or RNG state."""
    model = {
        "state": torch.ones(3),
        "param_groups.0.weight": torch.ones(2, 2),
        "lut": torch.zeros(5056, dtype=torch.uint8),
    }
    nested = {"state": {"w": torch.ones(2)}, "param_groups": {"0": {"weight": torch.ones(2)}}}
    _, opt = _trained_net()
    root = _root(tmp_path, {"model": model, "nested": nested, "opt": opt.state_dict()})
    assert is_module_state_dict(root["model"]) and is_module_state_dict(root["nested"])
    parts = find_parts(root)
    assert (parts.models, parts.optimizers, parts.rng) == (("model", "nested"), ("opt",), ())
    path = tmp_path / "state_dict.pt"
    torch.save(model, path)
    assert shown(path)["layout"] == "state_dict"
    loaded = ckpttool.load_state_dict(path)
    assert sorted(loaded) == sorted(model) and torch.equal(loaded["lut"], model["lut"])
    training = tmp_path / "training.pt"
    torch.save({"net": model, "opt": opt.state_dict(), "gen": torch.get_rng_state()}, training)
    out = tmp_path / "inference.pt"
    result = run("edit", training, "--for-inference", "-o", out)
    assert result.exit_code == 0, result.output
    kept = torch.load(out)
    assert list(kept) == ["net"] and sorted(kept["net"]) == sorted(model)


# -- a learner's {'model', 'opt'} --------------------------------------------------------------


def test_a_learners_opt_is_the_optimizer_and_for_inference_drops_it(tmp_path: Path) -> None:
    net, opt = _trained_net()
    path = tmp_path / "learner.pth"
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, path)
    report = shown(path)
    assert (report["model_part"], report["optimizer_part"]) == ("model", "opt")
    assert report["optimizer"]["type_guess"] == "Adam"
    out = tmp_path / "inference.pth"
    result = run("edit", path, "--for-inference", "-o", out)
    assert result.exit_code == 0, result.output
    assert "drop: opt" in result.output
    kept = torch.load(out)
    assert list(kept) == ["model"]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh.load_state_dict(kept["model"])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())


# -- ignite's Checkpoint handler: {'net', 'opt', 'trainer'} ---------------------------------------


def _ignite_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, Any]:
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver

    net, opt = _trained_net()

    def step(engine: Any, batch: torch.Tensor) -> float:
        opt.zero_grad()
        net(batch).sum().backward()
        opt.step()
        return 0.0

    trainer = Engine(step)
    saver = DiskSaver(str(tmp_path / "ignite"), require_empty=False, create_dir=True)
    handler = Checkpoint({"net": net, "opt": opt, "trainer": trainer}, saver, n_saved=1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run([torch.randn(2, 4) for _ in range(3)], max_epochs=2)
    assert handler.last_checkpoint is not None
    return Path(handler.last_checkpoint), net, trainer


def test_ignites_checkpoint_opt_and_trainer_are_found_and_dropped(tmp_path: Path) -> None:
    from ignite.engine import Engine
    from ignite.handlers import Checkpoint

    path, net, trainer = _ignite_checkpoint(tmp_path)
    report = shown(path)
    assert (report["layout"], report["model_part"]) == ("training_checkpoint", "net")
    assert report["optimizer_part"] == "opt"
    loaded = ckpttool.load_state_dict(path)
    assert {k: v.tolist() for k, v in loaded.items()} == {
        k: v.tolist() for k, v in net.state_dict().items()
    }
    out = tmp_path / "inference.pt"
    result = run("edit", path, "--for-inference", "-o", out)
    assert result.exit_code == 0, result.output
    assert "drop: opt" in result.output and "drop: trainer" in result.output
    kept = torch.load(out)
    assert list(kept) == ["net"]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    Checkpoint.load_objects({"net": fresh}, kept)  # ignite's own loader, the oracle
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())
    resumed = Engine(lambda engine, batch: 0.0)  # and the original file still resumes
    Checkpoint.load_objects({"trainer": resumed}, torch.load(path))
    assert resumed.state.iteration == trainer.state.iteration == 6


# -- Composer: state.model, state.optimizers.Adam, rng[0] ----------------------------------------


@pytest.fixture
def composer(tmp_path: Path) -> tuple[Path, ComposerClassifier]:
    model, optimizer, scheduler = trained()
    path = tmp_path / "ep1-ba5-rank0.pt"
    torch.save(composer_checkpoint(model, optimizer, scheduler), path)
    return path, model


def test_show_names_composers_parts_and_where_they_are(
    composer: tuple[Path, ComposerClassifier],
) -> None:
    path, _ = composer
    report = shown(path)
    assert report["layout"] == "training_checkpoint"
    assert report["model_part"] == "state.model"
    assert report["optimizer_part"] == "state.optimizers.Adam"
    assert report["rng"] == ["rng"]
    assert report["num_parameters"] == 23
    assert any("'state.model.module.0.weight'" in w for w in report["warnings"])  # the wrapper
    text = run("show", path).stdout
    assert "model in 'state.model', optimizer in 'state.optimizers.Adam'" in text


def test_convert_and_load_state_dict_take_composers_model_not_its_rng(
    composer: tuple[Path, ComposerClassifier], tmp_path: Path
) -> None:
    path, model = composer
    out = tmp_path / "model.safetensors"
    result = run("convert", path, out)
    assert result.exit_code == 0, result.output
    written = load_file(str(out))
    assert sorted(written) == sorted(model.state_dict())  # no rng.0.torch, rng.0.numpy.1
    loaded = ckpttool.load_state_dict(path)
    fresh = ComposerClassifier(
        torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    )
    fresh.load_state_dict(loaded)  # strict: nothing beside the model
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    inner = ckpttool.load_state_dict(path, ignore_wrappers=True)
    fresh.module.load_state_dict(inner)


def test_for_inference_drops_composers_optimizer_scheduler_counters_and_rng(
    composer: tuple[Path, ComposerClassifier], tmp_path: Path
) -> None:
    path, model = composer
    out = tmp_path / "inference.pt"
    result = run("edit", path, "--for-inference", "-o", out)
    assert result.exit_code == 0, result.output
    kept = torch.load(out, weights_only=False)
    assert list(kept) == ["state"]
    assert "optimizers" in kept["state"] and not kept["state"]["optimizers"]
    assert "StepLR" not in kept["state"]["schedulers"] and "timestamp" not in kept["state"]
    assert kept["state"]["run_name"] == "structure-test"
    assert all(torch.equal(kept["state"]["model"][k], v) for k, v in model.state_dict().items())


def test_edit_maps_and_refuses_an_ema_of_a_model_found_deeper(
    composer: tuple[Path, ComposerClassifier], tmp_path: Path
) -> None:
    """``--map`` and ``--use-ema`` reach Composer's ``state.model`` (a dotted part): the map
    renames there, an EMA that is not the model's is one line, not a KeyError."""
    path, model = composer
    rules = {"unmatched": "keep", "rules": [{"from": "module.{L}.weight", "to": "net.{L}.w"}]}
    spec = tmp_path / "map.json"
    spec.write_text(json.dumps(rules))
    out = tmp_path / "mapped.pt"
    result = run("edit", path, "--map", spec, "-o", out)
    assert result.exit_code == 0, result.output
    kept = torch.load(out, weights_only=False)
    assert sorted(kept["state"]["model"]) == [
        "module.0.bias",
        "module.2.bias",
        "net.0.w",
        "net.2.w",
    ]
    assert torch.equal(kept["state"]["model"]["net.2.w"], model.state_dict()["module.2.weight"])
    assert "Adam" in kept["state"]["optimizers"] and len(kept["rng"]) == 1
    refused = run("edit", path, "--use-ema", "rng", "-o", tmp_path / "ema.pt")
    assert refused.exit_code == 2
    assert (
        refused.stderr.count("\n") == 1 and "none of its tensors names a tensor" in refused.stderr
    )


# -- a file with no model: convert refuses it ---------------------------------------------------


def test_convert_refuses_torchtunes_recipe_state_saying_what_it_holds(tmp_path: Path) -> None:
    out = tmp_path / "r.safetensors"
    result = run("convert", RECIPE_STATE, out)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: ")
    assert "no model weights, nothing to convert" in result.stderr
    assert "an optimizer state in 'optimizer' (6 tensors)" in result.stderr
    assert "(seed, epochs_run, total_epochs, max_steps_per_epoch)" in result.stderr
    assert not out.exists() and not list(tmp_path.iterdir())
    chosen = run("convert", RECIPE_STATE, out, "--section", "optimizer")
    assert chosen.exit_code == 0, chosen.output
    assert len(load_file(str(out))) == 6
    with pytest.raises(LayoutError, match="no model weights, no state dict to load"):
        ckpttool.load_state_dict(RECIPE_STATE)
    assert len(ckpttool.load_state_dict(RECIPE_STATE, section=None)) == 6


def test_convert_refuses_a_bare_optimizer_file(tmp_path: Path) -> None:
    _, opt = _trained_net()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    result = run("convert", path, tmp_path / "o.safetensors")
    assert result.exit_code == 2
    assert "it holds only an optimizer state (12 tensors: the whole file)" in result.stderr
    assert not (tmp_path / "o.safetensors").exists()


# -- load_state_dict(dequantize=True): what convert --dequantize writes ------------------------

TORCHAO = FIXTURES / "torchao"


@pytest.mark.parametrize(
    "name",
    ["int8_weight_only.pt", "float8_weight_only.pt", "int4_tile_packed.pt",
     "aqt_int8_weight_only.pt", "int8_weight_only_bf16.pt"],
)  # fmt: skip
def test_load_state_dict_dequantizes_torchao_as_convert_does(tmp_path: Path, name: str) -> None:
    path = TORCHAO / name
    out = tmp_path / "out.safetensors"
    result = run("convert", path, out, "--dequantize")
    assert result.exit_code == 0, result.output
    written = load_file(str(out))
    loaded = ckpttool.load_state_dict(path, dequantize=True)
    assert sorted(loaded) == sorted(written)
    for key, tensor in written.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    assert any(k.endswith(".qdata") or ".tensor_impl." in k for k in ckpttool.load_state_dict(path))


def test_load_state_dict_dequantizes_torch_and_gguf_quantized_tensors(tmp_path: Path) -> None:
    per_tensor = torch.quantize_per_tensor(torch.tensor([-0.2, 0.0, 0.7]), 0.1, 2, torch.quint8)
    per_channel = torch.quantize_per_channel(
        torch.tensor([[-1.0, 0.5], [0.25, 2.0]]), torch.tensor([0.1, 0.05], dtype=torch.float64),
        torch.tensor([0, 3]), 0, torch.qint8,
    )  # fmt: skip
    path = tmp_path / "quantized.pt"
    torch.save({"a": per_tensor, "b": per_channel, "c": torch.ones(2)}, path)
    loaded = ckpttool.load_state_dict(path, dequantize=True)
    assert torch.equal(loaded["a"], per_tensor.dequantize())
    assert torch.equal(loaded["b"], per_channel.dequantize())
    assert loaded["a"].dtype == torch.float32 and torch.equal(loaded["c"], torch.ones(2))
    assert ckpttool.load_state_dict(path)["a"].is_quantized
    gguf_file = FIXTURES / "gguf/q8_0.gguf"
    out = tmp_path / "gguf.safetensors"
    assert run("convert", gguf_file, out, "--dequantize").exit_code == 0
    written = load_file(str(out))
    decoded = ckpttool.load_state_dict(gguf_file, dequantize=True)
    assert sorted(decoded) == sorted(written)
    assert all(torch.equal(decoded[k], v) for k, v in written.items())
