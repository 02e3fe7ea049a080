"""``verify`` of a zip archive of checkpoint files: each member's CRC-32 as the archive records
it, then each checkpoint member as ``verify`` checks a file (its format's own checks: a torch
zip's records and their CRCs; the globals its pickles call)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool.errors import CkptError
from ckpttool.frameworks.base import PARTS
from ckpttool.frameworks.container import files

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint
    from ckpttool.io.progress import ProgressCallback


def verify_archive(
    ckpt: Checkpoint, progress: ProgressCallback | None
) -> tuple[list[str], list[str]]:
    """(problems, what was checked) of the archive ``ckpt`` was opened from."""
    from ckpttool.formats.registry import find_format
    from ckpttool.pickle.policy import Verdict, never_load_problem

    archive = str(ckpt.details.get("directory", ckpt.name))
    layout = files.detect(archive)
    if layout is None or not isinstance(layout.found, dict):
        return [f"{archive}: no longer a zip archive of checkpoint files"], []
    members: dict[str, files.ZipMember] = layout.found
    problems: list[str] = []
    # members the reader already reported unreadable are not read again
    named = {problem.split(": ", 1)[0] for problem in ckpt.problems}
    checked_parts = 0
    for part in ckpt.details.get(PARTS) or []:
        name = part["file"]
        member = members[name]
        if member.info.compress_type == 0 and files.stored_crc(archive, member) != member.info.CRC:
            problems.append(f"{name}: CRC-32 mismatch: its bytes changed after the zip was written")
        if not name.endswith(files.CHECKPOINT_SUFFIXES) or name in named:
            continue
        assert layout.opener is not None
        try:
            opened = layout.opener(name, False, False)
        except CkptError as error:
            problems.append(f"{name}: {str(error).removeprefix(f'{archive}/{name}: ')}")
            continue
        with opened:
            checked_parts += 1
            problems += [f"{name}: {problem}" for problem in opened.problems]
            if opened.pickle is not None:
                dangerous = {
                    f"{m}.{n}" for m, n, v in opened.pickle.globals_seen if v is Verdict.DANGEROUS
                }
                if dangerous:
                    problems.append(f"{name}: {never_load_problem('the pickle calls', dangerous)}")
            fmt = find_format(opened.format)
            if fmt is not None:
                found, _ = fmt.verify(opened, progress)
                problems += [f"{name}: {problem}" for problem in found]
    checked = [
        "every member's CRC-32 as the zip records it",
        f"{checked_parts} checkpoint member{'s' * (checked_parts != 1)} verified one by one, "
        "each by its own format",
    ]
    return problems, checked
