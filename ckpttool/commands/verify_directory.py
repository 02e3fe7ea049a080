"""``verify`` of a framework's directory checkpoint: every member file, and the layout's rules.

Each member that is a checkpoint file is verified as a file of its own (zip records and CRCs,
safetensors rules, dangerous globals), several at once with ``--jobs``
(:mod:`ckpttool.io.parallel`); its problems are reported under its name, in the members'
order. The layout's
completeness rules come from :mod:`ckpttool.frameworks.base` (an index naming a missing shard, a
shard the index does not list, a tensor in two shards, a Trainer checkpoint without
``trainer_state.json``, a rank without its RNG file...): each missing file is a problem,
because the framework's own resume would fail on it or resume inexactly. A file the layout does
not use but that is named like a checkpoint (a ``pytorch_model.bin`` or an ``extra.pth`` beside
``model.safetensors``) is verified as well, and named as such: a torn one is a problem, not a
file passed over in silence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpttool.commands.selection import in_folder
from ckpttool.errors import CkptError
from ckpttool.frameworks.base import CHECKPOINT_SUFFIXES, OTHER
from ckpttool.frameworks.registry import framework_of
from ckpttool.io.parallel import serialized
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.source import join
from ckpttool.io.units import shared_map

if TYPE_CHECKING:
    from ckpttool.checkpoint import Checkpoint

#: Member roles that are not checkpoint files of their own (read as JSON, or not read).
NOT_CHECKPOINTS = (
    "index", "trainer_state", "config", OTHER, "latest", "script",
    "format_data",  # a DCP data file: the directory format checked it when the layout was read
)  # fmt: skip


def check_directory(
    ckpt: Checkpoint,
    progress: ProgressCallback | None,
    verify_file: Callable[..., Any],
    folder: str | None = None,
) -> tuple[list[str], list[str]]:
    """(problems, what was checked) for a directory opened by the reader; each member file is
    checked by ``verify_file`` (``verify``'s own, handed in: this module is below it). With
    ``folder`` (a part's, ``verify --component``), only the members and missing files there."""
    details = ckpt.details
    framework = framework_of(details.get("layout"))
    if framework is not None:  # members that are no files of their own (a zip's)
        members_checked = framework.verify_members(ckpt, progress)
        if members_checked is not None:
            return members_checked[0], members_checked[1] + framework.verify_checks(details)
    directory = str(details.get("directory", ckpt.name))
    problems: list[str] = []
    # a member the layout already reported (an empty rank file) is not verified again
    named = {problem.split(": ", 1)[0] for problem in ckpt.problems}
    candidates = [
        m
        for m in details.get("members", [])
        if m.get("name") not in named and in_folder(m["name"], folder)
    ]
    members = [m for m in candidates if m.get("role") not in NOT_CHECKPOINTS]
    # files the layout does not read, named like checkpoints: verified too (module docstring)
    unused = [
        m for m in candidates
        if m.get("role") == OTHER and m["name"].endswith(CHECKPOINT_SUFFIXES)
    ]  # fmt: skip
    members += unused
    shared_progress = serialized(progress)

    def check(member: dict[str, Any]) -> list[str]:
        try:
            result = verify_file(join(directory, member["name"]), progress=shared_progress)
        except CkptError as error:
            return [f"{member['name']}: {error}"]
        return [f"{member['name']}: {problem}" for problem in result.problems] + [
            f"{member['name']}: leftover temp file {left}" for left in result.leftovers
        ]

    # --jobs: members at once, reported in order; under torchrun, shared by the ranks by size
    for found in shared_map(check, members, [m.get("size") or 1 for m in members]):
        problems += found
    problems += [
        f"incomplete: {missing} is missing (written by the framework; its resume needs it)"
        for missing in details.get("missing", [])
        if in_folder(missing.split(" (", 1)[0], folder)  # "2_Dense/ (module 2, Dense)"
    ]
    title = details.get("layout_title", "directory")
    used = len(members) - len(unused)
    checked = [
        f"{used} member file{'s' * (used != 1)} verified one by one",
        f"{title}: completeness rules",
    ]
    if unused:
        names = ", ".join(m["name"] for m in unused)
        checked.append(f"also verified, though the {title} does not load them: {names}")
    if framework is not None:
        checked += framework.verify_checks(details)
    return problems, checked
