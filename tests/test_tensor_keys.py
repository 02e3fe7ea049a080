"""One meaning of a tensor key across commands (docs/formats.md#tensor-keys): ``--filter`` in
``show`` and ``convert``, wrapper prefixes (only where they lead a key), the hints ``diff`` and
``convert`` give about them, and two paths that flatten to the same key."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch as st
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.convert.run import convert
from ckpttool.commands.diff.run import diff
from ckpttool.commands.show import show
from ckpttool.errors import InputError
from ckpttool.model.roles import layout_warnings
from ckpttool.render.show import render_json
from tests.support.helpers import FIXTURES

RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"
WRAPPED = FIXTURES / "wrapped"


def _wrapper_warnings(path: Path) -> list[str]:
    with open_checkpoint(path) as ckpt:
        from ckpttool.model.roles import layout_of

        warnings = layout_warnings(ckpt.root, layout_of(ckpt), ckpt.tensors())
    return [w for w in warnings if "wrapper prefixes" in w]


# --- --filter: the key as show prints it, in show and convert --------------------------------


def test_one_filter_selects_the_same_tensors_in_show_and_convert(tmp_path: Path) -> None:
    pattern = "model.model.layers.0.mlp.*"  # the keys as show prints them
    shown = [info.record.key for info in show(RESUME, pattern=pattern).tensors]
    assert len(shown) == 3
    report = convert(RESUME, tmp_path / "out.safetensors", pattern=pattern)
    written = st.load_file(report.outputs[0])
    assert sorted(f"model.{name}" for name in written) == sorted(shown)
    # the name convert writes is accepted too
    report = convert(RESUME, tmp_path / "name.safetensors", pattern="model.layers.0.mlp.*")
    assert sorted(st.load_file(report.outputs[0])) == sorted(written)


def test_a_filter_that_matches_nothing_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as raised:
        convert(RESUME, tmp_path / "out.safetensors", pattern="nothing*")
    assert str(raised.value).startswith(f"{RESUME}: --filter 'nothing*' matches no tensor")


# --- wrapper prefixes lead a key, or are not wrapper prefixes --------------------------------


def test_only_a_leading_wrapper_prefix_is_one(tmp_path: Path) -> None:
    path = tmp_path / "names.pth"
    one = torch.ones(2)
    torch.save(
        {
            "convolution_module.gcn_layers.0.weight": one.clone(),
            "submodule.x": one.clone(),
            "blocks.module.w": one.clone(),
        },
        path,
    )
    assert _wrapper_warnings(path) == []
    assert convert(path, tmp_path / "out.safetensors").warnings == []
    for name in ("ddp.pth", "compiled.pth", "ddp_compiled.pth"):  # at the start, repeated
        (warning,) = _wrapper_warnings(WRAPPED / name)
        assert warning.startswith("12 keys carry DDP/torch.compile wrapper prefixes")
    resume = tmp_path / "resume.pth"  # below the part of a file of several parts
    torch.save(
        {
            "model": {"module.a.weight": one.clone(), "convolution_module.w": one.clone()},
            "optimizer": {"state": {}, "param_groups": []},
            "epoch": 1,
            "step": 3,
        },
        resume,
    )
    (warning,) = _wrapper_warnings(resume)
    assert warning.startswith("1 keys carry") and "e.g. 'model.module.a.weight'" in warning


# --- diff and convert say what show says -------------------------------------------------------


def _plain_copy(tmp_path: Path) -> Path:
    """wrapped/ddp.pth without its prefixes (a plain state dict of the same tensors)."""
    state = torch.load(WRAPPED / "ddp.pth", weights_only=True)
    plain = tmp_path / "plain.pth"
    torch.save({k.removeprefix("module."): v for k, v in state.items()}, plain)
    return plain


@pytest.mark.parametrize(
    ("a", "b", "sides"),
    [
        ("compiled.pth", "ddp.pth", "12 of A's start with '_orig_mod.'; 12 of B's start with 'module.'"),
        ("ddp_compiled.pth", None, "12 of A's start with 'module._orig_mod.'"),
    ],
)  # fmt: skip
def test_diff_hints_at_ignore_wrappers(tmp_path: Path, a: str, b: str | None, sides: str) -> None:
    other = WRAPPED / b if b else _plain_copy(tmp_path)
    report = diff(WRAPPED / a, other)
    assert report.counts()["only_a"] == report.counts()["only_b"] == 12
    assert (
        "12 keys only in A are keys only in B once DDP/torch.compile wrapper prefixes are "
        f"removed ({sides}): use --ignore-wrappers to compare them"
    ) in report.notes
    fixed = diff(WRAPPED / a, other, ignore_wrappers=True)
    assert fixed.equal
    assert not any("wrapper" in note for note in fixed.notes)
    unrelated_a, unrelated_b = tmp_path / "x.pth", tmp_path / "y.pth"  # no hint: other keys
    torch.save({"module.x": torch.ones(2)}, unrelated_a)
    torch.save({"y": torch.ones(2), "z": torch.ones(2)}, unrelated_b)
    assert not any("wrapper" in note for note in diff(unrelated_a, unrelated_b).notes)


def test_convert_warns_about_names_it_writes_with_a_wrapper_prefix(tmp_path: Path) -> None:
    report = convert(WRAPPED / "ddp.pth", tmp_path / "out.safetensors")
    assert report.warnings == [
        "12 of the 12 tensor names start with the DDP/torch.compile wrapper prefix 'module.' "
        "and are written with it; add --ignore-wrappers to remove it"
    ]
    clean = convert(
        WRAPPED / "ddp.pth", tmp_path / "clean.safetensors", ignore_wrappers=True, force=True
    )
    assert clean.warnings == []


# --- two paths, one key ----------------------------------------------------------------------


@pytest.fixture
def same_key(tmp_path: Path) -> Path:
    path = tmp_path / "same_key.pth"
    torch.save({"a.b": {"c": torch.ones(2)}, "a": {"b.c": torch.zeros(2)}}, path)
    return path


def test_diff_names_both_paths_that_flatten_to_one_key(same_key: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.pth"
    torch.save({"a": {"b.c": torch.zeros(2)}}, other)
    with pytest.raises(InputError) as raised:
        diff(same_key, other)
    message = str(raised.value)
    assert message == (
        f"{same_key}: two paths flatten to the same key 'a.b.c': ['a.b']['c'] and "
        "['a']['b.c']; tensors are named by their dotted path, which cannot tell them apart"
    )
    assert "after removing prefixes" not in message
    both = tmp_path / "both.pth"  # keys that prefixes make one are still said to be so
    torch.save({"module.x": torch.ones(2), "x": torch.ones(2)}, both)
    with pytest.raises(InputError, match=r"after removing prefixes, 'module\.x' and 'x' are both"):
        diff(both, both, ignore_wrappers=True)


def test_convert_names_both_paths_that_flatten_to_one_key(same_key: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"two paths flatten to the same key 'a\.b\.c'"):
        convert(same_key, tmp_path / "out.safetensors")


def test_show_warns_when_two_paths_flatten_to_one_key(same_key: Path) -> None:
    report = show(same_key)
    assert [info.record.key for info in report.tensors] == ["a.b.c", "a.b.c"]
    expected = (
        "two paths flatten to the same key 'a.b.c': ['a.b']['c'] and ['a']['b.c']; their rows "
        "are listed under one key, and diff and convert refuse them"
    )
    assert expected in report.warnings
    assert expected in render_json(report)["warnings"]
