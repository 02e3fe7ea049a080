"""What `ckpttool show` imports: start-up is most of its run time, so the import chain is a contract.

Listing a 1.4 GB resume file takes about a tenth of a second, and most of that is Python
starting and importing click and tabulate; one stray top-level import (torch: seconds; NumPy:
a quarter of a second; ``importlib.metadata``, which tabulate 0.10 pulls in: a third of the
run) costs more than reading the file. These tests run the real command in a fresh interpreter
and check which modules it loaded. Each has a positive control: the same probe sees the module
when the command does need it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import FIXTURES

# Runs the CLI in-process in a fresh interpreter, then reports the modules it imported (those
# loaded at start-up, e.g. by an editable install's import hook, are not the command's doing).
_PROBE = """
import sys
before = set(sys.modules)
import json
from ckpttool.cli import main
sys.argv = ["ckpttool", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exit:
    code = exit.code
else:
    code = 0
sys.stdout.flush()
print("\\n" + json.dumps({"exit": code, "modules": sorted(set(sys.modules) - before)}))
"""

NOT_FOR_LISTING = [
    "torch",
    "numpy",
    "importlib.metadata",  # tabulate 0.10 imports it (pyproject pins tabulate<0.10)
    "email",
    "pathlib",  # the reader works on str paths; Checkpoint.path builds a Path on demand
    "zipfile",  # formats.zip_index reads the directory: zipfile imports bz2, lzma, shutil
    "ckpttool.io.values",
    "ckpttool.formats.dcp",
    "ckpttool.commands.diff",
    "ckpttool.commands.convert",
    "ckpttool.commands.rescale",
    "ckpttool.train",
    "ckpttool.io.remote",  # URLs only (issue 17): the HTTP client, threads, fsspec
    "http.client",
    "fsspec",
    "aiohttp",
    "botocore",
]


def _modules_after(*args: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(args))],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["exit"] == 0, result.stderr
    return set(report["modules"])


@pytest.mark.parametrize(
    "fixture",
    [
        "minimind/pretrain_32_resume.pth",
        "minimind/pretrain_32.pth",
        "safetensors/model.safetensors",
        "legacy/resume_bigkeys.pth",
    ],
)
def test_show_imports_only_what_listing_needs(fixture: str) -> None:
    modules = _modules_after("show", str(FIXTURES / fixture))
    assert (
        "ckpttool.render.show" in modules and "ckpttool.checkpoint" in modules
    )  # the probe saw it
    # a table of printable ASCII is written without tabulate (render.text.table)
    assert "tabulate" not in modules
    assert sorted(modules & set(NOT_FOR_LISTING)) == []


def test_show_json_does_not_need_tabulate() -> None:
    modules = _modules_after("show", "--json", str(FIXTURES / "minimind/pretrain_32.pth"))
    assert "ckpttool.checkpoint" in modules
    assert "tabulate" not in modules
    assert sorted(modules & set(NOT_FOR_LISTING)) == []


def test_probe_sees_what_stats_and_dcp_do_import(tmp_path: Path) -> None:
    """Positive controls: values are read with NumPy; a DCP directory needs the DCP reader."""
    stats = _modules_after("show", "--stats", str(FIXTURES / "minimind/pretrain_32.pth"))
    assert {"numpy", "ckpttool.io.values"} <= stats
    dcp_dirs = sorted(p.parent for p in FIXTURES.glob("dcp/*/.metadata"))
    assert dcp_dirs, "no DCP fixture"
    assert "ckpttool.formats.dcp" in _modules_after("show", str(dcp_dirs[0]))


def test_probe_sees_what_a_url_imports() -> None:
    """Positive control for the remote modules: an http URL loads the HTTP client, and still
    not fsspec (http(s) and hf:// are read with the standard library)."""
    from tests.support.range_server import RangeServer

    server = RangeServer().start()
    try:
        url = server.add("pretrain_32.pth", (FIXTURES / "minimind/pretrain_32.pth").read_bytes())
        modules = _modules_after("show", url)
    finally:
        server.stop()
    assert {"ckpttool.io.remote", "http.client"} <= modules
    assert "fsspec" not in modules and "torch" not in modules


def test_dir_lists_the_lazy_public_names_without_importing_them() -> None:
    """``dir(ckpttool)`` (tab completion) shows every public name, the lazy ones too, and
    listing them imports none of their modules."""
    code = (
        "import json, sys, ckpttool\n"
        "names = dir(ckpttool)\n"
        "print(json.dumps({'names': names, 'all': ckpttool.__all__, 'loaded': sorted("
        "m for m in ('torch', 'ckpttool.train', 'ckpttool.checkpoint', 'ckpttool.commands.rescale', "
        "'ckpttool.io.atomic', 'ckpttool.model.records') if m in sys.modules)}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    report = json.loads(result.stdout)
    assert set(report["all"]) <= set(report["names"])
    assert report["names"] == sorted(report["names"])
    assert report["loaded"] == []


def test_convert_without_a_cast_does_not_import_numpy(tmp_path: Path) -> None:
    """NumPy's import is a tenth of converting the MiniMind-768 fp16 file (bench/README.md,
    "Near the floors"): only a cast needs it. Positive control: ``--dtype bf16`` does."""
    source = str(FIXTURES / "minimind/pretrain_32.pth")
    plain = _modules_after("convert", source, str(tmp_path / "plain.safetensors"))
    assert "ckpttool.commands.convert.run" in plain
    assert "numpy" not in plain
    cast = _modules_after("convert", source, str(tmp_path / "bf16.safetensors"), "--dtype", "bf16")
    assert "numpy" in cast
