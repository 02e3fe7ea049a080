"""accelerate as a :class:`~ckpttool.frameworks.base.Framework`: ``save_state`` folders
(files.py) and their ``rescale-step`` (rescale.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.frameworks.accelerate import files
from ckpttool.frameworks.base import (
    OPTIMIZER,
    RNG,
    SAMPLER,
    SCALER,
    SCHEDULER,
    Framework,
    FrameworkDirectory,
)

if TYPE_CHECKING:
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest


#: The members of a ``save_state`` folder that ``edit --for-inference`` leaves out: what only
#: ``load_state`` into a prepared optimizer, scheduler, scaler or dataloader reads. The
#: registered objects (``custom_checkpoint_N.pkl``) stay: they can be anything the script
#: registered (an EMA of the model as well as a step counter), and ``load_state`` wants one
#: file for each object registered.
TRAINING_ROLES = (OPTIMIZER, SCHEDULER, SCALER, RNG, SAMPLER)


class Accelerate(Framework):
    name = "accelerate"
    layouts = (files.ACCELERATE,)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def edit_leaves_out(
        self, layout: FrameworkDirectory, *, for_inference: bool
    ) -> tuple[str, ...]:
        if not for_inference:
            return ()
        return tuple(m.name for m in layout.members if m.role in TRAINING_ROLES)

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        from ckpttool.frameworks.accelerate.rescale import plan_accelerate

        return plan_accelerate(path, request)


FRAMEWORK = Accelerate()
