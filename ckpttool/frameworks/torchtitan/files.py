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
    FORMAT_DATA,
    INDEX,
    OTHER,
    FrameworkDirectory,
    Member,
    format_directory_files,
    run_directory,
)
from ckpttool.io.source import is_dir, is_file, join

TORCHTITAN = "torchtitan"
TITLE = "torchtitan checkpoint (step-N DCP directory)"
#: ``checkpoint.folder`` holding the ``step-N/`` of one run: listed, each by its step.
TORCHTITAN_RUN = "torchtitan_run"
RUN_TITLE = "torchtitan checkpoint folder"
STEP_DIRECTORY = re.compile(r"^step-(\d+)$")  # _create_checkpoint_id / _find_load_step
DCP_METADATA = ".metadata"
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
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
        if is_file(join(path, DCP_METADATA)):  # a DCP directory itself
            return None
        return run_directory(path, TORCHTITAN_RUN, RUN_TITLE, STEP_DIRECTORY, detect)
    files = format_directory_files(path, ())
    data = {name: DATA_FILE.match(name) for name in files}
    if DCP_METADATA not in files and not any(data.values()):
        return None
    members = []
    for name, size in files.items():
        found = data[name]
        if name == DCP_METADATA:
            members.append(Member(name, INDEX, "", size, indexes_directory=True))
        elif found:
            members.append(Member(name, FORMAT_DATA, None, size, rank=int(found.group(1))))
        else:
            members.append(Member(name, OTHER, None, size))
    layout = FrameworkDirectory(kind=TORCHTITAN, title=TITLE, directory=path, members=members)
    layout.details["step_directory"] = int(match.group(1))
    if DCP_METADATA not in files:
        layout.missing.append(
            f"{DCP_METADATA} (DCP writes it after every rank's data; torchtitan's resume skips "
            "a step-N without it)"
        )
    ranks = sorted({int(m.group(1)) for m in data.values() if m})
    if ranks:
        layout.details["ranks"] = ranks[-1] + 1
    layout.complete = not layout.missing
    return layout
