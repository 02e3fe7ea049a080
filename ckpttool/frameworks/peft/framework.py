"""PEFT as a :class:`~ckpttool.frameworks.base.Framework`: adapter directories (files.py), what
their config and tensors say (adapter.py), and ``show``'s lines for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpttool.frameworks.base import Framework, FrameworkDirectory, ModelDirectoryOutput
from ckpttool.frameworks.peft import files
from ckpttool.frameworks.peft.adapter import summarize
from ckpttool.io.source import is_url

#: Where the summary goes in ``details`` (also what ``lora merge`` reads).
ADAPTER = "adapter"
#: What ``save_pretrained`` writes into an adapter directory (``--force`` replaces only such).
ADAPTER_DIR_FILES = frozenset(
    {files.CONFIG_NAME, files.SAFETENSORS_WEIGHTS_NAME, files.WEIGHTS_NAME, "README.md"}
)


class Peft(Framework):
    name = "peft"
    layouts = (files.PEFT_ADAPTER,)

    def detect(self, path: str) -> FrameworkDirectory | None:
        return files.detect(path)

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        if files.CONFIG_SECTION not in root:
            return []  # the config could not be read: reported as that member's problem
        summary, problems = summarize(
            root[files.CONFIG_SECTION], root.get(files.WEIGHTS_SECTION, {})
        )
        details[ADAPTER] = summary
        return problems

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        summary = details.get(ADAPTER)
        return adapter_lines(summary) if isinstance(summary, dict) and summary else []

    def model_directory(self, details: dict[str, Any]) -> ModelDirectoryOutput | None:
        """``convert ADAPTER_DIR OUT/``: an adapter directory as ``save_pretrained`` writes it
        (``adapter_model.safetensors``, ``adapter_config.json`` copied byte for byte), which
        ``PeftModel.from_pretrained`` loads; an ``adapter_model.bin`` becomes safetensors."""
        if details.get("layout") != files.PEFT_ADAPTER:
            return None
        directory = str(details["directory"])
        return ModelDirectoryOutput(
            directory=directory if is_url(directory) else Path(directory),
            weights_name=files.SAFETENSORS_WEIGHTS_NAME,
            copied_files=(files.CONFIG_NAME,),
            tied_output_names=(),
            config_entries=(files.CONFIG_SECTION,),
            owns=lambda name: name in ADAPTER_DIR_FILES,
            shardable=False,
        )

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        if ADAPTER not in details:
            return []
        return [
            "PEFT: adapter_config.json readable; every adapted module has lora_A [r, in] and "
            "lora_B [out, r] with the same rank, the rank the config gives it, and a DoRA "
            "magnitude of its outputs"
        ]


FRAMEWORK = Peft()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def adapter_lines(summary: dict[str, Any]) -> list[str]:
    """``show``'s header lines for ``details["adapter"]``."""
    modules = summary.get("modules") or []
    rule = "alpha/sqrt(r), rsLoRA" if summary.get("use_rslora") else "alpha/r"
    head = f"adapter:    {summary.get('peft_type')}"
    if summary.get("peft_type") == "LORA":
        head += (f", r {summary.get('r')}, lora_alpha {_number(summary.get('lora_alpha'))}, "
                 f"scaling {_number(summary.get('scaling'))} ({rule}), "
                 f"{len(modules)} adapted module{'' if len(modules) == 1 else 's'}")  # fmt: skip
    lines = [head, f"base model: {summary.get('base_model') or 'not named in the config'}"]
    targets = summary.get("target_modules")
    if targets:
        lines.append(
            f"targets:    {_clip(', '.join(targets) if isinstance(targets, list) else targets, 100)}"
        )
    distinct: dict[tuple[Any, ...], list[str]] = {}
    for module in modules:
        distinct.setdefault((module["rank"], module["alpha"], module["scaling"]), []).append(
            module["module"]
        )
    if summary.get("rank_pattern") or summary.get("alpha_pattern"):
        for (rank, alpha, scaling), names in distinct.items():
            lines.append(f"  r {rank}, alpha {_number(alpha)}, scaling {_number(scaling)}: "
                         f"{len(names)} modules ({_clip(', '.join(names), 80)})")  # fmt: skip
    saved = summary.get("saved") or []
    if summary.get("modules_to_save") or saved:
        copies = ", ".join(s["module"] for s in saved) or "none saved"
        lines.append(f"saved:      {_clip(copies, 100)} (full copies that replace the base's)")
    if summary.get("use_dora"):
        count = sum(1 for m in modules if m.get("magnitude"))
        lines.append(f"DoRA:       magnitude vectors of {count} modules")
    if summary.get("fan_in_fan_out"):
        lines.append("fan_in_fan_out: base weights stored [in, out] (GPT-2 Conv1D)")
    if summary.get("unrecognised"):
        lines.append(f"not merged: {_clip(', '.join(summary['unrecognised']), 100)}")
    return lines
