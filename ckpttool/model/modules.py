"""A state dict's keys as modules: ``layers.3.mlp.up_proj.weight`` is a tensor of module
``layers.3.mlp.up_proj``, one of the repeated blocks ``layers.#``.

Numbered modules are grouped by their structure, not by their digits (:func:`fold_runs`, the
one rule ``show --tree``, ``diff --by-module``, ``trend`` and ``--plot`` use): a run of two or
more consecutive block numbers under one parent folds when each block holds the same relative
keys with the same dtypes and shapes (a transformer's ``layers.0..31``). Any other numbered
module stays a module of its own (an ``nn.Sequential``'s ``0``, ``2``, ``4``; a ``ModuleDict``
keyed ``'0'``, ``'1'`` whose modules differ), and a block unlike its neighbours stands alone
(``layers.0..30`` and ``layers.31``): "which layer changed" keeps an answer.
:class:`ModuleGroups` names each tensor's group from it, as llama.cpp's tensor-info patterns do.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import NamedTuple

#: Deeper keys are not split into modules: real models nest a dozen levels, and a key with
#: thousands of dots (a hostile file) would otherwise make thousands of one-child levels.
MAX_MODULE_DEPTH = 32
FOLDED = "#"  # what a block number becomes when the fold holds every numbered block there


def block_index(name: str) -> int | None:
    """The number a block is named by (``layers.3`` -> 3), or None."""
    if name.isascii() and name.isdigit() and len(name) <= 18:
        return int(name)
    return None


def fold_runs(signatures: Mapping[int, Hashable]) -> list[range]:
    """The runs of numbered blocks that fold: two or more consecutive block numbers whose
    blocks have equal signatures (their relative keys, dtypes and shapes), in number order.
    Blocks in no run are modules of their own."""
    runs: list[range] = []
    numbers = sorted(signatures)
    start = 0
    for end in range(1, len(numbers) + 1):
        if (
            end == len(numbers)
            or numbers[end] != numbers[end - 1] + 1
            or signatures[numbers[end]] != signatures[numbers[start]]
        ):
            if end - start > 1:
                runs.append(range(numbers[start], numbers[end - 1] + 1))
            start = end
    return runs


class Stack(NamedTuple):
    """Where a key enters a stack of repeated blocks (a parent with a folded run)."""

    at: int  # the position of the block number in the key's dotted parts
    layer: int  # the block number
    kind: str  # the key's group after the block: "mlp.up_proj" (the tensor's name at a block's top)


class ModuleGroups:
    """The module group of each tensor of a state dict: its module, the block numbers of each
    folded run written ``#`` (the run holds every numbered block under its parent) or
    ``first..last`` (it holds some: ``layers.0..30``, next to ``layers.31``), any other block
    number as itself. ``tensors`` gives each key with what its tensor must match in another
    block to fold (its dtype and shape; a diff: both sides')."""

    def __init__(self, tensors: Iterable[tuple[str, Hashable]]) -> None:
        blocks: dict[tuple[str, int], set[tuple[str, Hashable]]] = {}
        self._keys: list[str] = []
        for key, description in tensors:
            self._keys.append(key)
            parts = key.split(".", MAX_MODULE_DEPTH)
            for at in range(len(parts) - 1):  # the module parts (the last names the tensor)
                number = block_index(parts[at])
                if number is not None:
                    relative = ".".join(parts[at + 1 :])
                    parent = ".".join(parts[:at])
                    blocks.setdefault((parent, number), set()).add((relative, description))
        by_parent: dict[str, dict[int, Hashable]] = {}
        for (parent, number), signature in blocks.items():
            by_parent.setdefault(parent, {})[number] = frozenset(signature)
        self._labels: dict[tuple[str, int], str] = {}
        self._stacks: set[str] = set()  # parents with a folded run
        for parent, signatures in by_parent.items():
            runs = fold_runs(signatures)
            if runs:
                self._stacks.add(parent)
            for run in runs:
                label = FOLDED if len(run) == len(signatures) else f"{run[0]}..{run[-1]}"
                self._labels.update(((parent, number), label) for number in run)

    def group(self, key: str) -> str:
        """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.#.mlp.up_proj``; a tensor at
        the top (no dot) is a group of its own; a key deeper than :data:`MAX_MODULE_DEPTH` is
        cut there."""
        parts = key.split(".", MAX_MODULE_DEPTH)
        if len(parts) == 1:
            return key
        return ".".join(self._label(parts, at) for at in range(len(parts) - 1))

    def _label(self, parts: list[str], at: int) -> str:
        number = block_index(parts[at])
        if number is None:
            return parts[at]
        return self._labels.get((".".join(parts[:at]), number), parts[at])

    def groups(self) -> dict[str, str]:
        """Each key given (in order) -> its group."""
        return {key: self.group(key) for key in self._keys}

    def stack(self, key: str) -> Stack | None:
        """The first block number of ``key`` under a parent with a folded run (every block
        there, folded or not, is a layer of that stack), or None."""
        parts = key.split(".", MAX_MODULE_DEPTH)
        for at in range(len(parts) - 1):
            number = block_index(parts[at])
            if number is not None and ".".join(parts[:at]) in self._stacks:
                kind = ".".join(self._label(parts, i) for i in range(at + 1, len(parts) - 1))
                return Stack(at, number, kind or parts[-1])
        return None
