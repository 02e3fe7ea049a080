"""ultralytics' own model loads what ``ckpttool convert`` writes from ultralytics' checkpoints
(``tests/fixtures/ultralytics/``): a ``DetectionModel`` built by ultralytics 8.4.190 from the
checkpoint's own YAML, zeroed, takes ``convert``'s safetensors with a strict
``load_state_dict``, and then holds exactly the tensors ultralytics' own ``torch_load`` of the
checkpoint gives (names in order, dtypes, bytes).

ultralytics runs in a process of its own, from ``.ultralytics-site`` beside the venv (the pins
in ``tests/fixtures/ultralytics/requirements.txt``, installed by README's test commands and
``.ci/run``; ``CKPTTOOL_ULTRALYTICS_SITE`` names another folder): its torchvision pin is a CUDA
build that cannot be imported with the CPU torch of the venv, so it never goes into the venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

HERE = FIXTURES / "ultralytics"
REPOSITORY = Path(__file__).resolve().parents[1]
REQUIREMENTS = HERE / "requirements.txt"
SITE = Path(os.environ.get("CKPTTOOL_ULTRALYTICS_SITE", REPOSITORY / ".ultralytics-site"))
#: (file, the part holding the module): as tests/test_ultralytics_fixture.py.
PARTS = [("last.pt", "ema"), ("best.pt", "model")]

#: Run by the site's ultralytics: argv = [[checkpoint, part, converted safetensors], ...] (JSON).
ROUND_TRIP = """
import json, sys
import torch
import ultralytics
from safetensors.torch import load_file
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils.patches import torch_load

assert ultralytics.__version__ == "8.4.190", ultralytics.__version__
report = {}
for checkpoint, part, converted in json.loads(sys.argv[1]):
    theirs = torch_load(checkpoint, map_location="cpu", weights_only=False)[part]
    reference = theirs.state_dict()
    dtype = next(t.dtype for t in reference.values() if t.is_floating_point())
    model = DetectionModel(cfg=theirs.yaml, verbose=False).to(dtype)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    model.load_state_dict(load_file(converted), strict=True)
    mine = model.state_dict()
    assert list(mine) == list(reference), "the names or their order differ"
    differ = [
        key for key, tensor in reference.items()
        if mine[key].dtype != tensor.dtype or mine[key].shape != tensor.shape
        or not torch.equal(mine[key].contiguous().view(-1).view(torch.uint8),
                           tensor.contiguous().view(-1).view(torch.uint8))
    ]
    assert not differ, differ[:5]
    report[checkpoint] = len(reference)
print(json.dumps(report))
"""


def _site() -> Path:
    if not (SITE / "ultralytics").is_dir():
        pytest.fail(
            f"no ultralytics in {SITE}: install it beside the venv (README.md's test commands): "
            f"pip install --no-deps --target {SITE} -r {REQUIREMENTS.relative_to(REPOSITORY)}"
        )
    return SITE


def test_ultralytics_loads_convert_s_output_strictly(tmp_path: Path) -> None:
    site = _site()
    jobs = []
    for name, part in PARTS:
        out = tmp_path / f"{name}.safetensors"
        result = CliRunner().invoke(cli, ["convert", str(HERE / name), str(out)])
        assert result.exit_code == 0, result.output
        jobs.append([str(HERE / name), part, str(out)])
    env = {**os.environ, "PYTHONPATH": str(site), "YOLO_OFFLINE": "1",
           "YOLO_CONFIG_DIR": str(tmp_path / "yolo")}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, json.dumps(jobs)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {job[0]: 355 for job in jobs}


def test_the_site_s_pins_are_the_fixture_extra_s() -> None:
    """requirements.txt installs what wrote the fixtures (pyproject's ultralytics-fixture)."""
    pinned = {
        line.strip() for line in REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }  # fmt: skip
    extra = (REPOSITORY / "pyproject.toml").read_text().split("ultralytics-fixture = [", 1)[1]
    extra = extra.split("]", 1)[0]
    assert all(f'"{pin}"' in extra for pin in pinned), pinned
    assert {p.split("==")[0] for p in pinned} == {"ultralytics", "torchvision", "opencv-python"}
