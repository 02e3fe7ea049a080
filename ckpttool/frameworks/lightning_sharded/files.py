"""Lightning's sharded checkpoint directory, by Lightning's own names.

``FSDPStrategy.save_checkpoint`` and ``ModelParallelStrategy.save_checkpoint`` with
``state_dict_type="sharded"`` (pytorch-lightning 2.6, ``strategies/fsdp.py``) pop
``state_dict`` and ``optimizer_states`` out of the checkpoint dict, write
``{"model": state_dict, "optimizer_0": ..., "optimizer_1": ...}`` with
``torch.distributed.checkpoint.save`` (``_distributed_checkpoint_save``: ``.metadata``, written
last, and one ``__<rank>_<n>.distcp`` per rank), then rank 0 ``torch.save`` s what is left
(``epoch``, ``global_step``, ``pytorch-lightning_version``, ``loops``, ``callbacks``,
``lr_schedulers``, ``hyper_parameters``...) as ``meta.pt`` (``lightning_fabric.utilities.load.
_METADATA_FILENAME``). Lightning knows the directory by ``meta.pt`` alone
(``_is_sharded_checkpoint``); its consolidation (``_load_distributed_checkpoint``) loads the DCP
tree and updates it with ``meta.pt``'s dict: the merged tree here is that dict.
"""

from __future__ import annotations

import re

from ckpttool.frameworks.base import (
    TRAINING_STATE,
    FrameworkDirectory,
    dcp_directory,
    format_directory_files,
    has_dcp_files,
)
from ckpttool.io.source import is_dir

LIGHTNING_SHARDED = "lightning_sharded"
TITLE = "Lightning sharded checkpoint (DCP + meta.pt)"
META = "meta.pt"  # lightning_fabric.utilities.load._METADATA_FILENAME
MODEL_KEY = "model"  # the state dict's key in the DCP tree ("state_dict" in a .ckpt)
OPTIMIZER_KEY = re.compile(r"^optimizer_(\d+)$")  # "optimizer_states[i]" in a .ckpt


def detect(path: str) -> FrameworkDirectory | None:
    if not is_dir(path):
        return None
    files = format_directory_files(path, (META,))
    if META not in files or not has_dcp_files(files):
        return None
    return dcp_directory(
        LIGHTNING_SHARDED, TITLE, path, files, {META: (TRAINING_STATE, "")},
        "torch.distributed.checkpoint writes it after every rank's data: the save was "
        "interrupted, or the copy is partial",
    )  # fmt: skip
