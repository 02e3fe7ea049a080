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
    FORMAT_DATA,
    INDEX,
    OTHER,
    TRAINING_STATE,
    FrameworkDirectory,
    Member,
    format_directory_files,
)
from ckpttool.io.source import is_dir

LIGHTNING_SHARDED = "lightning_sharded"
TITLE = "Lightning sharded checkpoint (DCP + meta.pt)"
META = "meta.pt"  # lightning_fabric.utilities.load._METADATA_FILENAME
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written after the data
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
MODEL_KEY = "model"  # the state dict's key in the DCP tree ("state_dict" in a .ckpt)
OPTIMIZER_KEY = re.compile(r"^optimizer_(\d+)$")  # "optimizer_states[i]" in a .ckpt


def detect(path: str) -> FrameworkDirectory | None:
    if not is_dir(path):
        return None
    files = format_directory_files(path, (META,))
    data = {name: DATA_FILE.match(name) for name in files}
    if META not in files or not (DCP_METADATA in files or any(data.values())):
        return None
    members = []
    for name, size in files.items():
        match = data[name]
        if name == DCP_METADATA:
            members.append(Member(name, INDEX, "", size, indexes_directory=True))
        elif match:
            members.append(Member(name, FORMAT_DATA, None, size, rank=int(match.group(1))))
        elif name == META:
            members.append(Member(name, TRAINING_STATE, "", size))
        else:
            members.append(Member(name, OTHER, None, size))
    layout = FrameworkDirectory(
        kind=LIGHTNING_SHARDED, title=TITLE, directory=path, members=members
    )
    if DCP_METADATA not in files:
        layout.missing.append(
            f"{DCP_METADATA} (torch.distributed.checkpoint writes it after every rank's data: "
            "the save was interrupted, or the copy is partial)"
        )
    ranks = sorted({int(m.group(1)) for m in data.values() if m})
    if ranks:
        layout.details["ranks"] = ranks[-1] + 1
    layout.complete = not layout.missing
    return layout
