"""The learning rate DeepSpeed's built-in warmup schedules give at a step (for ``rescale-step``).

A resumed DeepSpeed run takes its first step with the learning rate saved in the optimizer's
``param_groups`` (the scheduler only sets it again after that step). When ``rescale-step``
moves the scheduler to another step, that saved rate belongs to the old position; for
``WarmupLR`` and ``WarmupDecayLR`` (``deepspeed/runtime/lr_schedules.py``, 0.19.8) the rate at
the new position is computed here with DeepSpeed's own formula, operation for operation, so the
resumed run's first step uses the same float a native run would. Other schedules return None.
"""

from __future__ import annotations

import math
from typing import Any

WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"


def scheduled_lr(ds_config: Any, last_batch_iteration: int) -> float | None:
    """The rate DeepSpeed's ``WarmupLR``/``WarmupDecayLR`` from ``ds_config`` sets after
    ``last_batch_iteration``; None for any other (or a per-group) schedule."""
    if not isinstance(ds_config, dict) or last_batch_iteration < 0:
        return None
    scheduler = ds_config.get("scheduler")
    if not isinstance(scheduler, dict) or scheduler.get("type") not in (WARMUP_LR, WARMUP_DECAY_LR):
        return None
    params = scheduler.get("params") or {}
    min_lr = params.get("warmup_min_lr", 0.0)
    max_lr = params.get("warmup_max_lr", 0.001 if scheduler["type"] == WARMUP_DECAY_LR else None)
    if max_lr is None:  # WarmupLR: the optimizer's own rate
        max_lr = ((ds_config.get("optimizer") or {}).get("params") or {}).get("lr")
    steps = params.get("warmup_num_steps", 1000)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (min_lr, max_lr)):
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        return None
    steps = max(2, steps)
    kind = params.get("warmup_type", "log")
    if kind not in ("log", "linear"):
        kind = "log"
    if last_batch_iteration < steps:
        if kind == "log":
            gamma = 1.0 / math.log(steps) * math.log(last_batch_iteration + 1)
        else:
            gamma = last_batch_iteration / steps
    elif scheduler["type"] == WARMUP_DECAY_LR:
        total = params.get("total_num_steps")
        if isinstance(total, bool) or not isinstance(total, int):
            return None
        gamma = max(0.0, float(total - last_batch_iteration) / float(max(1.0, total - steps)))
    else:
        gamma = 1.0
    return float(min_lr + ((max_lr - min_lr) * gamma))
