"""PEFT adapter directories: what ``PeftModel.save_pretrained`` writes, and the same files inside
a Trainer ``checkpoint-N/`` (Trainer saves a PEFT model's adapter in place of the weights).

File names are PEFT's own (``peft/utils/constants.py``: ``CONFIG_NAME``,
``SAFETENSORS_WEIGHTS_NAME``, ``WEIGHTS_NAME``); the Trainer files are transformers', read
as the Hugging Face plug-in reads them (:mod:`ckpttool.frameworks.trainer_files`). An adapter
is complete with its config and its weights; a Trainer checkpoint's other files are read but
not required (the Trainer checkpoint's completeness is the Hugging Face plug-in's question).
"""

from __future__ import annotations

from ckpttool.frameworks.base import (
    CONFIG,
    OTHER,
    WEIGHTS,
    FrameworkDirectory,
    Member,
    list_files,
)
from ckpttool.frameworks.trainer_files import TRAINER_STATE_NAME, trainer_members
from ckpttool.io.source import is_dir

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_WEIGHTS_NAME = "adapter_model.safetensors"
WEIGHTS_NAME = "adapter_model.bin"  # torch.save of the adapter's state dict (older PEFT)

PEFT_ADAPTER = "peft_adapter"
#: The sections of the merged tree: the adapter's tensors, its config.
WEIGHTS_SECTION = "model"
CONFIG_SECTION = "adapter_config"


def detect(path: str) -> FrameworkDirectory | None:
    """A directory holding ``adapter_config.json`` (and, to be complete, the adapter's weights)."""
    if not is_dir(path):
        return None
    files = list_files(path)
    if CONFIG_NAME not in files:
        return None
    members = [Member(CONFIG_NAME, CONFIG, CONFIG_SECTION, files[CONFIG_NAME], json=True)]
    missing = []
    weights = next((n for n in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME) if n in files), None)
    if weights is None:
        missing.append(f"the adapter's weights ({SAFETENSORS_WEIGHTS_NAME} or {WEIGHTS_NAME})")
    else:
        members.append(Member(weights, WEIGHTS, WEIGHTS_SECTION, files[weights]))
    trainer = trainer_members(files)  # beside the adapter in checkpoint-N/
    members += trainer
    known = {member.name for member in members}
    members += [
        Member(name, OTHER, None, size) for name, size in files.items() if name not in known
    ]
    layout = FrameworkDirectory(
        kind=PEFT_ADAPTER,
        title="PEFT adapter in a Trainer checkpoint" if trainer else "PEFT adapter",
        directory=path,
        members=members,
        missing=missing,
        complete=not missing,
    )
    if TRAINER_STATE_NAME in files:
        state = layout.read_json(TRAINER_STATE_NAME)
        if isinstance(state, dict):
            for key in ("global_step", "epoch", "max_steps"):
                if key in state:
                    layout.details[key] = state[key]
    return layout
