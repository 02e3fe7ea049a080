"""What a PEFT adapter holds: its config's fields, and its tensors grouped by the module they adapt.

PEFT's ``get_peft_model_state_dict`` saves each adapted module ``M`` of the wrapped model as
``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (the
adapter's name, ``.default``, is dropped on save; older files keep it), an embedding as
``M.lora_embedding_A`` ``[r, num_embeddings]`` and ``M.lora_embedding_B`` ``[dim, r]``, DoRA's
magnitude as ``M.lora_magnitude_vector`` ``[out]``; a module of ``modules_to_save`` is saved
whole under its own name (``base_model.model.M.weight``), and a target's base layer under
``M.base_layer.weight`` when PEFT saves embedding layers with the adapter. Each is a full copy
that takes the base model's tensor's place when the adapter is loaded.

The scale of a module is ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), where ``r`` and
``alpha`` come from ``rank_pattern`` and ``alpha_pattern`` when a pattern matches the module
(PEFT's ``get_pattern_key``: the first key ``K`` with ``re.match(rf"(.*\\.)?({K})$", module)``),
else from ``r`` and ``lora_alpha``.

The summary is plain data in ``details["adapter"]`` (what ``show`` prints, what ``verify``
checks, what ``lora merge`` merges): no command imports this module.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ckpttool.model.records import TensorRecord, walk

#: The prefix ``PeftModel`` puts before the wrapped model's module names.
PREFIX = "base_model.model."
#: The factor tensors of a LoRA module (the part of the key after the module's name).
FACTORS = {
    "lora_A": ("linear", "A"),
    "lora_B": ("linear", "B"),
    "lora_embedding_A": ("embedding", "A"),
    "lora_embedding_B": ("embedding", "B"),
    "lora_magnitude_vector": (None, "magnitude"),
}
_FACTOR_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?!weight$|bias$)(?P<adapter>[^.]+))?(?:\.(?P<param>weight|bias))?$"
)
_BASE_LAYER = ".base_layer."
#: The config fields ``show`` reports, as PEFT names them.
CONFIG_FIELDS = (
    "peft_type", "task_type", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out",
    "bias", "rank_pattern", "alpha_pattern", "target_modules", "modules_to_save",
    "base_model_name_or_path", "peft_version",
)  # fmt: skip


def pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """The key of ``patterns`` that PEFT applies to ``module`` (``get_pattern_key``), or None."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            if module == key or module.endswith("." + key):
                return key
    return None


def module_scaling(
    config: dict[str, Any], module: str
) -> tuple[int | None, float | None, float | None]:
    """``(r, alpha, scaling)`` of ``module`` as PEFT computes them from the config."""
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    rank_key = pattern_key(ranks, module) if isinstance(ranks, dict) else None
    alpha_key = pattern_key(alphas, module) if isinstance(alphas, dict) else None
    rank = ranks[rank_key] if rank_key is not None else config.get("r")
    alpha = alphas[alpha_key] if alpha_key is not None else config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return None, None, None
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return rank, None, None
    divisor = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha), alpha / divisor


def summarize(config: Any, weights: Any) -> tuple[dict[str, Any], list[str]]:
    """``details["adapter"]`` from the parsed ``adapter_config.json`` and the adapter's tensors
    (keys as saved), and the problems: a module without both factors, ranks that disagree,
    factors whose shapes do not fit, a config PEFT could not read."""
    problems: list[str] = []
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        return {}, ["adapter_config.json: not a PEFT config (no peft_type)"]
    summary: dict[str, Any] = {name: config.get(name) for name in CONFIG_FIELDS}
    if isinstance(summary["target_modules"], list):
        summary["target_modules"] = sorted(str(name) for name in summary["target_modules"])
    summary["base_model"] = summary.pop("base_model_name_or_path")
    if config["peft_type"] == "LORA":
        rank, _, scaling = module_scaling({**config, "rank_pattern": {}, "alpha_pattern": {}}, "")
        summary["scaling"] = scaling
        if rank is None:
            problems.append(
                f"adapter_config.json: r is {config.get('r')!r}, not a positive integer"
            )
        elif scaling is None:
            problems.append(f"adapter_config.json: lora_alpha is {config.get('lora_alpha')!r}")
    records = {key: leaf for key, leaf in walk(weights) if isinstance(leaf, TensorRecord)}
    if config["peft_type"] != "LORA":  # IA3, prompt tuning...: shown by type, not grouped
        records = {}
    modules, saved, unknown = _group(records)
    summary["modules"] = [
        _module(config, name, parts, problems) for name, parts in sorted(modules.items())
    ]
    summary["saved"] = [
        {"module": module, "key": key, "shape": list(records[key].shape)}
        for key, module in sorted(saved.items())
    ]
    summary["unrecognised"] = sorted(unknown)
    if config.get("use_dora") and any(m["magnitude"] is None for m in summary["modules"]):
        missing = [m["module"] for m in summary["modules"] if m["magnitude"] is None]
        problems.append(f"use_dora is set but {missing[0]} has no lora_magnitude_vector"
                        + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))  # fmt: skip
    return summary, problems


def _group(
    records: dict[str, TensorRecord],
) -> tuple[dict[str, dict[str, TensorRecord]], dict[str, str], list[str]]:
    """Factor tensors by module; full copies (key -> the module path of the base tensor it
    replaces, with its parameter name); keys of factors PEFT's merge does not use (biases)."""
    modules: dict[str, dict[str, TensorRecord]] = {}
    saved: dict[str, str] = {}
    unknown: list[str] = []
    for key, record in records.items():
        name = key.removeprefix(PREFIX)
        match = _FACTOR_KEY.match(name)
        if match is None:
            saved[key] = name.replace(_BASE_LAYER, ".")  # base_layer.weight: the module's weight
        elif match["param"] == "bias":
            unknown.append(key)  # lora_bias: a bias on lora_B
        else:
            modules.setdefault(match["module"], {})[match["part"]] = record
    return modules, saved, unknown


def _module(
    config: dict[str, Any], name: str, parts: dict[str, TensorRecord], problems: list[str]
) -> dict[str, Any]:
    """One adapted module: its factors (by key), rank, scale and shapes, with its problems."""
    kinds = {FACTORS[part][0] for part in parts if FACTORS[part][0] is not None}
    kind = kinds.pop() if len(kinds) == 1 else "linear"
    a = parts.get("lora_embedding_A" if kind == "embedding" else "lora_A")
    b = parts.get("lora_embedding_B" if kind == "embedding" else "lora_B")
    magnitude = parts.get("lora_magnitude_vector")
    rank, alpha, scaling = module_scaling(config, name)
    entry: dict[str, Any] = {
        "module": name,
        "kind": kind,
        "rank": rank,
        "alpha": alpha,
        "scaling": scaling,
        "lora_A": a.key if a is not None else None,
        "lora_B": b.key if b is not None else None,
        "magnitude": magnitude.key if magnitude is not None else None,
        "in_features": None,
        "out_features": None,
    }
    if a is None or b is None:
        problems.append(f"{name}: has {'lora_B' if a is None else 'lora_A'} but no "
                        f"{'lora_A' if a is None else 'lora_B'}")  # fmt: skip
        return entry
    if len(a.shape) < 2 or len(b.shape) < 2:
        problems.append(
            f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not matrices"
        )
        return entry
    if a.shape[0] != b.shape[1]:
        problems.append(
            f"{name}: rank mismatch: lora_A {list(a.shape)} has rank {a.shape[0]}, "
            f"lora_B {list(b.shape)} has rank {b.shape[1]}"
        )
        return entry
    if rank is not None and a.shape[0] != rank:
        problems.append(f"{name}: the config gives rank {rank}, the factors have {a.shape[0]}")
    if kind == "embedding":  # A [r, num_embeddings], B [dim, r]: the delta is (B @ A).T
        entry["in_features"], entry["out_features"] = b.shape[0], a.shape[1]
    else:
        entry["in_features"], entry["out_features"] = a.shape[1], b.shape[0]
    if magnitude is not None and list(magnitude.shape) not in ([b.shape[0]], [1, b.shape[0]]):
        problems.append(f"{name}: lora_magnitude_vector {list(magnitude.shape)} does not fit "
                        f"lora_B's {b.shape[0]} outputs")  # fmt: skip
    return entry
