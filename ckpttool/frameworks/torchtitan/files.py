"""torchtitan's checkpoint directories, by torchtitan's own names (0.3.0,
``components/checkpointer/dcp.py`` and ``base.py``).

``CheckpointManager`` saves ``{folder}/step-{N}`` (``_create_checkpoint_id``) with
``torch.distributed.checkpoint``; resume takes the highest ``step-N`` holding a ``.metadata``
(``_find_load_step``). The saved dict is ``_flattened_model_states_sd()``: the model's state dict
flattened at the top level (``tok_embeddings.weight``, ``layers.0.attention.wq.weight``...) and
beside it ``optimizer`` (``OptimizersContainer.state_dict``: ``state.{fqn}.{name}``,
``param_groups.{fqn}.{key}``), ``lr_scheduler`` (``{"last_epoch"}``), ``dataloader``
(``{"dp_rank_{r}": pickled loader state, "world_size": dp degree}``) and ``train_state``
(``Trainer.state_dict``: ``{"step", "ntokens_seen"}``). The last save with
``last_save_model_only`` (the default) holds the model alone, possibly cast to the export dtype.
"""

from __future__ import annotations

import os
import re

from ckpttool.frameworks.base import (
    DCP_INDEX,
    FrameworkDirectory,
    dcp_directory,
    format_directory_files,
    has_dcp_files,
    run_directory,
)
from ckpttool.io.source import is_dir, is_file, join

TORCHTITAN = "torchtitan"
TITLE = "torchtitan checkpoint (step-N DCP directory)"
#: ``checkpoint.folder`` holding the ``step-N/`` of one run: listed, each by its step.
TORCHTITAN_RUN = "torchtitan_run"
RUN_TITLE = "torchtitan checkpoint folder"
STEP_DIRECTORY = re.compile(r"^step-(\d+)$")  # _create_checkpoint_id / _find_load_step
MODEL = "model"  # where the flattened model entries are gathered in the merged tree
#: The training states torchtitan saves beside the model (base.py's constants), with the role
#: each plays.
PARTS = {
    "optimizer": "optimizer",
    "lr_scheduler": "scheduler",
    "dataloader": "sampler",
    "train_state": "trainer_state",
}


def detect(path: str) -> FrameworkDirectory | None:
    if not is_dir(path):
        return None
    match = STEP_DIRECTORY.match(os.path.basename(os.path.normpath(path)))
    if match is None:
        if is_file(join(path, DCP_INDEX)):  # a DCP directory itself
            return None
        return run_directory(path, TORCHTITAN_RUN, RUN_TITLE, STEP_DIRECTORY, detect)
    files = format_directory_files(path, ())
    if not has_dcp_files(files):
        return None
    layout = dcp_directory(
        TORCHTITAN, TITLE, path, files, {},
        "DCP writes it after every rank's data; torchtitan's resume skips a step-N without it",
    )  # fmt: skip
    layout.details["step_directory"] = int(match.group(1))
    return layout
