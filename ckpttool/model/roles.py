"""Roles: what kind of checkpoint an object tree is, and what each of its parts is for.

A *role* is what a tree, or a part of it, is for in training, whatever the script called it:
the whole tree is a plain state dict, a resume checkpoint, a Lightning checkpoint, a bare
optimizer state...; its parts are the model, the optimizer, the EMA weights, the counters, the
RNG state. The role of a whole tree is the value every ``--json`` output reports under the key
``"layout"`` (:data:`LAYOUT_TITLES`: the JSON key and its values keep that name; here and in
the code that asks, "role" and "layout" name the same thing). It is not how the bytes are
stored (a checkpoint's ``format``: :mod:`ckpttool.formats`), nor how a framework lays out a
directory (:mod:`ckpttool.frameworks`), nor a tensor's strides.

Pure functions over the reader's tree: no file access, no torch. ``diff``, ``convert`` and
``rescale-step`` use :func:`detect_layout` and :func:`model_section` to find the weights.
Names decide first (a layout's, :data:`MODEL_PART_KEYS`, :data:`OPTIMIZER_PART_KEYS`); where
they say nothing, :mod:`ckpttool.model.structure` finds the parts by what they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpttool.model.data_records import is_data_record
from ckpttool.model.records import (
    OpaqueObject,
    TensorRecord,
    children,
    get_path,
    join_key,
    nodes,
    object_classes,
    tensor_subclasses,
    tensors,
    walk,
)
from ckpttool.model.structure import FoundParts, find_parts

STATE_DICT = "state_dict"
MINIMIND_RESUME = "minimind_resume"
CKPTTOOL_RESUME = "ckpttool_resume"  # written by ckpttool.save_checkpoint (its RNG state says so)
RESUME = "resume_checkpoint"  # the same keys plus a scheduler or RNG state someone else saved
LIGHTNING = "lightning"
SAFETENSORS = "safetensors"
NESTED = "nested_dict"
OTHER = "other"
# Recognised by the roles of their parts, whatever the script called them:
TRAINING = "training_checkpoint"  # a dict with one model part (+ optimizer, counters...)
OPTIMIZER_STATE = "optimizer_state"  # a bare optimizer.state_dict() (Trainer's optimizer.pt)
SCHEDULER_STATE = "scheduler_state"  # a bare LR scheduler state_dict() (scheduler.pt)
SCALER_STATE = "scaler_state"  # a bare GradScaler state_dict() (scaler.pt)
PICKLED_MODULE = "pickled_module"  # torch.save(model): the reader gives its state-dict names
# Directories of several files, named by ckpttool.frameworks.base:
HF_MODEL = "hf_model"
HF_TRAINER = "hf_trainer"
ACCELERATE = "accelerate"
DEEPSPEED = "deepspeed"  # a ZeRO save dir or tag dir: ckpttool.frameworks.deepspeed.files
PEFT_ADAPTER = "peft_adapter"  # adapter_config.json + adapter_model.*: ckpttool.frameworks.peft
RANK_SET = "rank_set"  # per-rank state dicts of DTensors: ckpttool.frameworks.rank_set
LIGHTNING_SHARDED = "lightning_sharded"  # DCP + meta.pt: ckpttool.frameworks.lightning_sharded
TORCHTITAN = "torchtitan"  # a step-N/ DCP directory: ckpttool.frameworks.torchtitan
TORCHTUNE = "torchtune"  # epoch_N/ or the flat 0.2-0.3 files: ckpttool.frameworks.torchtune
MEGATRON_DIST = "megatron_torch_dist"  # ckpttool.frameworks.megatron: DCP + common.pt
MEGATRON_LEGACY = "megatron_legacy"  # ckpttool.frameworks.megatron: mp_rank_XX[_YYY]/ shards
SENTENCE_TRANSFORMERS = "sentence_transformers"  # modules.json: frameworks.sentence_transformers
DIFFUSERS_MODEL = "diffusers_model"  # config.json + diffusion_pytorch_model*: frameworks.diffusers
DIFFUSERS_EMA = "diffusers_ema"  # EMAModel.save_pretrained: frameworks.diffusers
DIFFUSERS_PIPELINE = "diffusers_pipeline"  # model_index.json + components: frameworks.diffusers
CHECKPOINT_PARTS = "checkpoint_parts"  # a zip or folder of checkpoint files: frameworks.container
DECLARED_LAYOUTS = (
    HF_MODEL, HF_TRAINER, ACCELERATE, DEEPSPEED, PEFT_ADAPTER, PICKLED_MODULE, RANK_SET,
    LIGHTNING_SHARDED, TORCHTITAN, TORCHTUNE, MEGATRON_DIST, MEGATRON_LEGACY,
    SENTENCE_TRANSFORMERS, DIFFUSERS_MODEL, DIFFUSERS_EMA, DIFFUSERS_PIPELINE, CHECKPOINT_PARTS,
)  # fmt: skip

LAYOUT_TITLES = {
    STATE_DICT: "plain state dict",
    MINIMIND_RESUME: "MiniMind-style resume checkpoint",
    CKPTTOOL_RESUME: "ckpttool resume checkpoint",
    RESUME: "resume checkpoint",
    LIGHTNING: "Lightning checkpoint",
    SAFETENSORS: "safetensors weights",
    NESTED: "nested dict",
    OTHER: "other object",
    TRAINING: "training checkpoint",
    OPTIMIZER_STATE: "optimizer state dict",
    SCHEDULER_STATE: "LR scheduler state dict",
    SCALER_STATE: "GradScaler state dict",
    PICKLED_MODULE: "pickled nn.Module (torch.save(model)), read as its state dict",
    HF_MODEL: "Hugging Face model directory",
    HF_TRAINER: "Hugging Face Trainer checkpoint",
    ACCELERATE: "accelerate save_state folder",
    DEEPSPEED: "DeepSpeed checkpoint",
    PEFT_ADAPTER: "PEFT adapter",
    RANK_SET: "set of per-rank state dicts (assembled)",
    LIGHTNING_SHARDED: "Lightning sharded checkpoint (DCP + meta.pt)",
    TORCHTITAN: "torchtitan checkpoint (step-N DCP directory)",
    TORCHTUNE: "torchtune checkpoint",
    MEGATRON_DIST: "Megatron torch_dist checkpoint",
    MEGATRON_LEGACY: "Megatron legacy checkpoint (mp_rank shards)",
    SENTENCE_TRANSFORMERS: "sentence-transformers model folder",
    DIFFUSERS_MODEL: "diffusers model folder",
    DIFFUSERS_EMA: "diffusers EMAModel save",
    DIFFUSERS_PIPELINE: "diffusers pipeline folder",
    CHECKPOINT_PARTS: "checkpoint files as named parts (a zip or folder of them)",
}

RESUME_KEYS = ("model", "optimizer", "epoch", "step")
#: Top-level keys under which training scripts keep the model's state dict in a dict of their
#: own: ckpttool/MiniMind (``model``), the PyTorch tutorial's general checkpoint
#: (``model_state_dict``), ``model_state``, timm and many others (``state_dict``), DeepSpeed
#: (``module``). Used when the layout itself does not say where the model is.
MODEL_PART_KEYS = (
    "model", "model_state_dict", "model_state", "state_dict", "module", "net", "network",
)  # fmt: skip
#: Where a script keeps an exponential moving average of the weights: the model part only when
#: no key above names one (a file with both has its EMA shown as one more tensor group).
EMA_PART_KEYS = ("ema", "model_ema", "ema_state_dict", "ema_model")
#: Counters a training script stores beside its state dicts.
COUNTER_KEYS = (
    "epoch", "step", "global_step", "global_steps", "iteration", "iter", "iter_num",
    "num_updates", "consumed_samples", "samples_seen", "global_samples",
)  # fmt: skip
#: The counters of :data:`COUNTER_KEYS` that count optimizer steps, in the order they are
#: trusted: Lightning and the Trainer (``global_step``), DeepSpeed, most scripts (``step``),
#: mmengine (``iter``), nanoGPT (``iter_num``), fairseq (``num_updates``).
STEP_KEYS = ("global_step", "global_steps", "step", "iteration", "iter", "iter_num", "num_updates")
#: The same for the optimizer's ``state_dict()`` (a dict with ``state`` and ``param_groups``).
OPTIMIZER_PART_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state")
#: ``model_part`` for a file that is the model's weights as a whole.
WHOLE_FILE = ""
#: What DDP (``module.``) and ``torch.compile`` (``_orig_mod.``) put before every key of the
#: model they wrap, once per wrapper (``module._orig_mod.``). The one table: keys.py uses it.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# one regex match per key (a generator of ``in`` tests per key was 0.1 s at 100,000 keys); a
# wrapper's prefix leads the key: in a state dict, or below its part (``model.module.``) in a
# file of several parts. Elsewhere it is a name (``convolution_module.``, ``blocks.module.``).
_WRAPPER = "(?:" + "|".join(map(re.escape, WRAPPER_PREFIXES)) + ")"
_has_wrapper_prefix = re.compile(_WRAPPER).match
_has_wrapper_prefix_in_part = re.compile(r"(?:[^.]*\.)?" + _WRAPPER).match
RNG_NAMES = ("python", "numpy", "torch", "cuda")


def layout_of(ckpt: Any) -> str:
    """The layout of an opened :class:`~ckpttool.checkpoint.Checkpoint` (a directory or a pickled
    module says its own; a single file's tree is recognised by :func:`detect_layout`)."""
    return detect_layout(ckpt.root, ckpt.format, ckpt.details.get("layout"))


def detect_layout(root: Any, file_format: str, declared: Any = None) -> str:
    if declared in DECLARED_LAYOUTS:
        return str(declared)
    if file_format == "safetensors":
        return SAFETENSORS
    if not isinstance(root, dict):
        return OTHER
    if root and all(isinstance(v, TensorRecord) for v in root.values()):
        return STATE_DICT
    if all(k in root for k in RESUME_KEYS):
        if _saved_by_ckpttool(root):
            return CKPTTOOL_RESUME
        return RESUME if "rng" in root or "scheduler" in root else MINIMIND_RESUME
    if "state_dict" in root and ("pytorch-lightning_version" in root or "optimizer_states" in root):
        return LIGHTNING
    if _is_optimizer_state(root):
        return OPTIMIZER_STATE
    if "last_epoch" in root and ("base_lrs" in root or "_step_count" in root):
        return SCHEDULER_STATE
    if {"scale", "growth_factor", "backoff_factor"} <= set(root):
        return SCALER_STATE
    if _find_model_key(root) is not None or structural_parts(root).model:
        return TRAINING
    return NESTED


def structural_parts(root: Any) -> FoundParts:
    """The parts of a dict of parts found by their structure (:mod:`ckpttool.model.structure`),
    where its names say nothing: the model only beside an optimizer, RNG or trainer state (a
    dict of weights and settings alone stays a nested dict, as it always read)."""
    if not isinstance(root, dict):
        return FoundParts()
    parts = find_parts(root)
    if parts.models and not parts.training_only:
        return FoundParts(trainer=parts.trainer)
    return parts


def _saved_by_ckpttool(root: dict[Any, Any]) -> bool:
    """Whether a resume dict carries what only ``ckpttool.save_checkpoint`` writes: MiniMind's
    ``world_size`` and ``wandb_id`` beside an ``rng`` made by ``capture_rng_state`` (Python,
    torch, and NumPy's state as a dict with its MT19937 ``key``). ckpttool writes no other
    marker; a ``scheduler`` key alone is anybody's."""
    rng = root.get("rng")
    numpy_state = rng.get("numpy") if isinstance(rng, dict) else None
    return (
        "world_size" in root
        and "wandb_id" in root
        and isinstance(rng, dict)
        and {"python", "torch"} <= set(rng)
        and isinstance(numpy_state, dict)
        and {"bit_generator", "key", "pos"} <= set(numpy_state)
    )


def is_resume(layout: str) -> bool:
    return layout in (MINIMIND_RESUME, CKPTTOOL_RESUME, RESUME)


def model_section(layout: str, root: Any = None) -> str | None:
    """The key of the model weights inside a layout (None: the whole file is the weights, or
    no part of it is; :func:`model_part` tells those apart)."""
    if is_resume(layout) or layout in (
        HF_MODEL, HF_TRAINER, ACCELERATE, PEFT_ADAPTER, LIGHTNING_SHARDED, TORCHTITAN, TORCHTUNE,
        MEGATRON_DIST, MEGATRON_LEGACY, SENTENCE_TRANSFORMERS, DIFFUSERS_MODEL, DIFFUSERS_EMA,
        DIFFUSERS_PIPELINE,
    ):  # fmt: skip
        return "model"
    if layout == LIGHTNING:
        return "state_dict"
    if layout == DEEPSPEED:  # the module's weights (ZeRO-0 holds them all; convert of ZeRO-1..3
        return "model_states.module"  # consolidates the fp32 master weights instead)
    if layout == TRAINING:
        named = _find_model_key(root)
        return named if named is not None else structural_parts(root).model or None
    return None


def model_part(root: Any, layout: str) -> str | None:
    """Where the model's weights are, for counting parameters: a top-level key, ``WHOLE_FILE``
    for a file that is a state dict, or None for a file with no model part ckpttool can name
    (a bare optimizer or RNG file, a nested dict without one of ``MODEL_PART_KEYS``, or with
    several of them)."""
    if layout in (STATE_DICT, SAFETENSORS, PICKLED_MODULE, RANK_SET):
        return WHOLE_FILE
    section = model_section(layout, root)
    if section is not None and isinstance(root, dict):
        try:
            get_path(root, section)
        except KeyError:
            return None
        return section
    return None


def module_state_dict(root: Any) -> dict[str, TensorRecord] | None:
    """The state dict of a pickled ``nn.Module`` (``torch.save(model)``), as
    ``model.state_dict()`` names it: parameters, then persistent buffers, of each module in
    ``_modules`` order. None when ``root`` is not such a module."""
    if not is_pickled_module(root):
        return None
    out: dict[str, TensorRecord] = {}
    stack: list[tuple[str, OpaqueObject]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        state = module.state
        skipped = state.get("_non_persistent_buffers_set")
        non_persistent = skipped if isinstance(skipped, (set, frozenset, list, tuple)) else ()
        for group in ("_parameters", "_buffers"):
            tensors_in = state.get(group)
            for name, value in tensors_in.items() if isinstance(tensors_in, dict) else ():
                if isinstance(value, TensorRecord) and not (
                    group == "_buffers" and name in non_persistent
                ):
                    out[prefix + str(name)] = value
        children_in = state.get("_modules")
        submodules = children_in.items() if isinstance(children_in, dict) else ()
        stack.extend(reversed([
            (f"{prefix}{name}.", child) for name, child in submodules if is_pickled_module(child)
        ]))  # fmt: skip
    return out


@dataclass
class ModuleView:
    """A tree whose pickled ``nn.Module`` objects read as their state dicts (``root``), with
    the class of each by its dotted key (``""``: the whole file is one module)."""

    root: Any
    classes: dict[str, str]


def module_view(root: Any) -> ModuleView | None:
    """``root`` with every pickled ``nn.Module`` replaced by its :func:`module_state_dict`:
    the file itself (``torch.save(model)``), or a value in its dicts, lists and tuples
    (ultralytics' ``{'model': model, 'ema': ema, 'epoch': ...}``). Other objects are not
    looked into: a module an object holds is that object's business. None when the tree
    holds no module (the usual case: nothing copied)."""
    classes: dict[str, str] = {}

    def view(node: Any, key: str) -> Any:
        state_dict = module_state_dict(node)
        if state_dict is not None:
            classes[key] = str(node.cls)
            return state_dict
        if node.__class__ is dict:
            return {name: view(value, join_key(key, str(name))) for name, value in node.items()}
        if node.__class__ in (list, tuple):
            items = [view(value, join_key(key, str(i))) for i, value in enumerate(node)]
            return items if node.__class__ is list else tuple(items)
        return node

    if not _holds_module(root, depth=0):
        return None
    viewed = view(root, "")
    return ModuleView(viewed, classes)


def _holds_module(node: Any, depth: int) -> bool:
    """Whether a module is found where :func:`module_view` looks (bounded: containers nest
    only so deep in a checkpoint's top levels; modules sit at its top)."""
    if is_pickled_module(node):
        return True
    if depth >= _MODULE_SEARCH_DEPTH:
        return False
    if node.__class__ is dict:
        values: Any = node.values()
    elif node.__class__ in (list, tuple):
        values = node
    else:
        return False
    # a plain leaf is neither a module nor a container (bench/object_table.py: 525,000 of them)
    return any(
        _holds_module(value, depth + 1) for value in values if value.__class__ not in _NOT_MODULES
    )


#: Exact classes of leaves that neither are nor hold a pickled module.
_NOT_MODULES = frozenset({int, float, str, bool, type(None), bytes, TensorRecord})


#: How deep in dicts and lists a pickled module is looked for: ultralytics keeps it at the
#: top (``model``, ``ema``), wrappers one or two levels down; a state dict's tensors are leaves.
_MODULE_SEARCH_DEPTH = 4


def is_pickled_module(node: Any) -> bool:
    """Whether ``node`` is an ``nn.Module`` as pickled, whatever its class: an object whose
    state has the ``_parameters`` and ``_modules`` dicts of ``nn.Module.__dict__``."""
    return (
        isinstance(node, OpaqueObject)
        and isinstance(node.state, dict)
        and isinstance(node.state.get("_parameters"), dict)
        and isinstance(node.state.get("_modules"), dict)
    )


def scalar_tensors(root: Any, layout: str) -> dict[str, TensorRecord]:
    """Top-level 0-d tensors of a training checkpoint beside its model part: values a script
    kept as tensors (nanoGPT's ``best_val_loss``, ``torch.tensor(3.2)`` after its first eval),
    training state like ``iter_num``, not weights. Empty for a file that is the weights."""
    if not isinstance(root, dict) or model_part(root, layout) in (None, WHOLE_FILE):
        return {}
    return {
        key: value
        for key, value in root.items()
        if isinstance(key, str) and isinstance(value, TensorRecord) and value.shape == ()
    }


def _find_model_key(root: Any) -> str | None:
    """The one top-level key of ``MODEL_PART_KEYS`` (else of ``EMA_PART_KEYS``) holding a dict
    of tensors; None when there is none, or more than one to choose from."""
    if not isinstance(root, dict):
        return None
    for names in (MODEL_PART_KEYS, EMA_PART_KEYS):
        found = [k for k in names if isinstance(root.get(k), dict) and _has_tensor(root[k])]
        if found:
            return found[0] if len(found) == 1 else None
    return None


def optimizer_part(root: Any, layout: str) -> str | None:
    """Where the optimizer's ``state_dict()`` is: a top-level key, ``WHOLE_FILE`` for a bare
    optimizer file (Hugging Face Trainer's ``optimizer.pt``), or None."""
    if not isinstance(root, dict):
        return None
    if _is_optimizer_state(root):
        return WHOLE_FILE
    if is_resume(layout) or layout in (NESTED, TRAINING, HF_TRAINER, ACCELERATE):
        found = [k for k in OPTIMIZER_PART_KEYS if _is_optimizer_state(root.get(k))]
        if found:
            return found[0] if len(found) == 1 else None
        # named by no key of OPTIMIZER_PART_KEYS: the one optimizer state by its structure
        # (a learner's ``opt``, Composer's ``state.optimizers.Adam``)
        by_structure = find_parts(root).optimizers
        return by_structure[0] if len(by_structure) == 1 else None
    return None


def part_node(root: Any, part: str | None) -> Any:
    """The subtree a ``model_part``/``optimizer_part`` names (None for None): a top-level key,
    or a dotted path to a part found deeper (``state.model``)."""
    if part is None:
        return None
    if part == WHOLE_FILE:
        return root
    if part in root:
        return root[part]
    try:
        return get_path(root, part)
    except KeyError:
        return None


def with_part(root: dict[Any, Any], part: str, value: Any) -> dict[Any, Any]:
    """``root`` with the part at ``part`` (a top-level key or a dotted path of dict keys)
    replaced by ``value``; the dicts on the way are copied, the rest shared."""
    if part in root or "." not in part:
        return {key: (value if key == part else old) for key, old in root.items()}
    head, rest = part.split(".", 1)
    for key, child in root.items():
        if str(key) == head and isinstance(child, dict):
            return {k: (with_part(child, rest, value) if k == key else v) for k, v in root.items()}
    raise KeyError(part)


def _has_tensor(node: Any) -> bool:
    return any(isinstance(leaf, TensorRecord) for leaf in nodes(node))


def _is_optimizer_state(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("state"), dict) and "param_groups" in node


_TREES = (dict, list, tuple, OpaqueObject)
_SCALARS = (int, float, str, bool)
#: The exact classes of most leaves, tested before ``isinstance`` (bench/object_table.py: a
#: table of 150,000 small objects has half a million scalar fields)
_SCALAR_CLASSES = frozenset({int, float, str, bool, type(None)})


def scalar_fields(
    root: Any, max_siblings: int = 64, *, below: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """Scalar values by dotted key, skipping long runs of numbers (RNG states, param lists).

    Top-level fields come first, in the file's order; nested ones after, sorted by key.
    ``below``: the keys of the containers to look into (the root's is ""); without it, all.
    What it leaves out is left out of the same result, in the same order (``show``'s text
    needs only a few fields, bench/object_table.py's table half a million).
    """
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", root)]
    scalar_classes = _SCALAR_CLASSES
    while stack:
        key, node = stack.pop()
        # a dict's own items (``children`` makes every name text: only some need it)
        items = list(node.items() if node.__class__ is dict else children(node))
        if len(items) > max_siblings and not any(isinstance(v, _TREES) for _, v in items):
            continue
        prefix = f"{key}." if key else ""
        for name, child in reversed(items):
            if name.__class__ is not str:
                name = str(name)
            if child.__class__ in scalar_classes:
                out[prefix + name] = child
            elif isinstance(child, _TREES):
                if name != "params" and (below is None or below(prefix + name)):
                    stack.append((prefix + name, child))
            elif isinstance(child, _SCALARS):
                out[prefix + name] = child
    if not isinstance(root, dict):
        return {key: out[key] for key in sorted(out)}
    position = {key: index for index, key in enumerate(root)}
    top = sorted((key for key in out if key in position), key=position.__getitem__)
    nested = sorted(key for key in out if key not in position)
    return {key: out[key] for key in top + nested}


def _is_tree(node: Any) -> bool:
    return isinstance(node, _TREES)


@dataclass
class OptimizerSummary:
    type_guess: str
    param_groups: list[dict[str, Any]]  # hyper-parameters (no "params"), plus "num_params"
    params_with_state: int
    state_dtypes: dict[str, int]  # dtype -> bytes
    state_bytes: int
    param_names: dict[int, str] = field(default_factory=dict)  # state index -> model key
    # how param_names was found: "order" (model.parameters() order, as a hand-written loop or
    # accelerate builds it), or "decay groups" (the Hugging Face Trainer's weight-decay split)
    mapping_rule: str = ""


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
    summary.param_names, summary.mapping_rule = map_param_names(optimizer, model)
    return summary


#: Substrings of parameter names the Hugging Face Trainer puts in its no-weight-decay group
#: (``get_decay_parameter_names``: biases and the weights of normalisation layers).
NO_DECAY_NAMES = ("bias", "norm")


def map_param_names(optimizer: Mapping[str, Any], model: Any) -> tuple[dict[int, str], str]:
    """Optimizer state index -> model parameter name, when order and shapes agree, and the rule
    that gave it.

    ``optimizer.state_dict()`` numbers parameters in ``param_groups`` order. A hand-written loop
    (and accelerate) puts them in ``model.parameters()`` order: the state dict's floating
    tensors with tied ones once ("order"). The Hugging Face Trainer makes two groups, the
    parameters with weight decay then those without (biases, norm weights), each in model order
    ("decay groups"). Every state entry's shapes must match its parameter's; buffers in the
    state dict or another order make the mapping impossible, and then this returns {} rather
    than guess.
    """
    if not isinstance(model, dict):
        return {}, ""
    groups: list[list[int]] = []
    for group in optimizer.get("param_groups") or []:
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            groups.append([i for i in group["params"] if isinstance(i, int)])
    indices = [i for group_indices in groups for i in group_indices]
    candidates = [r for r in tensors(model) if r.is_floating]
    unique: list[TensorRecord] = []
    seen: set[tuple[Any, tuple[int, ...]]] = set()  # a set, not a scan: 100,000 tensors happen
    for record in candidates:
        identity = (record.storage, record.shape)
        if record.storage is None or identity not in seen:
            seen.add(identity)
            unique.append(record)
    attempts = [("order", unique)]
    tied_heads = [r for r in unique if r.key.endswith("lm_head.weight")]
    if tied_heads:  # MiniMind halves tied weights separately: the head shows up twice
        attempts.append(("order", [r for r in unique if r not in tied_heads]))
    if len(groups) == 2:
        for _, names in list(attempts):
            no_decay = [r for r in names if any(n in r.key.lower() for n in NO_DECAY_NAMES)]
            decay = [r for r in names if r not in no_decay]
            if len(decay) == len(groups[0]):
                attempts.append(("decay groups", decay + no_decay))
    state = optimizer.get("state") or {}
    for rule, names in attempts:
        if len(names) != len(indices):
            continue
        mapping = dict(zip(indices, (r.key for r in names)))
        shapes = {r.key: r.shape for r in names}
        if all(_state_matches(state.get(i), shapes[mapping[i]]) for i in indices):
            return mapping, rule
    return {}, ""


def _state_matches(entry: Any, shape: tuple[int, ...]) -> bool:
    if not isinstance(entry, dict):
        return True
    for value in entry.values():
        if isinstance(value, TensorRecord) and value.shape not in ((), shape):
            return False
    return True


def rng_present(root: Any) -> list[str]:
    """Which RNG states a checkpoint carries: ckpttool's ``rng`` dict or common top-level keys,
    else where RNG states sit by their structure (Composer's ``rng`` list of per-rank states)."""
    found: list[str] = []
    rng = root.get("rng") if isinstance(root, dict) else None
    if isinstance(rng, dict):
        found.extend(str(k) for k in rng)
    if isinstance(root, dict):
        for key in root:
            if isinstance(key, str) and "rng" in key.lower() and key != "rng":
                found.append(key)
        if not found:
            found.extend(key for key in find_parts(root).rng if key)
    return found


def layout_warnings(
    root: Any, layout: str, records: list[TensorRecord], *, objects: bool = True
) -> list[str]:
    """What ``show`` warns of a tree: a lossy resume file, wrapper prefixes, classes it does
    not reconstruct (``objects`` False: the tree is known to hold no opaque object)."""
    warnings = []
    if is_resume(layout) and isinstance(root, dict):
        model_dtypes = {r.dtype for r in _tensor_leaves(root.get("model")) if r.is_floating}
        if "float16" in model_dtypes and any(  # the optimizer's state only when it matters
            r.dtype == "float32" for r in _tensor_leaves(root.get("optimizer"))
        ):
            warnings.append(
                "the resume file stores the model in float16 while the optimizer state is "
                "float32: resuming from it is lossy (MiniMind writes it this way); "
                "ckpttool.save_checkpoint keeps the training dtype"
            )
    # DeepSpeed's model-states files keep the weights under the key "module" itself
    part = model_part(root, layout)
    wrapped_key: Callable[[str], Any] = _has_wrapper_prefix if part == WHOLE_FILE else (
        _has_wrapper_prefix_in_part
    )  # fmt: skip
    if part and "." in part:  # a part found deeper (Composer's state.model.module.*)
        below = len(part) + 1

        def wrapped_key(key: str) -> Any:
            return key.startswith(f"{part}.") and _has_wrapper_prefix(key, below)

    wrapped = [] if layout == DEEPSPEED else [r.key for r in records if wrapped_key(r.key)]
    if wrapped:
        warnings.append(
            f"{len(wrapped)} keys carry DDP/torch.compile wrapper prefixes (module., _orig_mod.), "
            f"e.g. {wrapped[0]!r}: use --ignore-wrappers in diff/convert"
        )
    opaque = [cls for cls in object_classes(root) if not is_data_record(cls)] if objects else []
    if opaque:  # (most files have none: no second walk of their tree)
        read = {obj.cls for obj in tensor_subclasses(root).values()}  # inner tensors are read
        opaque = sorted(cls for cls in opaque if cls not in read)
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
    "STEP_KEYS",
    "OptimizerSummary",
    "detect_layout",
    "is_pickled_module",
    "is_resume",
    "layout_of",
    "layout_warnings",
    "model_part",
    "model_section",
    "module_state_dict",
    "module_view",
    "optimizer_part",
    "part_node",
    "rng_present",
    "scalar_fields",
    "scalar_tensors",
    "summarize_optimizer",
    "walk",
]
