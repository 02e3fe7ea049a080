"""DeepSpeed as a :class:`~ckpttool.frameworks.base.Framework`: ZeRO save and tag directories
(files.py), what ``show`` reads out of them (checks.py, show.py), their consolidated fp32
weights as the ``weights`` view (consolidate.py), and ``rescale-step`` as a universal
checkpoint (universal.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import InputError, NotZeroError
from ckpttool.frameworks.base import (
    WEIGHTS_VIEW,
    Framework,
    FrameworkDirectory,
    Placeholders,
    RunLayout,
)
from ckpttool.frameworks.deepspeed import files
from ckpttool.model.roles import DEEPSPEED

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint
    from ckpttool.model.rescaling import DirectoryRescaleReport, RescaleRequest


class DeepSpeed(Framework):
    name = DEEPSPEED
    layouts = (DEEPSPEED,)
    views = (WEIGHTS_VIEW,)
    # ZeRO-1/2 keep the fp32 master weights in the optimizer states, ZeRO-3 only placeholders in
    # the model states: the model's tensors are the consolidated ones (zero_to_fp32's)
    default_view = WEIGHTS_VIEW
    rescales_itself = True

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def open_view(self, layout: FrameworkDirectory, view: str) -> Checkpoint | None:
        """The fp32 master weights, consolidated from every rank's optimizer states; None for
        ZeRO-0 (nothing is partitioned: the files as stored hold the weights as they are)."""
        from ckpttool.frameworks.deepspeed.consolidate import find_tag, open_zero_weights

        try:
            tag = find_tag(layout.directory, layout.found)
        except NotZeroError:
            return None
        return open_zero_weights(layout.directory, tag)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        from ckpttool.frameworks.deepspeed.checks import summarize

        summary, problems = summarize(root, details)
        details[DEEPSPEED] = summary
        return problems

    def file_placeholders(self, root: Any, path: str) -> Placeholders | None:
        from ckpttool.frameworks.deepspeed.checks import placeholders

        return placeholders(root, path)

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        from ckpttool.frameworks.deepspeed.show import deepspeed_lines

        return deepspeed_lines(details)

    def show_table(self, details: dict[str, Any]) -> list[list[Any]]:
        from ckpttool.frameworks.deepspeed.show import parameter_table

        return parameter_table(details)

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if DEEPSPEED not in details:  # check_tree did not run
            return []
        return [
            "DeepSpeed: latest names a tag; rank files against dp_world_size, partition_count "
            "and zero_stage; partition sizes against param_shapes; module shapes"
        ]

    def num_parameters(self, details: dict[str, Any]) -> int | None:
        """From ``param_shapes``: the real parameters, not the stored placeholders."""
        summary = details.get(DEEPSPEED)
        return summary.get("num_parameters") if isinstance(summary, dict) else None

    def edit_leaves_out(
        self, layout: FrameworkDirectory, *, for_inference: bool
    ) -> tuple[str, ...]:
        # zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint) reads the fp32 weights from
        # the optimizer shards, where ZeRO partitions them (ZeRO-3 keeps only placeholders in
        # the model states): a directory without them no longer loads with it; and a rename in
        # the model states would no longer match the shards' parameter names.
        raise InputError(
            "edit does not rewrite a DeepSpeed checkpoint: DeepSpeed's zero_to_fp32 reads the "
            "fp32 weights from the optimizer shards (a copy without them would not load, a "
            "rename in the model states would not match them); `ckpttool convert` it to a "
            "weights file (its fp32 view) and edit that"
        )

    def run_layout(self, directory: str) -> RunLayout | None:
        """A save directory: its tags by step, and the tag ``latest`` names (what
        ``engine.load_checkpoint(dir)`` loads)."""
        return files.run_layout(directory)

    def rescale(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryRescaleReport:
        from ckpttool.frameworks.deepspeed.universal import rescale_zero

        if request.in_place:
            raise InputError(
                f"{path}: a DeepSpeed checkpoint is written as a new universal checkpoint "
                "directory (-o OUT, default PATH.wsN); --in-place does not apply"
            )
        return rescale_zero(
            path, request.world_size, from_world_size=request.from_world_size,
            strict=request.strict, output=request.output, overwrite=request.overwrite,
            dry_run=request.dry_run, batch_size=request.batch_size,
            keep_global_batch=request.keep_global_batch, layout=layout,
        )  # fmt: skip


FRAMEWORK = DeepSpeed()
