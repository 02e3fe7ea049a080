"""What kind of checkpoint an object tree is, and what its training state says.

Pure functions over the reader's tree: no file access, no torch. ``diff``, ``convert`` and
``rescale-step`` use :func:`detect_layout` and :func:`model_section` to find the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpttool.records import OpaqueObject, TensorRecord, children, join_key, nodes, tensors, walk

STATE_DICT = "state_dict"
MINIMIND_RESUME = "minimind_resume"
CKPTTOOL_RESUME = "ckpttool_resume"
LIGHTNING = "lightning"
SAFETENSORS = "safetensors"
NESTED = "nested_dict"
OTHER = "other"

LAYOUT_TITLES = {
    STATE_DICT: "plain state dict",
    MINIMIND_RESUME: "MiniMind-style resume checkpoint",
    CKPTTOOL_RESUME: "ckpttool resume checkpoint",
    LIGHTNING: "Lightning checkpoint",
    SAFETENSORS: "safetensors weights",
    NESTED: "nested dict",
    OTHER: "other object",
}

RESUME_KEYS = ("model", "optimizer", "epoch", "step")
#: Top-level keys under which training scripts keep the model's state dict in a dict of their
#: own: ckpttool/MiniMind (``model``), the PyTorch tutorial's general checkpoint
#: (``model_state_dict``), ``model_state``, timm and many others (``state_dict``), DeepSpeed
#: (``module``). Used when the layout itself does not say where the model is.
MODEL_PART_KEYS = ("model", "model_state_dict", "model_state", "state_dict", "module")
#: The same for the optimizer's ``state_dict()`` (a dict with ``state`` and ``param_groups``).
OPTIMIZER_PART_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state")
#: ``model_part`` for a file that is the model's weights as a whole.
WHOLE_FILE = ""
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
RNG_NAMES = ("python", "numpy", "torch", "cuda")


def detect_layout(root: Any, file_format: str) -> str:
    if file_format == "safetensors":
        return SAFETENSORS
    if not isinstance(root, dict):
        return OTHER
    if root and all(isinstance(v, TensorRecord) for v in root.values()):
        return STATE_DICT
    if all(k in root for k in RESUME_KEYS):
        return CKPTTOOL_RESUME if "rng" in root or "scheduler" in root else MINIMIND_RESUME
    if "state_dict" in root and ("pytorch-lightning_version" in root or "optimizer_states" in root):
        return LIGHTNING
    return NESTED


def is_resume(layout: str) -> bool:
    return layout in (MINIMIND_RESUME, CKPTTOOL_RESUME)


def model_section(layout: str) -> str | None:
    """The key of the model weights inside a layout (None: the whole file is the weights)."""
    if is_resume(layout):
        return "model"
    if layout == LIGHTNING:
        return "state_dict"
    return None


def model_part(root: Any, layout: str) -> str | None:
    """Where the model's weights are, for counting parameters: a top-level key, ``WHOLE_FILE``
    for a file that is a state dict, or None for a file with no model part ckpttool can name
    (a bare optimizer or RNG file, a nested dict without one of ``MODEL_PART_KEYS``, or with
    several of them)."""
    if layout in (STATE_DICT, SAFETENSORS):
        return WHOLE_FILE
    section = model_section(layout)
    if section is not None:
        return section
    if layout != NESTED or not isinstance(root, dict):
        return None
    found = [k for k in MODEL_PART_KEYS if isinstance(root.get(k), dict) and _has_tensor(root[k])]
    return found[0] if len(found) == 1 else None


def optimizer_part(root: Any, layout: str) -> str | None:
    """Where the optimizer's ``state_dict()`` is: a top-level key, ``WHOLE_FILE`` for a bare
    optimizer file (Hugging Face Trainer's ``optimizer.pt``), or None."""
    if not isinstance(root, dict):
        return None
    if _is_optimizer_state(root):
        return WHOLE_FILE
    if is_resume(layout) or layout == NESTED:
        found = [k for k in OPTIMIZER_PART_KEYS if _is_optimizer_state(root.get(k))]
        return found[0] if len(found) == 1 else None
    return None


def part_node(root: Any, part: str | None) -> Any:
    """The subtree a ``model_part``/``optimizer_part`` names (None for None)."""
    if part is None:
        return None
    return root if part == WHOLE_FILE else root.get(part)


def _has_tensor(node: Any) -> bool:
    return any(isinstance(leaf, TensorRecord) for leaf in nodes(node))


def _is_optimizer_state(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("state"), dict) and "param_groups" in node


def scalar_fields(root: Any, max_siblings: int = 64) -> dict[str, Any]:
    """Scalar values by dotted key, skipping long runs of numbers (RNG states, param lists)."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        key, node = stack.pop()
        items = list(children(node))
        if len(items) > max_siblings and all(not _is_tree(v) for _, v in items):
            continue
        for name, child in reversed(items):
            child_key = join_key(key, name)
            if _is_tree(child):
                if name != "params":
                    stack.append((child_key, child))
            elif isinstance(child, (int, float, str, bool)) or child is None:
                out[child_key] = child
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0], root)))


def _is_tree(node: Any) -> bool:
    return isinstance(node, (dict, list, tuple, OpaqueObject))


def _order(key: str, root: Any) -> tuple[int, str]:
    # top-level fields first, in the file's order; nested ones after, alphabetically
    if isinstance(root, dict) and key in root:
        return (list(root).index(key), "")
    return (1 << 30, key)


@dataclass
class OptimizerSummary:
    type_guess: str
    param_groups: list[dict[str, Any]]  # hyper-parameters (no "params"), plus "num_params"
    params_with_state: int
    state_dtypes: dict[str, int]  # dtype -> bytes
    state_bytes: int
    param_names: dict[int, str] = field(default_factory=dict)  # state index -> model key


_STATE_SIGNATURES = [
    ({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, "Adam/AdamW (amsgrad)"),
    ({"exp_avg", "exp_avg_sq"}, "Adam/AdamW"),
    ({"exp_avg", "exp_inf"}, "Adamax"),
    ({"mu_product"}, "NAdam"),
    ({"momentum_buffer"}, "SGD (momentum)"),
    ({"square_avg", "acc_delta"}, "Adadelta"),
    ({"square_avg"}, "RMSprop"),
    ({"sum"}, "Adagrad"),
    ({"prev", "step_size"}, "Rprop"),
    ({"exp_avg"}, "Lion-like (exp_avg only)"),
]


def summarize_optimizer(optimizer: Any, model: Any) -> OptimizerSummary | None:
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        return None
    state: dict[Any, Any] = optimizer["state"]
    groups_raw = optimizer.get("param_groups")
    groups_in: list[Any] = groups_raw if isinstance(groups_raw, list) else []
    state_keys: set[str] = set()
    for entry in state.values():
        if isinstance(entry, dict):
            state_keys.update(str(k) for k in entry)
    type_guess = "unknown"
    for signature, name in _STATE_SIGNATURES:
        if signature <= state_keys:
            type_guess = name
            break
    groups = []
    for group in groups_in:
        if not isinstance(group, dict):
            continue
        hyper = {str(k): v for k, v in group.items() if k != "params" and not _is_tree(v)}
        hyper.update({str(k): list(v) for k, v in group.items() if isinstance(v, tuple)})
        params = group.get("params")
        hyper["num_params"] = len(params) if isinstance(params, list) else 0
        groups.append(hyper)
    if type_guess == "Adam/AdamW" and groups:
        decoupled = groups[0].get("decoupled_weight_decay")
        if decoupled is not None:
            type_guess = "AdamW" if decoupled else "Adam"
    dtypes: dict[str, int] = {}
    for record in _tensor_leaves(state):
        dtypes[record.dtype] = dtypes.get(record.dtype, 0) + record.nbytes
    summary = OptimizerSummary(
        type_guess, groups, len(state), dtypes, sum(dtypes.values()),
    )  # fmt: skip
    summary.param_names = map_param_names(optimizer, model)
    return summary


def map_param_names(optimizer: Mapping[str, Any], model: Any) -> dict[int, str]:
    """Optimizer state index -> model parameter name, when order and shapes agree.

    ``optimizer.state_dict()`` numbers parameters in ``param_groups`` order, which is
    ``model.parameters()`` order: the state dict's floating tensors with tied ones once. Buffers
    in the state dict or a different parameter order make the mapping impossible; then this
    returns {} rather than guess.
    """
    if not isinstance(model, dict):
        return {}
    indices: list[int] = []
    for group in optimizer.get("param_groups") or []:
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            indices.extend(i for i in group["params"] if isinstance(i, int))
    candidates = [r for r in tensors(model) if r.is_floating]
    unique: list[TensorRecord] = []
    seen: set[tuple[Any, tuple[int, ...]]] = set()  # a set, not a scan: 100,000 tensors happen
    for record in candidates:
        identity = (record.storage, record.shape)
        if record.storage is None or identity not in seen:
            seen.add(identity)
            unique.append(record)
    attempts = [unique]
    tied_heads = [r for r in unique if r.key.endswith("lm_head.weight")]
    if tied_heads:  # MiniMind halves tied weights separately: the head shows up twice
        attempts.append([r for r in unique if r not in tied_heads])
    state = optimizer.get("state") or {}
    for names in attempts:
        if len(names) != len(indices):
            continue
        mapping = dict(zip(indices, (r.key for r in names)))
        shapes = {r.key: r.shape for r in names}
        if all(_state_matches(state.get(i), shapes[mapping[i]]) for i in indices):
            return mapping
    return {}


def _state_matches(entry: Any, shape: tuple[int, ...]) -> bool:
    if not isinstance(entry, dict):
        return True
    for value in entry.values():
        if isinstance(value, TensorRecord) and value.shape not in ((), shape):
            return False
    return True


def rng_present(root: Any) -> list[str]:
    """Which RNG states a checkpoint carries (ckpttool's ``rng`` dict or common top-level keys)."""
    found: list[str] = []
    rng = root.get("rng") if isinstance(root, dict) else None
    if isinstance(rng, dict):
        found.extend(str(k) for k in rng)
    if isinstance(root, dict):
        for key in root:
            if isinstance(key, str) and "rng" in key.lower() and key != "rng":
                found.append(key)
    return found


def layout_warnings(root: Any, layout: str, records: list[TensorRecord]) -> list[str]:
    warnings = []
    if is_resume(layout) and isinstance(root, dict):
        model_dtypes = {r.dtype for r in _tensor_leaves(root.get("model")) if r.is_floating}
        state_dtypes = {r.dtype for r in _tensor_leaves(root.get("optimizer"))}
        if "float16" in model_dtypes and "float32" in state_dtypes:
            warnings.append(
                "the resume file stores the model in float16 while the optimizer state is "
                "float32: resuming from it is lossy (MiniMind writes it this way); "
                "ckpttool.save_checkpoint keeps the training dtype"
            )
    wrapped = [r.key for r in records if any(p in r.key for p in WRAPPER_PREFIXES)]
    if wrapped:
        warnings.append(
            f"{len(wrapped)} keys carry DDP/torch.compile wrapper prefixes (module., _orig_mod.), "
            f"e.g. {wrapped[0]!r}: use --ignore-wrappers in diff/convert"
        )
    opaque = sorted({node.cls for node in nodes(root) if isinstance(node, OpaqueObject)})
    if opaque:
        warnings.append(
            "the pickle builds objects of classes ckpttool does not reconstruct (shown as "
            f"opaque; never imported): {', '.join(opaque)}"
        )
    return warnings


def _tensor_leaves(node: Any) -> list[TensorRecord]:
    return [leaf for leaf in nodes(node) if isinstance(leaf, TensorRecord)]


__all__ = [
    "LAYOUT_TITLES",
    "OptimizerSummary",
    "detect_layout",
    "is_resume",
    "layout_warnings",
    "model_part",
    "model_section",
    "optimizer_part",
    "part_node",
    "rng_present",
    "scalar_fields",
    "summarize_optimizer",
    "walk",
]
