"""The library reads a path as the command line does (issue 42; docs/development.md, "One
default view").

For every checkpoint fixture, each directory the door opens as a layout (a framework's, a
directory format's) and each file a format recognises, ``ckpttool.load_state_dict(path)`` holds
exactly the tensors ``ckpttool convert PATH out.safetensors`` writes, read back by safetensors'
own loader with the aliases the output declares (as docs/convert.md reads them): the same keys,
dtypes, shapes and bytes. Where convert refuses the path, the library refuses it with the same
kind of error; where convert refuses only what its output cannot hold, the library gives what
the option convert names writes (GGML blocks: ``--dequantize``), or, for a file without
tensors, nothing. Every registered layout (each framework's layouts, each format) has a fixture
here, or the coverage test fails.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import ckpttool
from ckpttool.cli.app import cli
from ckpttool.commands.convert.run import convert
from ckpttool.errors import CkptError
from ckpttool.formats.registry import directory_format_of, directory_formats, file_formats
from ckpttool.frameworks.base import DEFAULT_VIEW, FILES_VIEW, WEIGHTS_VIEW
from ckpttool.frameworks.registry import FRAMEWORKS, detect_before_format, detect_directory
from ckpttool.frameworks.registry import frameworks as registered_frameworks
from tests.support import containers
from tests.support.helpers import FIXTURES

#: A fixture no file under tests/fixtures holds: torch's pre-0.4 tar format, which torch no
#: longer writes (tests/support/containers.py builds it as torch.load reads it).
GENERATED = {"generated/torch_tar.pth": lambda: containers.torch_tar(containers.BENIGN_PICKLE)}

#: convert's refusal of what no output holds (neither safetensors nor torch stores GGML blocks):
#: its message names ``--dequantize``, and the library, whose tensors are torch's, gives what
#: that option writes.
GGML_REFUSAL = ("quantized in GGML blocks", "--dequantize")
#: convert's refusal to write a file without tensors (a scheduler's or an RNG state's file, a
#: DCP index): the library gives the same nothing, an empty state dict.
NOTHING_TO_WRITE = ": no tensors to convert"


def layout_of(path: Path) -> str | None:
    """The layout the door opens ``path`` as: its framework's layout, a directory format's id
    (a framework that keeps one first, as the door asks them), a file format's id (the first
    that recognises the file, in the registry's order); None when nothing knows it."""
    name = str(path)
    if path.is_dir() or name.endswith(".index.json"):
        fmt = directory_format_of(name) if path.is_dir() else None
        if fmt is not None:
            found = detect_before_format(name, {})
            return found.kind if found is not None else fmt.id
        found = detect_directory(name)
        return found.kind if found is not None else None
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(512)
        for fmt in file_formats():
            handle.seek(0)
            if fmt.recognises(head, size, handle):
                return fmt.id
    return None


def _cases() -> dict[str, str]:
    """Fixture id -> layout: every directory the door opens as a layout, every file a format
    recognises (a layout's members too: each is a path a user can give), and the generated
    ones."""
    cases: dict[str, str] = {}
    for path in sorted(FIXTURES.rglob("*")):
        if "__pycache__" in path.parts or path.suffix in (".py", ".md"):
            continue
        if path.suffix == ".json" and not path.name.endswith(".index.json"):
            continue
        layout = layout_of(path)
        if layout is not None:
            cases[str(path.relative_to(FIXTURES))] = layout
    cases.update({where: layout_of_bytes(make()) for where, make in GENERATED.items()})
    return cases


def layout_of_bytes(data: bytes) -> str:
    for fmt in file_formats():
        if fmt.recognises(data[:512], len(data), io.BytesIO(data)):
            return fmt.id
    raise AssertionError("no format recognises the generated fixture")


CASES = _cases()


def registered_layouts() -> set[str]:
    """Every layout a registry lists: each framework's, each file and directory format's."""
    formats = {fmt.id for fmt in (*file_formats(), *directory_formats())}
    return {layout for _, layouts in FRAMEWORKS for layout in layouts} | formats


def test_every_registered_layout_has_a_fixture() -> None:
    missing = registered_layouts() - set(CASES.values())
    assert not missing, f"registered layouts without a fixture in tests/fixtures: {missing}"


def test_each_framework_declares_a_default_view_it_offers() -> None:
    """``default_view`` is None (the files are the model's tensors) or one of its ``views``,
    never the door's own names."""
    for framework in registered_frameworks():
        view = framework.default_view
        assert view is None or view in framework.views, framework.name
        assert DEFAULT_VIEW not in framework.views and FILES_VIEW not in framework.views


def _fixture(where: str, tmp_path: Path) -> Path:
    if where in GENERATED:
        path = tmp_path / "fixture" / Path(where).name
        path.parent.mkdir()
        path.write_bytes(GENERATED[where]())
        return path
    return FIXTURES / where


def _read_back(out: Path) -> dict[str, torch.Tensor]:
    """convert's output as safetensors loads it, with the aliases it declares."""
    tensors = load_file(out)
    with safe_open(out, "pt") as opened:
        metadata = opened.metadata() or {}
    for alias, kept in json.loads(metadata.get("ckpttool.aliases", "{}")).items():
        tensors[alias] = tensors[kept]
    return tensors


def _raw(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(mine) == sorted(theirs)
    for key, tensor in theirs.items():
        assert mine[key].dtype == tensor.dtype, key
        assert mine[key].shape == tensor.shape, key
        assert _raw(mine[key]) == _raw(tensor), key


def _convert(path: Path, out: Path, *options: str) -> Any:
    return CliRunner().invoke(cli, ["convert", str(path), str(out), *options])


@pytest.mark.parametrize("where", sorted(CASES))
def test_load_state_dict_is_what_convert_writes(where: str, tmp_path: Path) -> None:
    path = _fixture(where, tmp_path)
    out = tmp_path / "out.safetensors"
    result = _convert(path, out)
    why, option = GGML_REFUSAL
    if result.exit_code != 0 and why in result.output:
        assert result.exit_code == 2 and f"add {option}" in result.output, result.output
        result = _convert(path, out, option)
    if result.exit_code == 0:
        _same(ckpttool.load_state_dict(path), _read_back(out))
        return
    with pytest.raises(CkptError) as theirs:
        convert(path, tmp_path / "again.safetensors")
    if str(theirs.value).endswith(NOTHING_TO_WRITE):
        assert ckpttool.load_state_dict(path) == {}
        return
    # refused: the library refuses the path with the kind of error convert raises (the class,
    # and so the CLI's exit code)
    with pytest.raises(CkptError) as mine:
        ckpttool.load_state_dict(path)
    assert type(mine.value) is type(theirs.value), (str(mine.value), str(theirs.value))
    assert mine.value.exit_code == result.exit_code


@pytest.mark.parametrize(
    "where", [w for w, layout in sorted(CASES.items()) if layout == "deepspeed"]
)
def test_open_reads_a_directory_in_the_view_its_layout_declares(where: str) -> None:
    """``ckpttool.open(path)`` is ``view=`` its layout's default (DeepSpeed: ``weights``), and
    ``view="files"`` the files as stored, as ``show`` lists them."""
    path = FIXTURES / where
    try:
        with ckpttool.open(path, view=WEIGHTS_VIEW) as named:
            expected = named.keys()
    except CkptError as error:
        with pytest.raises(type(error)):
            ckpttool.open(path)
        return
    with ckpttool.open(path) as default:
        assert default.keys() == expected
    with ckpttool.open(path, view=FILES_VIEW) as files:
        assert "view" not in files.checkpoint.details
        assert any(key.startswith("model_states.") for key in files.keys())  # noqa: SIM118 - like safe_open
