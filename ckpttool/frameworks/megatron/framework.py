"""Megatron-LM checkpoints as a :class:`~ckpttool.frameworks.base.Framework`: which folders
are Megatron's (files.py), a ``torch_dist`` folder read with its layers unstacked (dist.py),
a legacy folder's ``mp_rank`` shards merged (legacy.py), and what ``show`` and ``verify``
print of them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import LayoutError
from ckpttool.frameworks.base import Framework, FrameworkDirectory
from ckpttool.frameworks.megatron import files

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest


class Megatron(Framework):
    name = "megatron"
    layouts = (files.TORCH_DIST, files.LEGACY)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def open_directory(
        self, layout: FrameworkDirectory, *, strict: bool, refuse_dangerous: bool
    ) -> Checkpoint | None:
        if layout.kind == files.TORCH_DIST:
            from ckpttool.frameworks.megatron.dist import open_torch_dist

            return open_torch_dist(layout, strict=strict, refuse_dangerous=refuse_dangerous)
        from ckpttool.frameworks.megatron.legacy import open_legacy

        return open_legacy(layout, strict=strict, refuse_dangerous=refuse_dangerous)

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        summary = details.get("megatron")
        if not isinstance(summary, dict):
            return []
        lines = [f"iteration:  {summary.get('iteration')} (from {summary.get('iteration_from')})"]
        if details.get("tracker"):
            lines.append(f"tracker:    {files.TRACKER} names {details['tracker']}")
        for title, part in (("parallel", "parallel"), ("model", "model_args"),
                            ("counters", "counters")):  # fmt: skip
            values = summary.get(part) or {}
            if values:
                lines.append(
                    f"{title + ':':<11} " + ", ".join(f"{k}={v}" for k, v in values.items())
                )
        for entry in summary.get("stacked", []):
            lines.append(
                f"stacked:    {entry['key']} {entry['shape']} -> {entry['as']} "
                f"(N = 0..{entry['layers'] - 1})"
            )
        for entry in summary.get("merged", []):
            lines.append(f"merged:     {entry}")
        for note in summary.get("notes", []):
            lines.append(f"note:       {note}")
        return lines

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        """Refused, with Megatron's reason: its counters do not depend on the world size."""
        raise LayoutError(
            f"{path}: a {layout.title}; Megatron resumes at any data-parallel size without "
            "rescaling: args.global_batch_size stays fixed (micro-batches are accumulated up "
            "to it), iteration counts optimizer steps of that global batch, and the data "
            "sampler skips args.consumed_train_samples samples whatever the world size. To "
            "change the global batch, pass Megatron --global-batch-size (or "
            "--rampup-batch-size) on resume: nothing in the checkpoint needs rewriting"
        )

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if details.get("layout") == files.TORCH_DIST:
            return [
                "Megatron torch_dist: metadata.json names the torch_dist backend; .metadata and "
                "common.pt present; every chunk's bytes in its .distcp file; each stacked layer "
                "tensor has num_layers rows"
            ]
        if details.get("layout") == files.LEGACY:
            return [
                "Megatron legacy: an mp_rank folder with model_optim_rng.pt for every (tensor, "
                "pipeline) rank; tensor-parallel shards tile each tensor along its dimension "
                "(column-parallel 0, row-parallel 1); replicated tensors equal across tensor "
                "ranks; every shard from the same iteration"
            ]
        return []


FRAMEWORK = Megatron()
