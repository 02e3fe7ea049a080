"""``rescale-step`` of a Lightning sharded checkpoint: ``meta.pt``'s ``global_step``, only when
named, as for a Lightning ``.ckpt``.

Lightning's ``global_step`` counts optimizer steps, not dataloader batches per rank, so
rescaling it for another number of processes is not the right repair by default: it is refused
unless ``--step-key global_step`` names it. Then ``meta.pt`` gets the new ``global_step``,
``world_size`` and ckpttool's ``rescaled_from`` history (as a ``.ckpt`` file does); the saved
world size is ``--from-world-size``, else ``meta.pt``'s ``world_size`` from an earlier rescale,
else the number of ranks that wrote DCP data files (one ``__<rank>_0.distcp`` each). The DCP
files are copied byte for byte: DCP reshards on load, whatever the number of ranks.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.errors import LayoutError
from ckpttool.frameworks.base import FrameworkDirectory
from ckpttool.frameworks.lightning_sharded.files import LIGHTNING_SHARDED, META
from ckpttool.frameworks.rescale import top_level
from ckpttool.model.rescaling import (
    COPY,
    REWRITE,
    DirectoryPlan,
    FileAction,
    RescaleRequest,
    ValueChange,
    counter_plan,
)

STEP_KEY = "global_step"
WORLD_SIZE_KEY = "world_size"
HISTORY_KEY = "rescaled_from"  # as commands.rescale.run.HISTORY_KEY writes it in a file


def plan_lightning_sharded(
    path: Path, layout: FrameworkDirectory, request: RescaleRequest
) -> DirectoryPlan:
    if request.step_key is None:
        raise LayoutError(
            f"{path}: a Lightning sharded checkpoint; its global_step counts optimizer steps, "
            "not dataloader batches per rank, so rescaling it is not the right repair by "
            "default. If you know it should scale with the number of GPUs, name it: "
            "--step-key global_step"
        )
    meta = top_level(path / META)
    old = meta.get(STEP_KEY)
    if isinstance(old, bool) or not isinstance(old, int):
        raise LayoutError(f"{path / META}: no integer {STEP_KEY} to rescale")
    recorded = meta.get(WORLD_SIZE_KEY)
    ranks = layout.details.get("ranks")
    if request.from_world_size is not None:
        saved = request.from_world_size
    elif isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        saved = recorded
    elif isinstance(ranks, int):
        saved = ranks
    else:
        raise LayoutError(
            f"{path}: no DCP data file says how many ranks saved it; pass --from-world-size M"
        )
    plan = counter_plan(STEP_KEY, old, saved, request.world_size, request.strict)
    history = meta.get(HISTORY_KEY, [])
    if not isinstance(history, list):
        raise LayoutError(f"{path / META}: {HISTORY_KEY!r} is not ckpttool's history list")
    new = {
        STEP_KEY: plan.new_step,
        WORLD_SIZE_KEY: request.world_size,
        HISTORY_KEY: [*history, {STEP_KEY: old, WORLD_SIZE_KEY: saved}],
    }
    changed = plan.new_step != old or recorded != request.world_size
    actions = [
        FileAction(m.name, m.name, REWRITE, new, "global_step named by --step-key")
        if m.name == META and changed
        else FileAction(m.name, m.name, COPY)
        for m in layout.members
    ]
    changes = [ValueChange(META, STEP_KEY, old, plan.new_step)] if plan.new_step != old else []
    notes = [
        "meta.pt's loops keep their progress counters: Lightning restores trainer.global_step "
        "from fit_loop's optimizer progress, not from the top-level global_step",
        "the DCP files are copied: torch.distributed.checkpoint reshards them on load",
    ]
    return DirectoryPlan(LIGHTNING_SHARDED, plan, actions, changes, notes)
