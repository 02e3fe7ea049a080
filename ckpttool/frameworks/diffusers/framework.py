"""diffusers as a :class:`~ckpttool.frameworks.base.Framework`: model folders, EMAModel saves and
pipeline folders (files.py), a pipeline's model components read as named parts."""

from __future__ import annotations

from typing import Any

from ckpttool.frameworks.base import Framework, FrameworkDirectory
from ckpttool.frameworks.diffusers import files
from ckpttool.frameworks.parts import PARTS, count_tensors, nest_parts, part_lines


class Diffusers(Framework):
    name = "diffusers"
    layouts = (files.DIFFUSERS_MODEL, files.DIFFUSERS_EMA, files.DIFFUSERS_PIPELINE)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        parts = details.get(PARTS)
        if isinstance(parts, list):
            nest_parts(root, [part["section"] for part in parts])
            details[PARTS] = [
                {**part, "tensors": count_tensors(root, part["section"])} for part in parts
            ]
        return []

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        lines = []
        name = details.get("class_name")
        if name:
            lines.append(f"class:      {name} (diffusers {details.get('diffusers_version', '?')})")
        ema = details.get("ema")
        if isinstance(ema, dict):
            lines.append("EMA:        " + ", ".join(f"{k} {v}" for k, v in ema.items()))
        lines += part_lines(details)
        if PARTS not in details and details.get("not_read"):
            lines.append(f"not read:   {', '.join(details['not_read'])}")
        return lines

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if details.get("layout") == files.DIFFUSERS_PIPELINE:
            return [
                "diffusers: every component model_index.json lists has its folder, every model "
                "component (a folder with config.json) its weights; each weights file read"
            ]
        return ["diffusers: config.json beside the weights; every shard the index lists read"]


FRAMEWORK = Diffusers()
