"""``show``'s lines for a GGUF file: version and layout, the model facts llama.cpp reads
(architecture, context length, blocks, vocabulary size), the GGML types, and every metadata
key (a long array by its item type and length: a vocabulary is never printed)."""

from __future__ import annotations

from typing import Any


def show_lines(details: dict[str, Any]) -> list[str]:
    if "gguf_version" not in details:
        return []
    metadata = details.get("gguf_metadata", {})
    lines = [
        f"gguf:       version {details['gguf_version']}, {len(metadata)} metadata keys, "
        f"alignment {details['alignment']}, data from byte {details['data_offset']:,}"
    ]
    facts = details.get("gguf_model") or {}
    if facts:
        names = {
            "architecture": "", "context_length": "context ", "block_count": "blocks ",
            "embedding_length": "embedding ", "vocabulary": "vocabulary ",
        }  # fmt: skip
        shown = [
            f"{names[key]}{value:,}" if isinstance(value, int) else f"{names[key]}{value}"
            for key, value in facts.items()
        ]
        lines.append(f"model:      {', '.join(shown)}")
    types = details.get("ggml_types") or {}
    if types:
        lines.append(
            "ggml types: " + ", ".join(f"{kind} x{count}" for kind, count in types.items())
        )
    for key, value in metadata.items():
        lines.append(f"  {key} = {_value_text(value)}")
    return lines


def _value_text(value: Any) -> str:
    if isinstance(value, dict) and "array" in value:
        items = value.get("items")
        if items is None:
            return f"[{value['length']:,} x {value['array']}]"
        return "[" + ", ".join(repr(item) for item in items) + "]"
    return repr(value)
