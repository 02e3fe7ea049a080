"""What ``repair`` reports, for a file (:mod:`ckpttool.commands.repair`) or a directory
(:mod:`ckpttool.commands.repair_directory`)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import EXIT_FOUND


@dataclass(frozen=True)
class LostTensor:
    """A tensor whose bytes are lost: left out of the repaired file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    reason: str = ""  # why it could not be taken from ``fill_from`` (or left out with another)


@dataclass(frozen=True)
class FilledTensor:
    """A lost tensor taken from another checkpoint (``fill_from``): same dtype and shape."""

    key: str
    source: str  # the checkpoint it was taken from


@dataclass(frozen=True)
class CheckpointState:
    """One checkpoint of a run directory, judged by verify's rules."""

    path: str
    complete: bool
    missing: tuple[str, ...] = ()  # what an incomplete one lacks, one line each


@dataclass(frozen=True)
class RepairAction:
    """One change repair made (or, with ``dry_run``, would make) to the file system."""

    action: str  # "write" | "rewrite index" | "rewrite pointer" | "quarantine" | "remove"
    path: str  # the file or directory acted on
    detail: str = ""  # one line: what and why


@dataclass(frozen=True)
class RepairReport:
    """What ``repair`` found and did, for a file or a directory."""

    source: str
    kind: str  # "file" | "directory"
    format: str  # a file's format, or a directory's layout
    damage: tuple[str, ...]  # what is wrong with the source, one line each
    recovered: int  # tensors in the repaired file (files)
    lost: tuple[LostTensor, ...]  # tensors whose bytes are lost
    dropped: tuple[str, ...]  # intact tensors left out with a lost one (same optimizer entry)
    output: str | None  # the repaired file; None when nothing is written
    written: bool
    filled: tuple[FilledTensor, ...] = ()  # lost tensors taken from ``fill_from``
    checkpoints: tuple[CheckpointState, ...] = ()  # a run directory's checkpoints, oldest first
    newest_complete: str | None = None  # a run directory's newest complete checkpoint
    actions: tuple[RepairAction, ...] = ()  # what was (dry run: would be) changed
    dry_run: bool = False  # nothing was to be written
    #: A directory's damage lines that stay after the actions (with ``dry_run``: would stay):
    #: tensors lost for good, incomplete checkpoints not moved aside, temp files not removed.
    unrepaired: tuple[str, ...] = ()

    @property
    def damaged(self) -> bool:
        return bool(self.damage or self.lost)

    @property
    def exit_code(self) -> int:
        """0: nothing is lost (the source was intact, or all of it was recovered and written);
        1 (:data:`~ckpttool.errors.EXIT_FOUND`): something stays lost or damaged (tensors lost
        or left out, a dry run, damage no action fixed)."""
        if self.lost or self.dropped or self.unrepaired or (self.damaged and not self.written):
            return EXIT_FOUND
        return 0
