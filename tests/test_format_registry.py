"""Formats as plug-ins: the registry's list, its sniffing order, its lazy imports, and the
walker's format hook (issue 26)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections import OrderedDict
from typing import Any

from ckpttool.formats import registry
from ckpttool.formats.base import FileFormat
from ckpttool.model.vocabulary import FORMATS
from ckpttool.pickle.hooks import CompactCall
from ckpttool.pickle.interpreter import SafeUnpickler, load_pickle
from tests.support.helpers import FIXTURES


def test_every_format_is_listed_once_by_a_vocabulary_name() -> None:
    ids = [fmt.id for fmt in (*registry.file_formats(), *registry.directory_formats())]
    assert len(ids) == len(set(ids))
    for fmt in (*registry.file_formats(), *registry.directory_formats()):
        assert isinstance(fmt, FileFormat)
        assert fmt.id in fmt.ids and set(fmt.ids) <= set(FORMATS)


def test_formats_are_sniffed_in_torch_loads_order() -> None:
    assert [fmt.id for fmt in registry.file_formats()] == [
        "torch-zip",
        "safetensors",
        "gguf",  # torch.load reads none: its magic is no other format's
        "torch-tar",  # tried before a pickle stream, as torch.load tries them
        "torch-legacy",
    ]


def test_a_format_id_finds_its_format() -> None:
    assert registry.format_by_id("pickle").id == "torch-legacy"  # a bare pickle: its reader's
    assert registry.format_by_id("dcp").id == "dcp"
    assert registry.find_format("directory") is None  # a framework's: no format module


_PROBE = """
import json, sys
from ckpttool.checkpoint import open_checkpoint
with open_checkpoint(sys.argv[1]) as ckpt:
    ckpt.tensors()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("ckpttool.formats"))))
"""


def test_opening_a_zip_imports_no_other_format() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(FIXTURES / "minimind" / "pretrain_32.pth")],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = set(json.loads(result.stdout))
    assert "ckpttool.formats.torch_zip.reader" in loaded  # the positive control
    others = ("dcp", "safetensors_file", "gguf", "torch_legacy", "torch_tar")
    assert not {m for m in loaded for other in others if m.startswith(f"ckpttool.formats.{other}")}


def test_the_walker_hands_a_formats_hook_the_classes_it_asked_for() -> None:
    """The walker names no format: a hook sees the memo GETs of its modules' classes, and one
    that answers None leaves the walk as the general loop makes it."""
    seen: list[tuple[str, int]] = []

    def call(u: Any, raw: bytes, pos: int, cls: Any) -> None:
        seen.append((cls.qualname, pos))
        return None

    hook = CompactCall(frozenset({"collections"}), 1, (), call)
    data = pickle.dumps([OrderedDict(a=1), OrderedDict(b=2)], protocol=2)
    assert SafeUnpickler(data, compact=hook).load().root == load_pickle(data).root
    assert [name for name, _ in seen] == ["collections.OrderedDict"]  # the second: a memo GET
