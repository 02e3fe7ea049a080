"""torch.distributed.checkpoint directories as a :class:`~ckpttool.formats.base.FileFormat`.

A directory format: recognised by its ``.metadata`` (:func:`is_dcp_directory`),
opened by :mod:`.directory` (whose ``.metadata`` walk hands the walker its fast path,
:mod:`.pickle_call`), verified item by item (:mod:`.verify`), scanned pickle by pickle
(:mod:`.scan`), rewritten by ``edit`` (:mod:`.write`). Each is imported only when used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.errors import CkptError, CorruptCheckpointError
from ckpttool.formats.base import Checkpoint, FileFormat, Findings, Parsed
from ckpttool.formats.dcp.names import DCP_METADATA, has_dcp_shards, is_dcp_directory

if TYPE_CHECKING:
    from pathlib import Path

    from ckpttool.io.progress import ProgressCallback


class DcpFormat(FileFormat):
    id = "dcp"
    ids = ("dcp",)
    index_name = DCP_METADATA
    directory_title = "torch.distributed.checkpoint"
    no_rescale_why = "DCP keeps step inside one rank's data file"

    def recognises_directory(self, path: str | os.PathLike[str]) -> bool:
        return is_dcp_directory(path)

    def incomplete_directory(self, path: str) -> CkptError | None:
        if not (os.path.isdir(path) and has_dcp_shards(path)):
            return None
        return CorruptCheckpointError(
            f"{path}: a torch.distributed.checkpoint directory without its {DCP_METADATA} file "
            "(DCP writes it last: the save did not finish); use the previous checkpoint"
        )

    def open_directory(
        self, directory: Any, index: BinaryIO, *, strict: bool, refuse_dangerous: bool
    ) -> Parsed:
        from ckpttool.formats.dcp.directory import read_dcp

        return read_dcp(directory, index, strict=strict, refuse_dangerous=refuse_dangerous)

    def verify(
        self, ckpt: Checkpoint, progress: ProgressCallback | None
    ) -> tuple[list[str], list[str]]:
        from ckpttool.formats.dcp.verify import check_dcp

        return check_dcp(ckpt, progress)

    def rewrite_directory(
        self,
        source: Path,
        root: Any,
        target: Path,
        casts: Mapping[str, tuple[str, Callable[[Any], bytes]]],
    ) -> None:
        from ckpttool.formats.dcp.write import rewrite_dcp

        rewrite_dcp(source, root, target, casts)

    def scan(self, path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
        from ckpttool.formats.dcp.scan import scan_dcp

        return scan_dcp(path, opener)


FORMAT = DcpFormat()
