"""The names a torch.distributed.checkpoint directory is known by: its ``.metadata`` and its
``__<rank>_<n>.distcp`` data files (checked without importing the reader)."""

from __future__ import annotations

import os

#: The file a torch.distributed.checkpoint directory is recognised by (written last by DCP).
DCP_METADATA = ".metadata"


def is_dcp_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (checked without importing its reader)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


def has_dcp_shards(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(entry.name.endswith(".distcp") for entry in entries)
    except OSError:  # unreadable: say "a directory", as for any other
        return False
