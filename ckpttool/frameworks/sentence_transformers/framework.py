"""sentence-transformers as a :class:`~ckpttool.frameworks.base.Framework`: a model folder read
as one checkpoint whose parts are its modules (files.py), and ``show``'s lines for them."""

from __future__ import annotations

from typing import Any

from ckpttool.frameworks.base import Framework, FrameworkDirectory
from ckpttool.frameworks.parts import PARTS, count_tensors, nest_parts, part_lines
from ckpttool.frameworks.sentence_transformers import files


class SentenceTransformers(Framework):
    name = "sentence_transformers"
    layouts = (files.SENTENCE_TRANSFORMERS,)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        parts = details.get(PARTS, [])
        nest_parts(root, [part["section"] for part in parts])
        details[PARTS] = [
            {**part, "tensors": count_tensors(root, part["section"])} for part in parts
        ]
        return []

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        return part_lines(details)

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        return [
            "sentence-transformers: every module modules.json lists has its folder, and its "
            "weights unless it is a Pooling, Normalize or Dropout module; each weights file read"
        ]


FRAMEWORK = SentenceTransformers()
