"""Lightning's sharded checkpoints as a :class:`~ckpttool.frameworks.base.Framework`: the DCP
tree and ``meta.pt`` merged as Lightning's consolidation merges them (files.py), their counters
for ``show``, and ``rescale-step`` (rescale.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.frameworks.base import Framework, FrameworkDirectory
from ckpttool.frameworks.lightning_sharded import files

if TYPE_CHECKING:
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest

#: meta.pt's counters shown in the header, in order.
COUNTERS = ("global_step", "epoch")
VERSION_KEY = "pytorch-lightning_version"


class LightningSharded(Framework):
    name = "lightning_sharded"
    layouts = (files.LIGHTNING_SHARDED,)
    rescale_step_keys = ("global_step",)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        found: dict[str, Any] = {}
        for key in (*COUNTERS, VERSION_KEY):
            value = root.get(key)
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                found[key] = value
        optimizers = sorted(
            (key for key in root if isinstance(key, str) and files.OPTIMIZER_KEY.match(key)),
            key=lambda key: int(key.rpartition("_")[2]),
        )
        details["lightning"] = {**found, "optimizers": optimizers}
        problems = []
        if layout.complete and files.MODEL_KEY not in root:
            problems.append(
                f"the DCP tree holds no {files.MODEL_KEY!r}: Lightning's load_checkpoint reads "
                "the model's state dict from it"
            )
        expected = [f"optimizer_{i}" for i in range(len(optimizers))]
        if optimizers != expected:
            problems.append(
                f"optimizer states {', '.join(optimizers)} are not numbered 0..N-1: Lightning "
                "restores optimizer_<i> for its i-th optimizer"
            )
        if "state_dict" in root:
            problems.append(
                "meta.pt holds a 'state_dict' too: Lightning moves the weights into the DCP tree"
            )
        return problems

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        found = details.get("lightning")
        if not isinstance(found, dict):
            return []
        counters = ", ".join(f"{key} {found[key]}" for key in COUNTERS if key in found)
        optimizers = ", ".join(found.get("optimizers", [])) or "none"
        lines = [f"counters:   {counters or 'none'} (meta.pt)"]
        if VERSION_KEY in found:
            lines.append(f"lightning:  {found[VERSION_KEY]}")
        lines.append(f"DCP tree:   model, {optimizers} (optimizer_<i> is optimizer_states[i])")
        return lines

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if "lightning" not in details:
            return []
        return [
            "Lightning sharded: meta.pt beside a complete DCP directory (.metadata and every "
            "data file it names, each item's bytes in range); the DCP tree holds 'model' and "
            "optimizer_0..N-1"
        ]

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        from ckpttool.frameworks.lightning_sharded.rescale import plan_lightning_sharded

        return plan_lightning_sharded(path, layout, request)


FRAMEWORK = LightningSharded()
