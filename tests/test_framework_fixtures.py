"""The framework-written fixtures hold what tests/fixtures/frameworks/manifest.json says.

The file half of the manifest is checked with torch, safetensors and json alone, so it always
runs. The framework half is recomputed by the frameworks' own loaders (``from_pretrained``,
Trainer's resume reads, accelerate's ``load_state``, Lightning's ``load_from_checkpoint``) in a
subprocess, for every case whose framework is importable; the ``frameworks`` extra installs them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.frameworks.generate import CASE_BY_NAME, FRAMEWORKS_DIR, REPO, differences
from tests.fixtures.frameworks.manifest_files import describe_case_files
from tests.support import timeouts

MANIFEST: dict[str, Any] = json.loads((FRAMEWORKS_DIR / "manifest.json").read_text())
CASES = sorted(CASE_BY_NAME)
SIZE_BUDGET = 3_800_000  # bytes of committed fixtures, manifest included (DCP items ~2 kB each; Megatron 0.4 MB)
GENERATOR_SOURCES = {".py", ".pyc", ".md"}
PACKAGES = {
    "transformers": "transformers",
    "accelerate": "accelerate",
    "pytorch_lightning": "pytorch-lightning",
    "peft": "peft",
    "megatron.core": "megatron-core",
}


def committed_fixture_files() -> list[Path]:
    return sorted(
        p
        for p in FRAMEWORKS_DIR.rglob("*")
        if p.is_file() and p.suffix not in GENERATOR_SOURCES and "__pycache__" not in p.parts
    )


def version_mismatch(case: str) -> str | None:
    """Why the installed frameworks cannot stand for the ones that computed the manifest."""
    for module in CASE_BY_NAME[case].needs:
        package = PACKAGES[module]
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed"
        installed, pinned = version(package), MANIFEST["versions"][package]
        if installed != pinned:
            return f"{package} {installed} is installed; the manifest was computed with {pinned}"
    return None


def test_the_manifest_has_every_case() -> None:
    assert sorted(MANIFEST["cases"]) == CASES


def test_every_committed_file_is_in_the_manifest() -> None:
    listed = {name for case in MANIFEST["cases"].values() for name in case["files"]}
    committed = {p.relative_to(FRAMEWORKS_DIR).as_posix() for p in committed_fixture_files()}
    assert committed - {"manifest.json"} == listed


def test_the_fixtures_stay_small() -> None:
    assert sum(p.stat().st_size for p in committed_fixture_files()) < SIZE_BUDGET


@pytest.mark.parametrize("case", CASES)
def test_files_hold_what_the_manifest_says(case: str) -> None:
    """Sizes, digests, tensors (keys, dtypes, shapes, value digests), pickle globals and the
    plain values of every file, read by torch, safetensors and json alone."""
    fresh = json.loads(json.dumps(describe_case_files(FRAMEWORKS_DIR, case)))
    assert differences(MANIFEST["cases"][case]["files"], fresh) == []


@pytest.fixture(scope="module")
def framework_manifest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The manifest recomputed by the installed frameworks, for the cases they can load. One
    subprocess: accelerate's view changes process-global state (AcceleratorState, RNGs)."""
    cases = [case for case in CASES if version_mismatch(case) is None]
    output = tmp_path_factory.mktemp("framework_manifest") / "manifest.json"
    command = [sys.executable, "-m", "tests.fixtures.frameworks.generate", "--manifest"]
    command += ["--output", str(output), *(f"--case={case}" for case in cases)]
    result = timeouts.run(command, 1200, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    recomputed: dict[str, Any] = json.loads(output.read_text())
    return recomputed


@pytest.mark.slow  # a subprocess importing transformers, accelerate and Lightning
@pytest.mark.parametrize("case", CASES)
def test_frameworks_load_what_the_manifest_says(
    case: str, framework_manifest: dict[str, Any]
) -> None:
    reason = version_mismatch(case)
    if reason:
        pytest.skip(f"{reason} (pip install torch==2.13.0 -e '.[test,frameworks]')")
    expected = MANIFEST["cases"][case]["framework"]
    assert differences(expected, framework_manifest["cases"][case]["framework"]) == []
