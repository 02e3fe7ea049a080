"""torchtune's checkpoints as a :class:`~ckpttool.frameworks.base.Framework`: each file by its
role (files.py), the epoch and the recipe state's counters for ``show``, and why
``rescale-step`` has nothing to rescale."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import LayoutError
from ckpttool.frameworks.base import Framework, FrameworkDirectory, RunLayout, collection_run
from ckpttool.frameworks.torchtune import files

if TYPE_CHECKING:
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest


class Torchtune(Framework):
    name = "torchtune"
    layouts = (files.TORCHTUNE, files.TORCHTUNE_RUN)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        found = dict(details.get("torchtune", {}))
        recipe = root.get("recipe_state")
        if isinstance(recipe, dict):
            found.update({k: recipe[k] for k in files.RECIPE_COUNTERS if k in recipe})
        elif isinstance(layout.found, str):  # 0.4+: the run directory's, outside epoch_N/
            read = files.read_recipe_state(layout.found)
            found.update({k: read[k] for k in files.RECIPE_COUNTERS if k in read})
            found["recipe_optimizer"] = read.get("optimizer", False)
        found["parts"] = {m.name: m.section or m.role for m in layout.members if m.role != "other"}
        details["torchtune"] = found
        problems = []
        runs = found.get("epochs_run")
        if isinstance(runs, int) and runs != found.get("epoch", -1) + 1:
            problems.append(
                f"recipe_state.pt says epochs_run {runs}, but the weights are epoch "
                f"{found.get('epoch')}'s: torchtune resumes at epoch {runs}"
            )
        return problems

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        found = details.get("torchtune")
        if not isinstance(found, dict):
            return []
        counters = ", ".join(
            f"{key} {found[key]}" for key in ("epoch", *files.RECIPE_COUNTERS) if key in found
        )
        lines = [f"counters:   {counters} ({found.get('layout')})"]
        if "recipe_state" in found and isinstance(found["recipe_state"], str):
            optimizer = found.get("recipe_optimizer")
            held = (
                ""
                if optimizer is None
                else "; optimizer state: " + ("present" if optimizer else "absent")
            )
            lines.append(f"resume:     {found['recipe_state']}{held}")
        return lines  # each file's part is in the file list above

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if "torchtune" not in details:
            return []
        return [
            "torchtune: every model-NNNNN-of-MMMMM shard present, and every file its index "
            "lists; recipe_state's epochs_run "
            "follows the epoch of the weights beside it"
        ]

    def run_layout(self, directory: str) -> RunLayout | None:
        """The ``epoch_N/`` of an output directory, by epoch."""
        return collection_run(files.detect(directory), files.RUN_TITLE)

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        raise LayoutError(
            f"{path}: a torchtune checkpoint; nothing to rescale: torchtune resumes at an epoch "
            "boundary (recipe_state's epochs_run counts epochs) and recomputes its step from "
            "epochs_run and the steps per epoch of the new run, whatever the number of ranks"
        )


FRAMEWORK = Torchtune()
