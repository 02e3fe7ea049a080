"""A state dict's keys as modules: ``layers.3.mlp.up_proj.weight`` is a tensor of module
``layers.3.mlp.up_proj``, one of the repeated blocks ``layers.#``.

``show --tree`` folds runs of numbered blocks (:func:`block_index` says which key parts number
a block); ``diff --by-module`` and ``trend`` group tensors by :func:`module_group`, their module
with every block number folded to ``#`` (as llama.cpp's tensor-info patterns).
"""

from __future__ import annotations

#: Deeper keys are not split into modules: real models nest a dozen levels, and a key with
#: thousands of dots (a hostile file) would otherwise make thousands of one-child levels.
MAX_MODULE_DEPTH = 32
FOLDED = "#"  # what a block number becomes in a module group


def block_index(name: str) -> int | None:
    """The number a block is named by (``layers.3`` -> 3), or None."""
    if name.isascii() and name.isdigit() and len(name) <= 18:
        return int(name)
    return None


def module_group(key: str) -> str:
    """The module a tensor belongs to with its block numbers folded:
    ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.#.mlp.up_proj``. A tensor at the
    top (no dot) is a group of its own; a key deeper than :data:`MAX_MODULE_DEPTH` is cut there."""
    parts = key.split(".", MAX_MODULE_DEPTH)
    if len(parts) > 1:
        parts = parts[:-1]
    return ".".join(FOLDED if block_index(part) is not None else part for part in parts)
