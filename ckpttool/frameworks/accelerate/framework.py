"""accelerate as a :class:`~ckpttool.frameworks.base.Framework`: ``save_state`` folders
(files.py) and their ``rescale-step`` (rescale.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.frameworks.accelerate import files
from ckpttool.frameworks.base import Framework, FrameworkDirectory

if TYPE_CHECKING:
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest


class Accelerate(Framework):
    name = "accelerate"
    layouts = (files.ACCELERATE,)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        from ckpttool.frameworks.accelerate.rescale import plan_accelerate

        return plan_accelerate(path, request)


FRAMEWORK = Accelerate()
