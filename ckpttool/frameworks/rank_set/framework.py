"""Per-rank state dict sets as a :class:`~ckpttool.frameworks.base.Framework`: which files
form a set (files.py), the global tensors assembled from their DTensor pieces (assemble.py,
open.py), ``show``'s lines and ``convert``'s model directory (verl's ``huggingface/``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import LayoutError
from ckpttool.frameworks.base import Framework, FrameworkDirectory, ModelDirectoryOutput
from ckpttool.frameworks.rank_set import files

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest


#: The output embedding a transformers ``*ForCausalLM`` ties to its input embedding
#: (``tie_word_embeddings``): FSDP2 saves the tied pair as two DTensors over one storage, and a
#: model directory stores the input embedding, the output one as its alias (as
#: ``save_pretrained`` does; frameworks.huggingface's TIED_OUTPUT_NAMES).
TIED_OUTPUT_NAMES = ("lm_head.weight",)


class RankSet(Framework):
    name = "rank_set"
    layouts = (files.RANK_SET,)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def open_directory(
        self, layout: FrameworkDirectory, *, strict: bool, refuse_dangerous: bool
    ) -> Checkpoint | None:
        from ckpttool.frameworks.rank_set.open import open_rank_set

        return open_rank_set(layout, strict=strict, refuse_dangerous=refuse_dangerous)

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        summary = details.get("rank_set")
        if not isinstance(summary, dict) or not summary:
            return []
        splits = summary.get("splits", {})
        parts = [f"{count} {how}" for how, count in splits.items()]
        return [
            f"ranks:      {summary.get('ranks')} ({details.get('rank_files')}), each tensor "
            "assembled from its placements",
            f"split:      {'; '.join(parts)}",
        ]

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if "rank_set" not in details:
            return []
        return [
            "rank set: every rank file present; the ranks' DTensor pieces tile each global "
            "tensor exactly (placements, mesh coordinates, torch's chunking); replicated "
            "tensors equal byte for byte across ranks"
        ]

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        """Refused, saying why: nothing in a rank set counts batches per rank."""
        files_named = layout.details.get("rank_files", "per-rank files")
        raise LayoutError(
            f"{path}: a set of per-rank state dicts ({files_named}); nothing to rescale: its "
            "files hold each rank's pieces of the tensors for the mesh they were saved on, "
            "and the counters such runs keep (verl's global_step_N directory and "
            "latest_checkpointed_iteration.txt, the LR scheduler in extra_state) count "
            "optimizer steps of the global batch, the same on any number of ranks. verl loads "
            "model_world_size_<W>_rank_<R>.pt for its own world size only: to resume on "
            "another number of ranks, convert the set (ckpttool convert SET DST/) and start "
            "from the full weights"
        )

    def model_directory(self, details: dict[str, Any]) -> ModelDirectoryOutput | None:
        """verl's ``huggingface/`` folder (the model's ``config.json``): ``convert SET DST/``
        writes a Hugging Face model directory with it."""
        if not details.get("hf_config"):
            return None
        from ckpttool.io.source import join

        directory = join(str(details.get("directory")), files.HF_FOLDER)
        return ModelDirectoryOutput(
            directory=directory, weights_name="model.safetensors",
            copied_files=("config.json", "generation_config.json"),
            tied_output_names=TIED_OUTPUT_NAMES, config_entries=(),
            owns=lambda name: name in ("config.json", "generation_config.json", "model.safetensors"),
        )  # fmt: skip


FRAMEWORK = RankSet()
