"""``show --tree``: the nesting of a checkpoint, a flat state dict as its module hierarchy.

``layers.0.self_attn.q_proj.weight`` names a tensor of module ``layers.0.self_attn.q_proj``:
the keys of a state dict spell out the model's modules. :func:`module_tree` turns them into a
tree of :class:`ModuleNode`, each with its tensors, parameters and bytes (a tied weight counted
once, the same rule as ``show``'s header), and collapses runs of structurally identical
numbered blocks (``layers.0..15``) the way model summaries print them. :func:`render_text`
prints any object tree that way (``show --tree``), :func:`render_json` as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpttool.model.modules import MAX_MODULE_DEPTH, fold_runs
from ckpttool.model.modules import block_index as _index
from ckpttool.model.records import OpaqueObject, TensorRecord, children, count_once, with_key
from ckpttool.render.text import human_count, human_size, plain, plural, short


@dataclass
class ModuleNode:
    """A module (a key prefix) of a state dict, or one of its tensors."""

    name: str  # relative to the parent: "self_attn", "embed_tokens.weight", "layers.0..15"
    tensor: TensorRecord | None = None  # set for a tensor; a module has children instead
    children: list[ModuleNode] = field(default_factory=list)
    num_tensors: int = 0  # of one block
    parameters: int = 0  # elements of one block, each stored element once
    nbytes: int = 0  # of one block, each stored element once
    repeats: int = 1  # identical consecutive numbered blocks this node stands for
    # what makes two blocks identical: relative keys, dtypes and shapes of their tensors
    signature: frozenset[Any] = field(default=frozenset(), repr=False)


def is_flat_state_dict(node: Any) -> bool:
    """A dict of tensors whose keys name modules (at least one dotted key)."""
    return (
        isinstance(node, dict)
        and bool(node)
        and all(isinstance(v, TensorRecord) for v in node.values())
        and any(isinstance(k, str) and "." in k for k in node)
        and all(isinstance(k, str) and k.count(".") < MAX_MODULE_DEPTH for k in node)
    )


def module_tree(state_dict: dict[str, TensorRecord]) -> list[ModuleNode]:
    """The top-level modules and tensors of a flat state dict, in key order."""
    records = [with_key(record, key) for key, record in state_dict.items()]
    seen: set[Any] = set()
    shared: set[Any] = set()  # storages several keys view: modules holding them count apart
    for record in records:
        if record.storage is not None:
            (shared if record.storage in seen else seen).add(record.storage)
    return _build(records, 0, shared)


def _build(records: list[TensorRecord], depth: int, shared: set[Any]) -> list[ModuleNode]:
    """Nodes for ``records``, grouped by their key part at ``depth`` (first appearance order)."""
    members: dict[tuple[str, bool], list[TensorRecord]] = {}  # (name, is a tensor) -> records
    for record in records:
        parts = record.key.split(".", depth + 1)
        members.setdefault((parts[depth], len(parts) == depth + 1), []).append(record)
    nodes = []
    for (name, is_tensor), group in members.items():
        node = ModuleNode(name)
        node.num_tensors = len(group)
        if is_tensor:
            node.tensor = group[0]  # keys are unique: one record
        else:
            node.children = _build(group, depth + 1, shared)
        if is_tensor or any(r.storage in shared for r in group):
            node.parameters, by_dtype = count_once(group)
            node.nbytes = sum(by_dtype.values())
        else:  # nothing tied below: the children's sums (linear, not quadratic in depth)
            node.parameters = sum(c.parameters * c.repeats for c in node.children)
            node.nbytes = sum(c.nbytes * c.repeats for c in node.children)
        if _index(name) is not None:  # only numbered blocks are compared
            node.signature = frozenset(
                ("" if is_tensor else r.key.split(".", depth + 1)[-1], (r.dtype, tuple(r.shape)))
                for r in group
            )
        nodes.append(node)
    return [_merge_chain(node) for node in _collapse_repeats(nodes)]


def _merge_chain(node: ModuleNode) -> ModuleNode:
    """A module with one child is shown as one line: ``embed_tokens.weight``, ``layers.0..15``."""
    if node.tensor is None and node.repeats == 1 and len(node.children) == 1:
        child = node.children[0]
        child.name = f"{node.name}.{child.name}"
        return child
    return node


def _collapse_repeats(nodes: list[ModuleNode]) -> list[ModuleNode]:
    """Each run of numbered siblings that folds (:func:`ckpttool.model.modules.fold_runs`:
    consecutive numbers, the same signature) becomes one node standing for all of them
    (``0..15``, ``repeats=16``), where its first member appears; any other stays itself."""
    numbered: dict[int, ModuleNode] = {}
    clashes: set[int] = set()  # a number naming a tensor and a module: never folded
    for node in nodes:
        number = _index(node.name)
        if number is not None and numbered.setdefault(number, node) is not node:
            clashes.add(number)
    for number in clashes:
        del numbered[number]
    standing_for: dict[int, ModuleNode] = {}  # id of a run's member -> the run's node
    for run in fold_runs({number: node.signature for number, node in numbered.items()}):
        first = numbered[run[0]]
        first.name = f"{run[0]}..{run[-1]}"
        first.repeats = len(run)
        standing_for.update((id(numbered[number]), first) for number in run)
    out: list[ModuleNode] = []
    placed: set[int] = set()
    for node in nodes:
        node = standing_for.get(id(node), node)
        if id(node) not in placed:
            placed.add(id(node))
            out.append(node)
    return out


def render_text(root: Any, depth: int | None = None) -> str:
    """The nesting of the object tree. A flat state dict is shown as its module hierarchy
    (from its dotted keys), identical numbered blocks once; ``depth`` limits the levels shown.
    Only runs of more than 64 plain values (RNG states, id lists) are elided."""
    lines: list[str] = []

    def describe(node: Any) -> str:
        if isinstance(node, TensorRecord):
            return f"{node.kind} {node.dtype}{list(node.shape)}"
        if isinstance(node, ModuleNode):
            return _describe_module(node)
        if isinstance(node, OpaqueObject):
            return f"<{node.cls}>"
        if isinstance(node, (dict, list, tuple)):
            return f"{type(node).__name__}[{len(node)}]"
        return short(node)

    stack: list[tuple[int, str, Any]] = [(0, "", root)]
    while stack:
        level, name, node = stack.pop()
        label = f"{name}: " if name else ""
        lines.append("  " * level + label + describe(node))
        if depth is not None and level >= depth:
            continue
        if isinstance(node, ModuleNode):
            stack.extend((level + 1, c.name, c) for c in reversed(node.children))
        elif is_flat_state_dict(node):
            stack.extend((level + 1, c.name, c) for c in reversed(module_tree(node)))
        elif isinstance(node, (dict, list, tuple, OpaqueObject)):
            items = list(children(node))
            if len(items) > 64 and not any(
                isinstance(v, (dict, list, tuple, OpaqueObject, TensorRecord)) for _, v in items
            ):
                lines.append("  " * (level + 1) + f"... {len(items)} items")
                continue
            stack.extend((level + 1, n, c) for n, c in reversed(items))
    return "\n".join(lines)


def _describe_module(node: Any) -> str:
    """``attn: 4 tensors, 256 params, 1.0 KB``; a run of identical blocks says how many."""
    if node.tensor is not None:
        tensor = f"{node.tensor.kind} {node.tensor.dtype}{list(node.tensor.shape)}"
        return tensor if node.repeats == 1 else f"{node.repeats} × {tensor}"
    one = (
        f"{node.num_tensors} {plural(node.num_tensors, 'tensor')}, "
        f"{human_count(node.parameters)} {plural(node.parameters, 'param')}, "
        f"{human_size(node.nbytes)}"
    )
    if node.repeats == 1:
        return one
    return (
        f"{node.repeats} identical blocks of {one} each "
        f"({human_count(node.parameters * node.repeats)} params, "
        f"{human_size(node.nbytes * node.repeats)} in all)"
    )


def render_json(root: Any) -> Any:
    """``show --tree --json``: the object tree as JSON (tensors as short descriptions)."""
    return plain(root)
