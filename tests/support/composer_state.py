"""A checkpoint in Composer's layout, built with torch (mosaicml is not installed: every
release pins a torch other than the venv's, ``pip install --dry-run torch==2.13.0 mosaicml``
fails to resolve).

Composer's ``Trainer.save_checkpoint`` (``composer/utils/checkpoint.py``, ``save_checkpoint``)
writes ``{'state': state.state_dict(), 'rng': reproducibility.get_rng_state()}``:

- ``State.state_dict()`` (``composer/core/state.py``): ``model`` (the ``ComposerModel``'s
  ``state_dict()``: a ``ComposerClassifier`` keeps the user's module as ``self.module``, so its
  keys are ``module.*``), ``optimizers`` and ``schedulers`` (``{type(obj).__qualname__:
  obj.state_dict()}``), ``algorithms`` (a list), ``callbacks`` (a dict), ``timestamp``
  (``Timestamp.state_dict()``: counters and ``datetime.timedelta`` wall-clock times),
  ``rank_zero_seed``, ``run_name``, ``integrations``, ``metadata``;
- ``reproducibility.get_rng_state()`` (``composer/utils/reproducibility.py``): one dict per
  rank, ``{'python': random.getstate(), 'numpy': np.random.get_state(), 'torch':
  torch.random.get_rng_state()}`` (plus ``'cuda'`` where CUDA is in use).
"""

from __future__ import annotations

import datetime
import random
from typing import Any

import numpy as np
import torch


class ComposerClassifier(torch.nn.Module):
    """What ``composer.models.ComposerClassifier`` holds: the user's module as ``module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def trained() -> tuple[ComposerClassifier, torch.optim.Optimizer, Any]:
    """A small classifier after one Adam step, with its scheduler."""
    torch.manual_seed(0)
    model = ComposerClassifier(
        torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model.module(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def composer_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """The object Composer's ``save_checkpoint`` pickles, for one rank without CUDA."""
    timestamp = {
        "iteration": 0, "epoch": 1, "batch": 5, "sample": 40, "token": 0,
        "epoch_in_iteration": 1, "batch_in_epoch": 0, "sample_in_epoch": 0, "token_in_epoch": 0,
        "total_wct": datetime.timedelta(seconds=12), "epoch_wct": datetime.timedelta(seconds=2),
        "batch_wct": datetime.timedelta(0),
    }  # fmt: skip
    state = {
        "model": model.state_dict(),
        "optimizers": {type(optimizer).__qualname__: optimizer.state_dict()},
        "schedulers": {type(scheduler).__qualname__: scheduler.state_dict()},
        "algorithms": [],
        "callbacks": {},
        "timestamp": timestamp,
        "rank_zero_seed": 17,
        "run_name": "structure-test",
        "integrations": {},
        "metadata": {},
    }
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.random.get_rng_state(),
    }
    return {"state": state, "rng": [rng]}
