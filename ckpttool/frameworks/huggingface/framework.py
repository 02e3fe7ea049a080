"""Hugging Face transformers as a :class:`~ckpttool.frameworks.base.Framework`: model
directories, Trainer ``checkpoint-N/`` folders and Trainer ``output_dir`` s (files.py), the
index check of sharded weights, the model directory ``convert`` writes, and ``rescale-step`` of
a Trainer checkpoint (rescale.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import CheckpointCollectionError
from ckpttool.frameworks.base import (
    OPTIMIZER,
    RNG,
    SAMPLER,
    SCALER,
    SCHEDULER,
    TRAINER_STATE,
    TRAINING_ARGS,
    Framework,
    FrameworkDirectory,
    IndexRepair,
    ModelDirectoryOutput,
    RunLayout,
    describe_collection,
)
from ckpttool.frameworks.huggingface import files
from ckpttool.frameworks.huggingface.files import (
    BIN_SHARD,
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    HF_MODEL,
    HF_TRAINER,
    HF_TRAINER_OUTPUT,
    SAFE_SHARD,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    weight_map,
)
from ckpttool.io.source import is_url, join

if TYPE_CHECKING:
    from ckpttool.model.rescaling import DirectoryPlan, RescaleRequest

#: The layouts whose model a model directory is written from.
SOURCE_LAYOUTS = (HF_MODEL, HF_TRAINER)
#: Copied byte for byte from the source directory when it has them.
COPIED_FILES = (CONFIG_NAME, GENERATION_CONFIG_NAME)
#: Output embeddings transformers drops when ``tie_word_embeddings`` ties them to the input
#: embedding (``_tied_weights_keys`` of the ``*ForCausalLM`` classes).
TIED_OUTPUT_NAMES = ("lm_head.weight",)
#: The input embeddings those are tied to (``get_input_embeddings()`` of the common model
#: families: Llama/Mistral/Qwen, GPT-2, BERT/BLOOM, GPT-NeoX, Meta's Llama, T5).
TIED_INPUT_ENDINGS = (
    "embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
    "tok_embeddings.weight", "shared.weight",
)  # fmt: skip
#: What ``save_pretrained`` writes besides shards (``--force`` replaces only such a directory).
MODEL_DIR_FILES = frozenset(
    {*COPIED_FILES, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
)
#: The members of a Trainer ``checkpoint-N/`` that ``edit --for-inference`` leaves out: what
#: only ``Trainer.train(resume_from_checkpoint=...)`` reads. ``trainer_state.json`` and
#: ``training_args.bin`` go too: the Trainer resumes from a checkpoint without ``optimizer.pt``
#: without a word (it loads the optimizer only when the file is there), so the result is left a
#: model directory (``config.json``, the weights, tokenizer files) that ``from_pretrained``
#: loads and that claims to resume nothing.
TRAINER_TRAINING_ROLES = (OPTIMIZER, SCHEDULER, SCALER, RNG, SAMPLER, TRAINER_STATE, TRAINING_ARGS)
#: Top-level entries of a merged model directory that its copied JSON files already hold.
CONFIG_ENTRIES = ("config", "generation_config")


def model_dir_file(name: str) -> bool:
    """A file ``save_pretrained`` writes into a model directory."""
    return name in MODEL_DIR_FILES or bool(SAFE_SHARD.match(name) or BIN_SHARD.match(name))


class HuggingFace(Framework):
    name = "huggingface"
    layouts = (HF_MODEL, HF_TRAINER, HF_TRAINER_OUTPUT)
    #: huggingface_hub's ``download --local-dir`` streams each file into
    #: ``.cache/huggingface/download/<name>.<hash>.<etag>.incomplete`` and renames it when done.
    temp_files = (
        (".cache/huggingface/download/*.incomplete", "an interrupted huggingface_hub download"),
    )

    def detect(self, path: str) -> FrameworkDirectory | None:
        """A model directory or Trainer checkpoint (or an index file in one), else a Trainer
        ``output_dir`` of several checkpoints."""
        layout = files.detect(path)
        return layout if layout is not None else files.detect_output_dir(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        if layout.index is None:
            return []
        return _check_index(layout, root.get("model", {}), shard_of)

    def model_directory(self, details: dict[str, Any]) -> ModelDirectoryOutput | None:
        if details.get("layout") not in SOURCE_LAYOUTS:
            return None
        directory = str(details["directory"])
        return ModelDirectoryOutput(
            directory=directory if is_url(directory) else Path(directory),
            weights_name=SAFE_WEIGHTS_NAME,
            copied_files=COPIED_FILES,
            tied_output_names=TIED_OUTPUT_NAMES,
            config_entries=CONFIG_ENTRIES,
            owns=model_dir_file,
            tied_input_endings=TIED_INPUT_ENDINGS,
        )

    def edit_leaves_out(
        self, layout: FrameworkDirectory, *, for_inference: bool
    ) -> tuple[str, ...]:
        if layout.kind == HF_TRAINER_OUTPUT:
            raise CheckpointCollectionError(layout, describe_collection(layout))
        if layout.kind != HF_TRAINER or not for_inference:
            return ()
        return tuple(m.name for m in layout.members if m.role in TRAINER_TRAINING_ROLES)

    def rebuild_index(self, directory: str, *, keep_lost: bool = True) -> IndexRepair | None:
        from ckpttool.frameworks.huggingface.repair import rebuild_index

        return rebuild_index(directory, keep_lost=keep_lost)

    def run_layout(self, directory: str) -> RunLayout | None:
        from ckpttool.frameworks.huggingface.repair import run_layout

        return run_layout(directory)

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        if layout.kind != HF_TRAINER:
            return None
        from ckpttool.frameworks.huggingface.rescale import plan_trainer

        return plan_trainer(path, request)


FRAMEWORK = HuggingFace()


def _check_index(layout: FrameworkDirectory, weights: Any, shard_of: dict[str, str]) -> list[str]:
    """Every tensor the index lists is in the shard it names, and every stored one is listed."""
    assert layout.index is not None
    path = join(layout.directory, layout.index)
    mapping = weight_map(layout.read_json(layout.index), path)
    present = {member.name for member in layout.members}
    problems = []
    for key, shard in mapping.items():
        found = shard_of.get(key)
        if found is None and shard not in present:
            continue  # the missing shard is reported once, by the layout
        if found is None:
            problems.append(f"{key}: listed in {layout.index} (in {shard}) but in no shard")
        elif found != shard:
            problems.append(f"{key}: {layout.index} says {shard}, but it is stored in {found}")
    problems += [
        f"{key}: stored in {shard} but not listed in {layout.index}"
        for key, shard in shard_of.items()
        if key not in mapping
    ]
    return problems
