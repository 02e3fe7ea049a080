"""The memory bound of average and merge (docs/average.md, docs/merge.md): 4 inputs holding one
64 MiB float32 tensor each, combined in a fresh process whose peak NumPy and Python allocations
are traced (tracemalloc: numpy reports its buffers to it), against each method's bound in
float64 copies of the tensor (``E`` = 128 MiB here) with a margin. Loading the inputs, as
fairseq's script and mergekit do, would hold 4 x 64 MiB before any arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

NUMEL = 16 << 20  # 64 MiB of float32
E = NUMEL * 8  # one float64 copy
INPUTS = 4
ROOT = Path(__file__).resolve().parents[1]

#: What the combination step measured holds, in E: the float64 sum, one input's tensor as read
#: (E/2), the rounded output (E/2) and the cast's chunk temporaries; task arithmetic adds the
#: base; TIES holds the base and the 3 models as read (E/2 each), a bool mask of each model's
#: kept entries (E/8 each) and the magnitudes (then the result): 3.375 E.
BOUNDS = {
    "average": 2.25,
    "linear": 2.25,
    "task-arithmetic": 3.25,
    "slerp": 2.25,  # 2 inputs: the result, both inputs as read
    "ties": 0.5 * INPUTS + (INPUTS - 1) / 8 + 1,
}
MARGIN = 1.1

SCRIPT = """
import json, sys, tracemalloc
from pathlib import Path
from ckpttool.commands.average import average
from ckpttool.commands.merge import merge

method, out, *paths = sys.argv[1:]
tracemalloc.start()
if method == "average":
    average(paths, out)
elif method == "slerp":
    merge(paths[0], paths[1:2], out, method="slerp", t=0.3)
else:
    merge(paths[0], paths[1:], out, method=method, density=0.5 if method == "ties" else 1.0)
print(json.dumps({"peak": tracemalloc.get_traced_memory()[1]}))
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    directory = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    paths = []
    for index in range(INPUTS):
        paths.append(directory / f"in_{index}.safetensors")
        values = rng.standard_normal(NUMEL, dtype=np.float32)
        save_file({"big": values, "norm": values[:16].copy()}, str(paths[-1]))
    return paths


@pytest.mark.parametrize("method", list(BOUNDS))
def test_the_peak_memory_of_a_combination_is_its_bound(
    tmp_path: Path, inputs: list[Path], method: str
) -> None:
    out = tmp_path / "out.safetensors"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, method, str(out), *map(str, inputs)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    peak = json.loads(done.stdout)["peak"]
    assert out.stat().st_size > NUMEL * 4  # the tensor was written
    assert peak <= BOUNDS[method] * E * MARGIN, f"{method}: {peak / E:.2f} E"
    # and never the inputs loaded whole, as a float64 stack of them would be
    assert peak < INPUTS * E if method != "ties" else peak < (INPUTS + 3.5) * E
