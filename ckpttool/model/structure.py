"""Parts of a checkpoint found by their structure, whatever the script called them.

An optimizer's ``state_dict()`` is a mapping with a ``state`` mapping and ``param_groups`` of
dicts with ``params``; an RNG state has the shape and types of one (torch's uint8 generator
state, NumPy's MT19937 tuple or dict, Python's ``random.getstate()``, a list of CUDA generator
states); a scheduler or ``GradScaler`` state and a trainer's counters have their own fields;
the model is the one mapping of module-like dotted names to tensors that is none of these.
Each is found at any key and depth (``opt``, ``state.optimizers.Adam``, ``rng.0``).

:mod:`ckpttool.model.roles` asks this module only where names say nothing: a layout or a
framework plug-in that names its parts keeps priority. Pure functions over the reader's tree.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any

from ckpttool.model.records import OpaqueObject, TensorRecord, join_key, nodes

#: The counters of a trainer's own state (ignite's ``Engine.state_dict()``: ``iteration``,
#: ``epoch_length``, ``max_epochs``; Composer's ``timestamp``: ``epoch``, ``iteration``...): a
#: dict of scalars holding two of them is training state, not settings (a config's ``batch``
#: or a lone ``epoch`` is not enough).
TRAINER_COUNTERS = frozenset({
    "epoch", "step", "global_step", "iteration", "iter", "iter_num", "num_updates",
    "epoch_length", "max_epochs",
})  # fmt: skip
#: Bytes of torch's CPU generator state (``torch.get_rng_state()``: MT19937) and of a CUDA
#: generator's (``torch.cuda.get_rng_state()``: Philox seed and offset).
TORCH_RNG_BYTES = frozenset({5056, 16})
#: Elements of Python's ``random.getstate()[1]`` (MT19937's 624 words and the position).
PYTHON_RNG_WORDS = 625
#: How deep in dicts, lists and tuples parts are looked for (Composer's optimizer sits at
#: ``state.optimizers.<name>``, its RNG at ``rng.<rank>``).
SEARCH_DEPTH = 5
#: A character no key of a module's state dict has (they are dotted identifiers:
#: ``layers.0.attn.weight``), searched for in all the keys at once (a pattern of the whole name
#: matched per key, or once over all of them, was 0.1-0.2 s at 100,000 keys).
_NOT_IN_NAMES = re.compile(r"[^\w.\-\n]").search
#: The same for ASCII keys, deleted by ``bytes.translate`` (the search took 40 ms there).
_NAME_BYTES = (string.ascii_letters + string.digits + "_-.\n").encode()
#: An empty segment of a dotted name (the keys one a line, a line break before and after).
_EMPTY_SEGMENTS = ("\n\n", "..", "\n.", ".\n")
#: The most fields a scheduler's, scaler's or trainer's state has (a bigger dict is something
#: else: not even looked at).
_MOST_TRAINER_FIELDS = 64


@dataclass(frozen=True)
class FoundParts:
    """Where each part sits, as dotted keys ("" the whole tree), in the tree's order."""

    models: tuple[str, ...] = ()  # mappings of module names to tensors (one: the model)
    optimizers: tuple[str, ...] = ()
    rng: tuple[str, ...] = ()
    trainer: tuple[str, ...] = ()  # scheduler, GradScaler, a trainer's counters

    @property
    def model(self) -> str | None:
        """The model's key when there is exactly one candidate, else None (never a guess)."""
        return self.models[0] if len(self.models) == 1 else None

    @property
    def training_only(self) -> tuple[str, ...]:
        """What only resuming training reads: optimizers, RNG and trainer state."""
        return (*self.optimizers, *self.rng, *self.trainer)


def find_parts(root: Any) -> FoundParts:
    """The parts of ``root`` by structure (bounded by :data:`SEARCH_DEPTH`). Opaque objects are
    not looked into: what an object holds is its own business."""
    found: dict[str, list[str]] = {"models": [], "optimizers": [], "rng": [], "trainer": []}
    stack: list[tuple[str, Any, int]] = [("", root, 0)]
    while stack:
        key, node, depth = stack.pop()
        role = part_role(node)
        if role is not None:
            found[role].append(key)
            continue
        if depth >= SEARCH_DEPTH:
            continue
        if node.__class__ is dict:
            items: Any = node.items()
        elif node.__class__ in (list, tuple):
            items = enumerate(node)
        else:
            continue
        stack.extend(
            reversed([
                (join_key(key, str(name)), child, depth + 1)
                for name, child in items
                if child.__class__ in (dict, list, tuple) or isinstance(child, TensorRecord)
            ])
        )  # fmt: skip
    return FoundParts(**{role: tuple(keys) for role, keys in found.items()})


def part_role(node: Any) -> str | None:
    """``"optimizers"``, ``"rng"``, ``"trainer"`` or ``"models"`` for a node that is such a
    part as a whole, None for any other (look inside it)."""
    if is_optimizer_state(node):
        return "optimizers"
    if is_rng_state(node):
        return "rng"
    if is_trainer_state(node):
        return "trainer"
    if is_module_state_dict(node):
        return "models"
    return None


def is_optimizer_state(node: Any) -> bool:
    """Whether ``node`` is an optimizer's ``state_dict()``: a ``state`` mapping (of per-parameter
    dicts) and ``param_groups``, a list of dicts each with its ``params`` list."""
    if not isinstance(node, dict):
        return False
    state, groups = node.get("state"), node.get("param_groups")
    return (
        isinstance(state, dict)
        and set(map(type, state.values())) <= {dict}  # (at C speed: 100,000 entries happen)
        and isinstance(groups, list)
        and bool(groups)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    )


def is_rng_state(node: Any) -> bool:
    """Whether ``node`` is a random generator's state, or a collection of them: torch's uint8
    generator state (CPU, CUDA), NumPy's legacy ``get_state()`` tuple or its bit generator's
    ``state`` dict, Python's ``random.getstate()``; a dict or list of these (a dict only when
    one of them is not a bare tensor: a dict of uint8 tensors reads as a state dict)."""
    if isinstance(node, TensorRecord):
        return _is_torch_generator(node)
    if _is_numpy_state(node) or _is_python_state(node):
        return True
    if node.__class__ is dict and node:
        other = False  # a value that is not a bare tensor
        for value in node.values():  # (a state dict fails at its first float tensor)
            if value.__class__ is list and not value:
                continue  # no CUDA device: []
            if not is_rng_state(value):
                return False
            other = other or not isinstance(value, TensorRecord)
        return other
    if node.__class__ is list and node:  # torch.cuda.get_rng_state_all(), per-rank states
        return all(
            (_is_uint8_vector(v) if isinstance(v, TensorRecord) else is_rng_state(v)) for v in node
        )
    return False


def _is_uint8_vector(record: TensorRecord) -> bool:
    return record.dtype == "uint8" and len(record.shape) == 1 and record.kind != "ndarray"


def _is_torch_generator(record: TensorRecord) -> bool:
    return _is_uint8_vector(record) and record.shape[0] in TORCH_RNG_BYTES


def _is_numpy_state(node: Any) -> bool:
    """NumPy's ``RandomState.get_state()`` (``('MT19937', uint32[624], pos, has_gauss,
    cached_gaussian)``), or a bit generator's ``state`` (``{'bit_generator': 'PCG64',
    'state': {...}, ...}``; ckpttool's own keeps MT19937's ``key`` and ``pos`` beside it)."""
    if node.__class__ is tuple:
        return (
            len(node) == 5
            and isinstance(node[0], str)
            and isinstance(node[1], TensorRecord)
            and node[1].shape == (624,)
            and node[1].dtype in ("uint32", "int64", "uint64")
        )
    return (
        node.__class__ is dict
        and isinstance(node.get("bit_generator"), str)
        and ("state" in node or "key" in node)
    )


def _is_python_state(node: Any) -> bool:
    """Python's ``random.getstate()``: ``(version, 625 ints, gauss_next)``."""
    return (
        node.__class__ is tuple
        and len(node) == 3
        and isinstance(node[0], int)
        and isinstance(node[1], tuple)
        and len(node[1]) == PYTHON_RNG_WORDS
        and all(isinstance(word, int) for word in node[1])
    )


def is_trainer_state(node: Any) -> bool:
    """Whether ``node`` is training state other than an optimizer's: an LR scheduler's
    ``state_dict()`` (``last_epoch`` with ``base_lrs`` or ``_step_count``), a ``GradScaler``'s
    (``scale``, ``growth_factor``, ``backoff_factor``), or a trainer's counters (a dict of
    numbers (or small objects: a ``timedelta``) only, two of them :data:`TRAINER_COUNTERS`;
    mmengine's ``meta``, with its strings, is not one)."""
    if node.__class__ is not dict or not node or len(node) > _MOST_TRAINER_FIELDS:
        return False
    names = set(node)
    if "last_epoch" in names and ("base_lrs" in names or "_step_count" in names):
        return True
    if {"scale", "growth_factor", "backoff_factor"} <= names:
        return True
    return len(names & TRAINER_COUNTERS) >= 2 and all(
        (isinstance(value, (int, float)) and not isinstance(value, bool)) or _is_small_object(value)
        for value in node.values()
    )


def _is_small_object(value: Any) -> bool:
    """An object that holds no tensor and no container (Composer's ``timestamp`` keeps its
    wall-clock times as ``datetime.timedelta``)."""
    return isinstance(value, OpaqueObject) and not any(
        isinstance(field, (TensorRecord, dict, list, OpaqueObject))
        for field in nodes(value)
        if field is not value
    )


def is_module_state_dict(node: Any) -> bool:
    """Whether ``node`` is a module's state dict: a dict of tensors by module-like dotted names
    (a TransformerEngine ``_extra_state`` may be any value), or of such dicts nested by name;
    at least one tensor, no RNG state among them."""
    if node.__class__ is not dict or not node:
        return False
    held = False
    stack = [node]
    while stack:
        current = stack.pop()
        if not _module_names(current):
            return False
        if set(map(type, current.values())) == {TensorRecord}:
            held = True  # the usual state dict: tensors only, checked at C speed
            continue
        for name, value in current.items():
            if isinstance(value, TensorRecord):
                held = True
            elif value.__class__ is dict and value:
                if is_optimizer_state(value) or is_rng_state(value):
                    return False
                stack.append(value)
            elif not name.endswith("_extra_state"):
                return False
    return held


def _module_names(mapping: dict[Any, Any]) -> bool:
    """Whether every key of ``mapping`` is a module-like dotted name."""
    try:
        lines = "\n" + "\n".join(mapping) + "\n"
    except TypeError:  # a key that is not text
        return False
    if lines.count("\n") != len(mapping) + 1:  # a key holds a line break
        return False
    if lines.isascii():
        if lines.encode("ascii").translate(None, _NAME_BYTES):
            return False
    elif _NOT_IN_NAMES(lines) is not None:
        return False
    return not any(empty in lines for empty in _EMPTY_SEGMENTS)


__all__ = [
    "FoundParts",
    "find_parts",
    "is_module_state_dict",
    "is_optimizer_state",
    "is_rng_state",
    "is_trainer_state",
    "part_role",
]
