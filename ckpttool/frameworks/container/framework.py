"""The generic container as a :class:`~ckpttool.frameworks.base.Framework`: a folder or zip
archive of checkpoint files no other plug-in names, each file a named part (files.py), asked
last; ``show``'s lines for its parts and ``verify`` of a zip's members."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpttool.frameworks.base import PARTS, Framework, FrameworkDirectory
from ckpttool.frameworks.container import files
from ckpttool.model.records import tensors

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint
    from ckpttool.io.progress import ProgressCallback


class CheckpointParts(Framework):
    name = "checkpoint_parts"
    layouts = (files.CHECKPOINT_PARTS,)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        details[PARTS] = [
            {
                **part,
                "tensors": len(tensors(root[part["section"]])) if part["section"] in root else 0,
            }
            for part in details[PARTS]
        ]
        return []

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        parts = details.get(PARTS) or []
        lines = [f"parts:      {len(parts)}"]
        for part in parts:
            tensors = part.get("tensors", 0)
            held = f"{tensors} tensor{'' if tensors == 1 else 's'}" if tensors else "no weights"
            lines.append(f"  {part['name']:<20} {part['file']:<24} {part['type'] or '?':<18} "
                         f"{held} (key prefix {part['prefix']!r})")  # fmt: skip
        return lines

    def verified_file_by_file(self, details: dict[str, Any]) -> bool:
        """A folder's parts are checkpoint files of their own: ``verify`` gives each its verdict
        (a zip archive's members are checked as the archive, one verdict)."""
        return details.get("layout_title") == files.FOLDER_TITLE

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        return [
            f"{details.get('layout_title')}: each checkpoint file read by its own format as a part"
        ]

    def verify_members(
        self, ckpt: Checkpoint, progress: ProgressCallback | None
    ) -> tuple[list[str], list[str]] | None:
        if self.verified_file_by_file(ckpt.details):
            return None  # a folder's parts are files: verify checks each as a file
        from ckpttool.frameworks.container.verify import verify_archive

        return verify_archive(ckpt, progress)


FRAMEWORK = CheckpointParts()
