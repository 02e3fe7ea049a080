"""The DeepSpeed fixtures are what manifest.json says: their files, and what DeepSpeed's own
loaders (``torch.load`` of each rank file, ``get_fp32_state_dict_from_zero_checkpoint``) see in
them, recomputed live with the installed DeepSpeed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.fixtures.deepspeed.generate import (
    CASES,
    DAMAGED,
    DAMAGES,
    DEEPSPEED_DIR,
    MANIFEST,
    REPO,
    SAVE_DIR,
    deepspeed_env,
    files_view,
)
from tests.support import timeouts

MANIFEST_DATA = json.loads(MANIFEST.read_text())


def test_manifest_covers_every_case_and_damage() -> None:
    assert list(MANIFEST_DATA["cases"]) == [case.name for case in CASES]
    assert list(MANIFEST_DATA[DAMAGED]) == [damage.name for damage in DAMAGES]
    assert MANIFEST_DATA["versions"]["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("case", [case.name for case in CASES])
def test_case_files_are_the_committed_ones(case: str) -> None:
    assert files_view(DEEPSPEED_DIR / case) == MANIFEST_DATA["cases"][case]["files"]


@pytest.mark.parametrize("damage", [damage.name for damage in DAMAGES])
def test_damaged_files_are_the_committed_ones(damage: str) -> None:
    directory = DEEPSPEED_DIR / DAMAGED / damage
    assert files_view(directory) == MANIFEST_DATA[DAMAGED][damage]["files"]


@pytest.mark.parametrize("case", [case for case in CASES if case.stage > 0], ids=lambda c: c.name)
def test_zero_to_fp32_rebuilds_every_trained_parameter(case) -> None:  # type: ignore[no-untyped-def]
    """The frozen manifest: DeepSpeed's consolidation of the latest tag gives every parameter
    named in ``param_shapes`` at its real shape, plus the buffer and the tied name."""
    view = MANIFEST_DATA["cases"][case.name]["deepspeed"]
    assert view["latest"] == "global_step4"
    fp32 = view["fp32_latest"]
    tag = view["tags"]["global_step4"]
    states = next(iter(tag["model_states"].values()))
    for name, shape in states["param_shapes"][0].items():
        assert fp32[name]["shape"] == shape and fp32[name]["dtype"] == "float32"
    assert fp32["head.weight"] == fp32["embed.weight"]  # tied: the same bytes under both names
    assert "position_bias" in fp32
    # ZeRO-1 saves no frozen_param_shapes, so DeepSpeed's own consolidation drops the frozen one
    assert ("frozen_scale" in fp32) == (case.stage >= 2)
    assert states["global_steps"] == 4
    assert states["global_samples"] == 4 * 2 * case.processes
    assert states["dp_world_size"] == case.processes


@pytest.mark.slow
def test_manifest_matches_live_deepspeed(tmp_path: Path) -> None:
    """Recompute the whole manifest with the installed DeepSpeed and compare (``--check``)."""
    env = {
        **os.environ,
        **deepspeed_env(),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
    }
    result = timeouts.run(
        [sys.executable, "-m", "tests.fixtures.deepspeed.generate", "--check"],
        1200,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "manifest up to date" in result.stderr


def test_save_dir_layout() -> None:
    """Every case has ``latest`` and two tags; the damaged copies break what they say."""
    for case in CASES:
        save_dir = DEEPSPEED_DIR / case.name / SAVE_DIR
        assert (save_dir / "latest").read_text() == "global_step4"
        assert sorted(p.name for p in save_dir.iterdir() if p.is_dir()) == [
            "global_step2",
            "global_step4",
        ]
    damaged = DEEPSPEED_DIR / DAMAGED
    assert not (damaged / "latest_missing" / SAVE_DIR / "latest").exists()
    assert (damaged / "latest_dangling" / SAVE_DIR / "latest").read_text() == "global_step9"
    empty = damaged / "optim_empty" / SAVE_DIR / "global_step4"
    assert (empty / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_size == 0
