"""``repair`` for directories: a Hugging Face model directory's index, a run directory's
pointer and incomplete checkpoints, leftover temp files (issue 27)."""

from __future__ import annotations

import os

from ckpttool.commands.repair_report import RepairReport
from ckpttool.errors import InputError, name_file


def repair_directory(
    src: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    quarantine: bool = False,
    clean: bool = False,
) -> RepairReport:
    raise name_file(InputError("repairing directories is not built yet"), str(src))
