"""DeepSpeed resumes from ckpttool's universal checkpoint on another number of processes.

Each case trains a tiny model with real DeepSpeed (CPU, gloo, under torchrun), saves a ZeRO
checkpoint mid-run and carries on to the end: the reference continuation. ckpttool writes the
mid-run tag as a universal checkpoint (``rescale_directory`` → ``zero_universal``, no DeepSpeed
involved) and a second DeepSpeed run on the other number of processes loads it
(``"load_universal": true``) and trains to the same end, with the same global batches: 2 ranks
x 1 micro-batch per step become 1 rank x 2 (and back). Both end states are consolidated by
DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` and must be equal bit for bit.

The cases: ZeRO-2 fp32 from 2 processes to 1, ZeRO-3 fp32 from 1 to 2, ZeRO-1 bf16 (DeepSpeed's
``BF16_Optimizer``) from 2 to 1.

Why bit for bit is possible here: every value the optimizer sees is the same. Gradients are
averaged over two micro-batches either way, ``(g0 + g1) / 2`` over ranks or ``g0 / 2 + g1 / 2``
by accumulation (DeepSpeed scales the loss by 1 / accumulation; halving is exact in binary and
a sum of two terms does not depend on their order); AdamW's update is elementwise, so how ZeRO
partitions the parameters does not change a bit; gradient clipping (a norm summed in a
partition-dependent order) is off. More than two micro-batches per step (a sum of three terms
depends on its order) or clipping on would need a tolerance. In bf16 the argument also needs
the two gradients summed in the same precision both ways; DeepSpeed 0.19.8 does, and the bf16
case, bit-identical too, guards it.

A third run checks the default rescale (the per-GPU batch kept): resumed on 1 process from the
2-process tag, DeepSpeed starts at ``global_steps x 2``, with the learning rate the schedule has
there and ``global_samples`` as saved.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.commands.rescale.directory import rescale_directory
from tests.support import timeouts
from tests.test_distributed import clean_env, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "deepspeed_resume_worker.py"
SAVE_AT, STEPS = 2, 4
TIMEOUT_S = 1200  # a hang's bound (tests/support/timeouts.py scales it), not a speed limit


def run_deepspeed(nproc: int, *args: object) -> dict[str, Any]:
    """One torchrun of the worker; its counters (the JSON last line)."""
    env = clean_env()
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    env.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "ckpttool-torch-extensions")
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER),
               *map(str, args)]  # fmt: skip
    result = timeouts.run(command, TIMEOUT_S, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def fp32_weights(save_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag))


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(
            a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)
        ), name


@pytest.fixture(scope="module")
def zero2_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """ZeRO-2 on 2 processes x 1 micro-batch: global_step2/ saved, trained on to final/."""
    out = tmp_path_factory.mktemp("zero2") / "ref"
    return out, run_deepspeed(2, "train", out, 2, 1, SAVE_AT, STEPS)


# (stage, dtype, processes x micro-batches per step saved, the same resumed)
CASES = {
    "zero2_fp32_2to1": (2, "fp32", (2, 1), (1, 2)),
    "zero3_fp32_1to2": (3, "fp32", (1, 2), (2, 1)),
    "zero1_bf16_2to1": (1, "bf16", (2, 1), (1, 2)),
}


@pytest.mark.parametrize("case", CASES)
def test_resume_on_other_world_size_equals_reference(
    case: str, zero2_two_ranks: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    stage, dtype, (saved_world, saved_accum), (new_world, new_accum) = CASES[case]
    if case == "zero2_fp32_2to1":  # the module's run, shared with the test below
        reference, ref_counters = zero2_two_ranks
    else:
        reference = tmp_path / "ref"
        ref_counters = run_deepspeed(saved_world, "train", reference, stage, saved_accum,
                                     SAVE_AT, STEPS, dtype)  # fmt: skip
    universal = tmp_path / "universal"
    report = rescale_directory(
        reference / f"global_step{SAVE_AT}", new_world, output=universal, keep_global_batch=True
    )
    assert report.written and report.plan.new_step == SAVE_AT
    assert (universal / "latest_universal").read_text() == f"global_step{SAVE_AT}_universal"
    resumed = tmp_path / "resumed"
    counters = run_deepspeed(new_world, "resume", resumed, stage, new_accum, universal, STEPS,
                             dtype)  # fmt: skip
    assert counters["start"] == SAVE_AT
    for key in ("global_steps", "global_samples", "lr"):
        assert counters[key] == ref_counters[key], key
    assert_bit_equal(fp32_weights(reference, "final"), fp32_weights(resumed, "final"))


def test_resume_with_per_gpu_batch_kept_rescales_counters(
    zero2_two_ranks: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from deepspeed.runtime.lr_schedules import WarmupLR

    reference, _ = zero2_two_ranks
    universal = tmp_path / "universal"
    report = rescale_directory(reference / f"global_step{SAVE_AT}", 1, output=universal)
    assert (report.plan.old_step, report.plan.new_step, report.plan.exact) == (2, 4, True)
    counters = run_deepspeed(1, "resume", tmp_path / "resumed", 2, 1, universal, 6)
    assert counters["start"] == SAVE_AT * 2
    assert counters["samples_at_start"] == SAVE_AT * 2 * 2  # as saved: 2 steps x 2 ranks x 2
    assert counters["global_steps"] == 6
    # the schedule continues where 4 steps of the new run's batches put it
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=2.0**-6,
                        warmup_num_steps=8, warmup_type="linear")  # fmt: skip
    for _ in range(SAVE_AT * 2):
        schedule.step()
    assert counters["lr_at_start"] == schedule.get_lr()[0]
    assert os.path.isfile(
        universal / f"global_step{SAVE_AT}_universal" / "zero" / "optimizer_state.pt"
    )
