"""What a checkpoint saved beside its tensors, for ``show``: each part's scalar settings.

A scheduler's position, a GradScaler's scale, a config dataclass, an ``argparse.Namespace``,
Lightning's ``hyper_parameters``, a directory's JSON files: values a reader of the file wants
to see without ``--tree``. Pure functions over the reader's tree.
"""

from __future__ import annotations

from typing import Any

from ckpttool.model.records import OpaqueObject, TensorRecord, children
from ckpttool.model.roles import RNG_NAMES

#: Parts that are RNG states: their numbers are state, not settings anyone reads.
RNG_PARTS = ("rng", "rng_state", "rng_states", "random_states", *RNG_NAMES)
#: Settings that say where a run is, first in their part's line (a scheduler's position, a
#: GradScaler's scale); the others follow in the file's order.
POSITION_SETTINGS = ("last_epoch", "_step_count", "base_lrs", "_last_lr", "scale",
                     "_growth_tracker")  # fmt: skip
#: A list longer than this is state (an RNG's words, a loss history), not a setting.
MAX_SETTING_LIST = 64


def part_settings(root: Any) -> dict[str, dict[str, Any]]:
    """The scalar settings of each top-level part that holds some: ``{part: {name: value}}``.

    A part is a top-level dict or object (a ``config`` dataclass, ``args``, Lightning's
    ``hyper_parameters``, a ``scheduler`` or ``scaler`` state, a directory's JSON files) or
    one dict of a top-level list of them (Lightning's ``lr_schedulers.0``). Its settings are
    its direct children that are scalars or short lists of scalars (``base_lrs``); a part with
    a tensor among its direct children (a state dict) or none of those is left out, and so are
    RNG states. Only direct children are looked at: a model of 100,000 tensors costs nothing.
    """
    if not isinstance(root, (dict, OpaqueObject)):
        return {}
    parts: dict[str, dict[str, Any]] = {}
    candidates: list[tuple[str, Any]] = []
    for name, node in children(root):
        if name in RNG_PARTS:
            continue
        if isinstance(node, (list, tuple)) and 0 < len(node) <= MAX_SETTING_LIST:
            candidates += [(f"{name}.{i}", item) for i, item in enumerate(node)
                           if isinstance(item, (dict, OpaqueObject))]  # fmt: skip
        elif isinstance(node, (dict, OpaqueObject)):
            candidates.append((name, node))
    for name, node in candidates:
        settings = settings_of(node)
        if settings:
            parts[name] = settings
    return parts


def settings_of(node: Any) -> dict[str, Any]:
    """The direct children of ``node`` that are scalars or short lists of scalars, the
    position ones first; empty when one of them is a tensor or a state dict."""
    settings: dict[str, Any] = {}
    for key, value in children(node):
        if isinstance(value, TensorRecord) or _holds_tensors(value):
            return {}
        if _is_scalar(value):
            settings[key] = value
        elif (
            isinstance(value, (list, tuple))
            and 0 < len(value) <= MAX_SETTING_LIST
            and all(map(_is_scalar, value))
        ):
            settings[key] = list(value)
    first = [key for key in POSITION_SETTINGS if key in settings]
    return {key: settings[key] for key in [*first, *settings]}


def _holds_tensors(value: Any) -> bool:
    """A state dict (DeepSpeed's ``module`` inside its model states): the part holding it is
    a container of weights, summarized elsewhere. Its first entry says (no walk of the rest)."""
    if not isinstance(value, dict) or not value:
        return False
    return isinstance(next(iter(value.values())), TensorRecord)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
