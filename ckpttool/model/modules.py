"""A state dict's keys as modules: ``layers.3.mlp.up_proj.weight`` is a tensor of module
``layers.3.mlp.up_proj``, one of the repeated blocks ``layers.#``.

A number in a key names a block only when its siblings repeat the same structure: the
``layers.0 ... layers.31`` of a transformer hold the same keys with the same shapes, while the
``0``, ``2``, ``4`` of an ``nn.Sequential`` are different layers. :class:`ModuleGroups` decides
that from the keys' shapes and dtypes, once, for ``diff --by-module``, ``trend`` and
``--plot``; ``show --tree`` folds by the same rule (runs of numbered siblings with the same
signature, :func:`block_index` says which key parts are numbers).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

#: Deeper keys are not split into modules: real models nest a dozen levels, and a key with
#: thousands of dots (a hostile file) would otherwise make thousands of one-child levels.
MAX_MODULE_DEPTH = 32
FOLDED = "#"  # what a block number becomes in a module group


def block_index(name: str) -> int | None:
    """The number a block is named by (``layers.3`` -> 3), or None."""
    if name.isascii() and name.isdigit() and len(name) <= 18:
        return int(name)
    return None


def module_parts(key: str) -> list[str]:
    """The module a tensor belongs to, as key parts: ``layers.3.mlp.up_proj.weight`` ->
    ``layers``, ``3``, ``mlp``, ``up_proj``. A tensor at the top (no dot) is a module of its own;
    a key deeper than :data:`MAX_MODULE_DEPTH` is cut there."""
    parts = key.split(".", MAX_MODULE_DEPTH)
    return parts[:-1] if len(parts) > 1 else parts


class ModuleGroups:
    """The module group of each of a checkpoint's tensors: its module, with the numbers of
    repeated blocks folded to ``#``.

    Numbered siblings (``layers.0``, ``layers.1``, ... under one parent) are one block repeated
    when each holds the same relative keys with the same signatures (dtype and shape); the
    largest such set of siblings folds (``layers.#.mlp.up_proj``; on a tie, the set met first),
    and every other numbered module keeps its own name (``features.4``, or ``layers.31`` when
    the last block differs). A set of one is never folded. Deeper numbers are decided the same
    way below each folded parent (``layers.#.experts.#``)."""

    def __init__(self, tensors: Iterable[tuple[str, Hashable]]) -> None:
        """``tensors``: each tensor's key and signature (anything hashable: its dtype and
        shape, as the caller knows them)."""
        items = [(key, key.split(".", MAX_MODULE_DEPTH), signature) for key, signature in tensors]
        shown = {key: list(module_parts(key)) for key, _, _ in items}
        depth = max((len(shown[key]) for key, _, _ in items), default=0)
        for level in range(depth):
            # parent as shown so far -> block (its raw parts) -> (relative key, signature)s
            blocks: dict[tuple[str, ...], dict[tuple[str, ...], list[tuple[str, Hashable]]]] = {}
            for key, parts, signature in items:
                module = shown[key]
                # a block has keys below it: a number that is the tensor's own name is no block
                if level >= len(module) or level >= len(parts) - 1:
                    continue
                if block_index(parts[level]) is None:
                    continue
                parent = tuple(module[:level])
                relative = ".".join(parts[level + 1 :])
                block = blocks.setdefault(parent, {}).setdefault(tuple(parts[: level + 1]), [])
                block.append((relative, signature))
            folded: set[tuple[str, ...]] = set()
            for members in blocks.values():
                folded.update(_repeated(members))
            for key, parts, _ in items:
                if tuple(parts[: level + 1]) in folded:
                    shown[key][level] = FOLDED
        self._groups = {key: ".".join(parts) for key, parts in shown.items()}

    def group(self, key: str) -> str:
        """The group of a tensor given to the constructor (another key: its module, unfolded)."""
        found = self._groups.get(key)
        return found if found is not None else ".".join(module_parts(key))


def _repeated(members: dict[tuple[str, ...], list[tuple[str, Hashable]]]) -> list[tuple[str, ...]]:
    """The blocks of one parent that fold: those of the structure (relative keys and
    signatures) that the most block numbers share, two at least (the first met on a tie), or
    none. Numbers are counted, not blocks: ``mlp.0`` met under every ``layers.#`` is one number."""
    numbers: dict[tuple[tuple[str, Hashable], ...], set[str]] = {}
    structure = {}
    for block, found in members.items():
        shape = tuple(sorted(found, key=lambda item: item[0]))
        structure[block] = shape
        numbers.setdefault(shape, set()).add(block[-1])
    common, count = max(
        ((s, len(n)) for s, n in numbers.items()), key=lambda i: i[1], default=((), 0)
    )
    if count < 2:
        return []
    return [block for block, shape in structure.items() if shape == common]
