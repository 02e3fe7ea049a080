"""torchtitan's ``step-N/`` directories as a :class:`~ckpttool.frameworks.base.Framework`: the
DCP tree with the model's flattened entries gathered under ``model`` and each training state by
its role (files.py), its counters for ``show``, its completeness for ``verify``, and why
``rescale-step`` has nothing to rescale."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import LayoutError
from ckpttool.frameworks.base import Framework, FrameworkDirectory, RunLayout, collection_run
from ckpttool.frameworks.torchtitan import files

if TYPE_CHECKING:
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest


class Torchtitan(Framework):
    name = "torchtitan"
    layouts = (files.TORCHTITAN, files.TORCHTITAN_RUN)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        model = {key: root.pop(key) for key in list(root) if key not in files.PARTS}
        root[files.MODEL] = model
        parts = {key: role for key, role in files.PARTS.items() if key in root}
        found: dict[str, Any] = {"parts": {files.MODEL: "weights", **parts}}
        train_state = root.get("train_state")
        if isinstance(train_state, dict):
            found.update({k: v for k, v in train_state.items() if isinstance(v, int)})
        scheduler = root.get("lr_scheduler")
        if isinstance(scheduler, dict) and isinstance(scheduler.get("last_epoch"), int):
            found["lr_last_epoch"] = scheduler["last_epoch"]
        loader = root.get("dataloader")
        if isinstance(loader, dict) and isinstance(loader.get("world_size"), int):
            found["dp_world_size"] = loader["world_size"]
        details["torchtitan"] = found
        problems: list[str] = []
        if not layout.complete:  # no index: no tree to judge
            return problems
        if not model:
            problems.append("the DCP tree holds no model entries")
        if parts and len(parts) < len(files.PARTS):
            absent = [key for key in files.PARTS if key not in parts]
            problems.append(
                f"a training checkpoint without {', '.join(absent)}: torchtitan's resume loads "
                "every state it registered (unless checkpoint.exclude_from_loading names it)"
            )
        step = found.get("step")
        if isinstance(step, int) and step != layout.details.get("step_directory"):
            problems.append(
                f"train_state.step is {step} but the directory is step-"
                f"{layout.details.get('step_directory')}"
            )
        world = found.get("dp_world_size")
        if isinstance(loader, dict) and isinstance(world, int):
            absent_ranks = [r for r in range(world) if f"dp_rank_{r}" not in loader]
            if absent_ranks:
                problems.append(
                    f"dataloader state missing for dp rank(s) {absent_ranks} of {world}"
                )
        return problems

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        found = details.get("torchtitan")
        if not isinstance(found, dict):
            return []
        counters = [
            f"{label} {found[key]}"
            for key, label in (
                ("step", "step"),
                ("ntokens_seen", "ntokens_seen"),
                ("lr_last_epoch", "lr_scheduler.last_epoch"),
                ("dp_world_size", "dataloader world_size"),
            )
            if key in found
        ]
        parts = found.get("parts", {})
        kind = "training" if len(parts) > 1 else "model only (last_save_model_only)"
        return [
            f"counters:   {', '.join(counters) or 'none'}",
            f"parts:      {', '.join(f'{k} ({v})' for k, v in parts.items())}; {kind}",
        ]

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if "torchtitan" not in details:
            return []
        return [
            "torchtitan: a complete DCP directory; model entries present; a training "
            "checkpoint holds optimizer, lr_scheduler, dataloader and train_state; "
            "train_state.step matches step-N; a dataloader state for every dp rank"
        ]

    def run_layout(self, directory: str) -> RunLayout | None:
        """The ``step-N/`` of a checkpoint folder, by step (resume takes the highest with a
        ``.metadata``: ``_find_load_step``)."""
        return collection_run(files.detect(directory), files.RUN_TITLE)

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        raise LayoutError(
            f"{path}: a torchtitan checkpoint; nothing to rescale: train_state.step and "
            "lr_scheduler.last_epoch count optimizer steps of the global batch (the same on "
            "any number of ranks), and DCP reshards the model and optimizer on load. Its "
            "dataloader state is per data-parallel rank and torchtitan refuses it on another "
            "dp degree ('dataloader resharding is not supported yet'): resume with "
            "checkpoint.exclude_from_loading=['dataloader'] instead"
        )


FRAMEWORK = Torchtitan()
