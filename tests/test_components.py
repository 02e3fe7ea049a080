"""``--component NAME`` (show, diff, convert) and ``component=`` (ckpttool.open,
load_state_dict): one named part of a multi-component folder (tests/fixtures/folders/), as
``--section`` of that part picks it, with a one-line error for a name that is not a part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckpttool
from ckpttool.errors import InputError
from tests.fixtures.folders.generate import HERE
from tests.test_folders import LIBRARY, described, run

PIPELINE = HERE / "ldm_pipeline"
COMPONENTS = LIBRARY["ldm_pipeline"]["components"]


@pytest.mark.parametrize("component", ["unet", "vqvae"])
def test_load_state_dict_of_a_component_is_the_component_s_own(component: str) -> None:
    state = ckpttool.load_state_dict(PIPELINE, component=component)
    assert described(state) == COMPONENTS[component]


def test_open_of_a_component_gives_only_its_tensors() -> None:
    with ckpttool.open(PIPELINE, component="unet") as handle:
        assert sorted(handle.keys()) == sorted(COMPONENTS["unet"])
        state = {key: handle.get_tensor(key) for key in handle}
    assert described(state) == COMPONENTS["unet"]


@pytest.mark.parametrize("name", ["2", "2_Dense"])
def test_a_sentence_transformers_module_by_number_or_folder(name: str) -> None:
    state = ckpttool.load_state_dict(HERE / "st_dense", component=name)
    expected = {k[2:]: v for k, v in LIBRARY["st_dense"]["tensors"].items() if k[:2] == "2."}
    assert (
        described(state) == expected == {k: expected[k] for k in ("linear.weight", "linear.bias")}
    )


def test_show_of_a_component_lists_only_it() -> None:
    shown = json.loads(run("show", PIPELINE, "--component", "vqvae", "--json").stdout)
    assert {t["key"] for t in shown["tensors"]} == {f"vqvae.{k}" for k in COMPONENTS["vqvae"]}
    by_section = run("show", PIPELINE, "--section", "model.vqvae", "--json").stdout
    assert json.loads(by_section) == shown


def test_convert_of_a_component_loads_with_from_pretrained(tmp_path: Path) -> None:
    from diffusers import UNet2DModel

    out = tmp_path / "unet"
    out.mkdir()
    shutil.copy(PIPELINE / "unet" / "config.json", out / "config.json")
    run("convert", PIPELINE, out / "diffusion_pytorch_model.safetensors", "--component", "unet")
    converted = UNet2DModel.from_pretrained(out).state_dict()
    original = UNet2DModel.from_pretrained(PIPELINE / "unet").state_dict()
    assert converted.keys() == original.keys()
    for key, tensor in original.items():
        assert converted[key].dtype == tensor.dtype and torch.equal(
            converted[key].view(torch.uint8), tensor.view(torch.uint8)
        ), key
    assert described(converted) == COMPONENTS["unet"]


def test_diff_of_a_component_against_its_folder() -> None:
    out = run("diff", PIPELINE, PIPELINE / "unet", "--component-a", "unet", "--json").stdout
    report = json.loads(out)
    assert report["equal"] is True
    assert report["summary"]["identical"] == len(COMPONENTS["unet"])
    both = json.loads(run("diff", PIPELINE, PIPELINE, "--component", "vqvae", "--json").stdout)
    assert both["summary"]["identical"] == len(COMPONENTS["vqvae"])


def test_diff_of_two_different_components_differs() -> None:
    args = ("diff", PIPELINE, PIPELINE, "--component-a", "unet", "--component-b", "vqvae")
    run(*args, "--quick", exit_code=1)


def one_line_error(*args: object) -> str:
    result = run(*args, exit_code=2)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["show", "convert", "diff"])
def test_an_unknown_component_lists_the_components(tmp_path: Path, command: str) -> None:
    args: list[object] = [command, PIPELINE]
    args += {"show": [], "convert": [tmp_path / "out.safetensors"], "diff": [PIPELINE]}[command]
    line = one_line_error(*args, "--component", "scheduler")
    assert line == f"Error: {PIPELINE}: no component 'scheduler'; its components: unet, vqvae"
    assert not (tmp_path / "out.safetensors").exists()


def test_a_module_without_weights_is_refused() -> None:
    line = one_line_error("show", HERE / "st_dense", "--component", "1")
    assert line == f"Error: {HERE / 'st_dense'}: component '1' (Pooling) has no weights"


def test_a_component_of_a_checkpoint_without_parts_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, plain)
    for path in (plain, HERE / "unet"):
        line = one_line_error("show", path, "--component", "unet")
        assert line.startswith(f"Error: {path}: no components to pick 'unet' from"), line
    with pytest.raises(InputError, match="no components to pick 'unet'"):
        ckpttool.load_state_dict(plain, component="unet")
    with pytest.raises(InputError, match="no components to pick 'unet'"):
        ckpttool.open(plain, component="unet")


def test_a_component_and_a_section_together_are_refused(tmp_path: Path) -> None:
    message = "Error: a component and a section both pick a part: give one"
    for args in (
        ("show", PIPELINE, "--component", "unet", "--section", "model"),
        ("convert", PIPELINE, tmp_path / "out.safetensors", "--component", "unet",
         "--section", "model.unet"),
        ("diff", PIPELINE, PIPELINE, "--component", "unet", "--section", "model.unet"),
        ("diff", PIPELINE, PIPELINE, "--component-a", "unet", "--section-a", "model.unet"),
        ("diff", PIPELINE, PIPELINE, "--component", "unet", "--section-b", "model.unet"),
    ):  # fmt: skip
        assert one_line_error(*args) == message, args
    with pytest.raises(InputError, match="a component and a section"):
        ckpttool.load_state_dict(PIPELINE, component="unet", section="optimizer")


def test_a_side_s_component_overrides_a_shared_section() -> None:
    args = ("diff", PIPELINE, PIPELINE / "unet", "--section", "model", "--component-a", "unet")
    assert json.loads(run(*args, "--json").stdout)["equal"] is True


def test_verify_of_a_part_s_folder_checks_only_its_files(tmp_path: Path) -> None:
    """verify has no --component: the part's own folder is verified, with only its files."""
    copy = tmp_path / "pipeline"
    shutil.copytree(PIPELINE, copy)
    vqvae = copy / "vqvae" / "diffusion_pytorch_model.safetensors"
    vqvae.write_bytes(vqvae.read_bytes()[: vqvae.stat().st_size // 2])
    run("verify", copy / "unet")
    run("verify", copy, exit_code=1)
    run("verify", copy / "vqvae", exit_code=1)


def test_without_a_component_a_pipeline_root_is_every_part() -> None:
    state = ckpttool.load_state_dict(PIPELINE)
    assert {key.split(".", 1)[0] for key in state} == {"unet", "vqvae"}
    assert len(state) == len(COMPONENTS["unet"]) + len(COMPONENTS["vqvae"])


def test_the_library_s_diff_takes_components() -> None:
    from ckpttool.commands.diff.run import diff

    same = diff(PIPELINE, PIPELINE / "unet", component_a="unet", quick=True)
    assert same.equal
    assert not diff(PIPELINE, PIPELINE, component_a="unet", component_b="vqvae", quick=True).equal
    with pytest.raises(InputError, match="no component 'text_encoder'"):
        diff(PIPELINE, PIPELINE, component="text_encoder", quick=True)
