"""``average``/``merge`` of LoRA adapters: one adapter whose delta is the combination of theirs.

A LoRA module's delta is ``s B A`` (``s``: its scale), and a linear combination of deltas,
``sum_i c_i s_i B_i A_i``, is exactly one LoRA of the summed rank: ``A = [c_1 s_1 A_1; ...]``
(rows stacked), ``B = [B_1 ... B_n]`` (columns side by side), scale 1 (``lora_alpha = r`` per
module). That is PEFT's ``add_weighted_adapter(..., combination_type="cat")``. Averaging
``lora_A`` and ``lora_B`` separately instead gives ``mean(B) mean(A)``, which is not the mean
of the deltas. A module some adapters do not adapt gets only the others' parts (their delta
there is 0); a full copy (``modules_to_save``) is combined as the weights it replaces, so every
adapter must hold it. The coefficients sum to 1 (a mean, or task arithmetic), so the output
model is the same combination of the adapted models.

Methods that are not linear in the deltas (TIES, SLERP) and DoRA (its magnitude rescales the
merged weight) cannot be written as an adapter: refused, naming what to do instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.lora.extract import CONFIG_NAME, PREFIX, check_output, write_adapter
from ckpttool.commands.lora.merge import ADAPTER, Adapter, read_adapter
from ckpttool.errors import InputError

#: What to do instead, for a combination an adapter cannot hold.
MERGE_FIRST = (
    "merge each adapter into its base first (ckpttool lora merge BASE ADAPTER -o MODEL/) "
    "and combine the models"
)


@dataclass
class CombinedAdapter:
    """What :func:`combine_adapters` wrote."""

    output: Path
    tensors: int  # tensors written (factors and full copies)
    modules: int  # LoRA modules
    rank: int  # the largest module's rank (the sum of the inputs' there)
    notes: list[str] = field(default_factory=list)


def is_adapter(path: str) -> bool:
    """``path`` is a local directory whose checkpoint, as the door reads it, is an adapter (a
    folder that also holds a whole model, as torchtune's ``epoch_N/``, is its model)."""
    if not (Path(path) / CONFIG_NAME).is_file():
        return False  # (no adapter config: no need to open it)
    with open_checkpoint(path) as ckpt:
        return isinstance(ckpt.details.get(ADAPTER), dict)


def all_adapters(paths: Sequence[str]) -> bool:
    """True when every input is an adapter directory, False when none is; a mix is refused."""
    found = [is_adapter(p) for p in paths]
    if any(found) and not all(found):
        adapter = paths[found.index(True)]
        model = paths[found.index(False)]
        raise InputError(
            f"{adapter} is a LoRA adapter and {model} is not: adapters combine with adapters "
            f"only; {MERGE_FIRST}"
        )
    return all(found)


def refuse_options(*, dtype: str, pattern: str | None, map_name: str | None,
                   like_input: bool) -> None:  # fmt: skip
    """The options that do not apply to adapters, refused in one line."""
    given = [
        name
        for name, used in (
            ("--filter", pattern is not None),
            ("--map", map_name is not None),
            ("--like-input", like_input),
            (f"--dtype {dtype}", dtype not in ("keep", "fp32")),
        )
        if used
    ]
    if given:
        raise InputError(
            f"{given[0]} is not for LoRA adapters: they combine into one adapter directory, its "
            "factors in float32, under PEFT's names"
        )


def combine_adapters(
    paths: Sequence[str],
    names: Sequence[str],
    coefficients: Sequence[float],
    output: str | os.PathLike[str],
    *,
    provenance: tuple[str, dict[str, object]],
    force: bool,
) -> CombinedAdapter:
    """Write the adapter directory ``output`` whose delta is ``sum_i coefficients[i] *
    delta_i`` (see the module doc); :class:`InputError` (nothing written) for adapters that
    cannot be combined exactly."""
    target = Path(output)
    if target.suffix.lower() in (".safetensors", ".pth", ".pt", ".bin"):
        raise InputError(
            f"{target}: LoRA adapters combine into an adapter directory (adapter_config.json, "
            "adapter_model.safetensors) that PeftModel loads: name OUT as a directory"
        )
    for path in paths:
        if target.resolve() == Path(path).resolve():
            raise InputError(f"{target}: the output would overwrite an input; name another OUT")
    check_output(target, force)
    adapters = [read_adapter(path) for path in paths]
    notes = _check(adapters, names)
    tensors, ranks = _factors(adapters, names, coefficients)
    modules_to_save = adapters[0].summary.get("modules_to_save") or None
    tensors.update(_copies(adapters, names, coefficients))
    if not ranks and not tensors:
        raise InputError(f"{names[0]}: the adapters hold no LoRA module to combine")
    config = _config(adapters[0].config, ranks, modules_to_save)
    key, facts = provenance
    write_adapter(target, config, tensors, force,
                  metadata={key: json.dumps(facts, sort_keys=True)})  # fmt: skip
    return CombinedAdapter(target, len(tensors), len(ranks), max(ranks.values(), default=0),
                           notes)  # fmt: skip


def _check(adapters: list[Adapter], names: Sequence[str]) -> list[str]:
    """DoRA, differing ``fan_in_fan_out`` or full copies refused; differing bases noted."""
    notes: list[str] = []
    first = adapters[0].summary
    for adapter, name in zip(adapters, names):
        summary = adapter.summary
        if summary.get("use_dora"):
            raise InputError(
                f"{name}: a DoRA adapter rescales the merged weight by its magnitude, so a "
                f"combination of DoRA adapters is no adapter; {MERGE_FIRST}"
            )
        if bool(summary.get("fan_in_fan_out")) != bool(first.get("fan_in_fan_out")):
            raise InputError(f"{name}: fan_in_fan_out differs from {names[0]}'s")
        if sorted(adapter.copies) != sorted(adapters[0].copies):
            raise InputError(
                f"{name}: saves the modules {sorted(adapter.copies) or 'none'} whole, "
                f"{names[0]} {sorted(adapters[0].copies) or 'none'}; a full copy is combined "
                f"only with the same copy of every adapter; {MERGE_FIRST}"
            )
        if summary.get("base_model") != first.get("base_model"):
            notes.append(
                f"{name} names its base {summary.get('base_model')!r}, {names[0]} "
                f"{first.get('base_model')!r}: the output names {names[0]}'s"
            )
    return notes


def _factors(
    adapters: list[Adapter], names: Sequence[str], coefficients: Sequence[float]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The stacked factors (by PEFT's key) and each module's rank."""
    by_module: dict[str, list[tuple[float, Any, str]]] = {}
    copied = {name.rsplit(".", 1)[0] for name in adapters[0].copies}
    for adapter, coefficient, name in zip(adapters, coefficients, names):
        for item in adapter.factors:
            if item.module in copied:
                raise InputError(
                    f"{name}: {item.module} is adapted and saved whole (a base_layer copy or "
                    f"modules_to_save), which is not combined; {MERGE_FIRST}"
                )
            by_module.setdefault(item.module, []).append((coefficient, item, name))
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for module, parts in sorted(by_module.items()):
        first = parts[0][1]
        for _, item, name in parts[1:]:
            if item.kind != first.kind or _shape(item) != _shape(first):
                raise InputError(
                    f"{name}: {module} is a {item.kind} LoRA of {list(_shape(item))}, "
                    f"{first.kind} of {list(_shape(first))} in {parts[0][2]}"
                )
        kept = [(c, item) for c, item, _ in parts if c != 0.0]
        if not kept:
            continue
        wide = np.float64 if any(i.a.dtype == np.float64 for _, i in kept) else np.float32
        a = np.concatenate([(c * i.scaling) * i.a.astype(np.float64) for c, i in kept], axis=0)
        b = np.concatenate([i.b.astype(np.float64) for _, i in kept], axis=1)
        embedding = first.kind.startswith("embedding")
        key_a, key_b = (("lora_embedding_A", "lora_embedding_B") if embedding
                        else ("lora_A.weight", "lora_B.weight"))  # fmt: skip
        tensors[f"{PREFIX}{module}.{key_a}"] = a.astype(wide)
        tensors[f"{PREFIX}{module}.{key_b}"] = b.astype(wide)
        ranks[module] = a.shape[0]
    return tensors, ranks


def _shape(item: Any) -> tuple[int, int]:
    """A module's delta shape ``(B rows, A columns)``: the same in every adapter of it."""
    return (item.b.shape[0], item.a.shape[1])


def _copies(
    adapters: list[Adapter], names: Sequence[str], coefficients: Sequence[float]
) -> dict[str, np.ndarray]:
    """The full copies combined as the weights they replace (every adapter holds them)."""
    out: dict[str, np.ndarray] = {}
    for name in adapters[0].copies:
        values = [adapter.copies[name] for adapter in adapters]
        if any(v.shape != values[0].shape for v in values):
            raise InputError(f"{names[0]}: {name} has other shapes in the other adapters")
        total = sum(c * v.astype(np.float64) for c, v in zip(coefficients, values))
        wide = np.float64 if any(v.dtype == np.float64 for v in values) else np.float32
        out[PREFIX + name] = np.asarray(total, dtype=wide)
    return out


def _config(
    first: dict[str, Any],
    ranks: dict[str, int],
    modules_to_save: list[str] | None,
) -> dict[str, Any]:
    """The first adapter's ``adapter_config.json`` with the combined adapter's ranks: scale 1 in
    every module (``lora_alpha`` equal to its rank; no rsLoRA, no DoRA), the modules named in
    full."""
    rank = max(ranks.values(), default=1)
    pattern = {re.escape(m): r for m, r in ranks.items() if r != rank}
    config = dict(first)
    for name in ("layers_to_transform", "layers_pattern", "exclude_modules"):
        if name in config:
            config[name] = None
    config.update(
        r=rank,
        lora_alpha=rank,
        rank_pattern=pattern,
        alpha_pattern=dict(pattern),
        target_modules=sorted(ranks) or None,
        modules_to_save=modules_to_save,
        use_rslora=False,
        use_dora=False,
        inference_mode=True,
    )
    return config
