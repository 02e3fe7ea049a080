"""Edits of a checkpoint's object tree (``ckpttool edit``): drop, keep, rename, and what a
layout drops for inference. Pure functions over the reader's tree: no file access, no torch.

Keys are the dotted paths ``show`` lists (``optimizer.state.3.exp_avg``). An entry is dropped
from the dict that holds it, never from a list or tuple (the indices after it would shift):
a pattern that reaches inside one drops the nearest dict entry around it, and says so by its
key. A rename changes a tensor's name inside the dict that holds it (a state dict's keys);
it never moves a tensor to another dict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ckpttool.errors import InputError
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    get_path,
    join_key,
    walk,
    with_fields,
)
from ckpttool.model.roles import (
    EMA_PART_KEYS,
    LIGHTNING,
    MODEL_PART_KEYS,
    OPTIMIZER_PART_KEYS,
    TRAINING,
    WHOLE_FILE,
    WRAPPER_PREFIXES,
    is_pickled_module,
    is_resume,
    model_part,
    module_state_dict,
    part_node,
    with_part,
)
from ckpttool.model.structure import find_parts

#: What a resume checkpoint holds only to go on training: its optimizer is found by role.
TRAINING_ONLY_KEYS = (
    "scaler", "grad_scaler", "scheduler", "lr_scheduler", "lr_schedulers", "rng", "rng_state",
    "rng_states", "sampler", "dataloader",
)  # fmt: skip
#: What a Lightning ``.ckpt`` holds only for ``Trainer.fit(ckpt_path=...)``: without them,
#: ``LightningModule.load_from_checkpoint`` still loads it.
LIGHTNING_TRAINING_KEYS = ("optimizer_states", "lr_schedulers")


@dataclass
class EditLog:
    """What the edits did, in order."""

    dropped: list[str] = field(default_factory=list)  # keys of the entries left out
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (old key, new key)
    rule_counts: list[int] = field(default_factory=list)  # keys each rename rule matched
    compacted: list[str] = field(default_factory=list)  # keys of tensors whose storage shrank
    cast: list[str] = field(default_factory=list)  # keys of tensors cast to another dtype
    # floating tensors --dtype left alone as training state: optimizer state, step counters
    not_cast: list[str] = field(default_factory=list)
    ema: str | None = None  # where --use-ema took the weights from
    ema_taken: list[str] = field(default_factory=list)  # model keys given their EMA values
    ema_missing: list[str] = field(default_factory=list)  # model tensors the EMA does not hold
    mapped: list[tuple[str, str, str]] = field(default_factory=list)  # --map: op, from, to
    unmatched: list[str] = field(default_factory=list)  # "--drop 'PATTERN'" that matched nothing


def inference_drops(root: Any, layout: str) -> list[str]:
    """The top-level keys ``--for-inference`` drops from a checkpoint of ``layout``: what only
    resuming training needs. Empty for weights alone (nothing to drop); an error for a file
    with no model."""
    if not isinstance(root, dict):
        raise InputError("--for-inference: the checkpoint is not a dict of parts")
    if layout == LIGHTNING:
        return [key for key in LIGHTNING_TRAINING_KEYS if key in root]
    if is_resume(layout) or layout == TRAINING:
        names = (*OPTIMIZER_PART_KEYS, *TRAINING_ONLY_KEYS)
        named = [key for key in root if isinstance(key, str) and key in names]
        # and wherever they sit, whatever their names: optimizer, RNG and trainer states by
        # their structure (a learner's ``opt``, ignite's ``trainer``, Composer's
        # ``state.optimizers``), never inside the model or a part already dropped
        model = model_part(root, layout) or None
        for key in find_parts(root).training_only:
            if _in_dicts(root, key) and not any(
                key == other or key.startswith(f"{other}.") for other in (*named, model) if other
            ):
                named.append(_literal(key))
        return named
    if any(isinstance(node, TensorRecord) for node in root.values()):
        return []  # a state dict: weights only already
    raise InputError(
        f"--for-inference knows what training-only parts a {layout} holds only for resume "
        "checkpoints, Lightning .ckpt files and state dicts: name them with --drop"
    )


def _in_dicts(root: Any, key: str) -> bool:
    """Whether ``key`` names an entry reached through dicts only (an entry of a list cannot be
    dropped alone: its whole dict entry would go)."""
    node = root
    for name in key.split(".") if key else ():
        if node.__class__ is not dict:
            return False
        found = [child for k, child in node.items() if str(k) == name]
        if not found:
            return False
        node = found[0]
    return bool(key)


def _literal(key: str) -> str:
    """``key`` as an ``fnmatch`` pattern that matches only itself."""
    return re.sub(r"([*?\[])", r"[\1]", key)


#: The last key of a tensor ``--dtype`` never casts: an optimizer's per-parameter step counter
#: (AdamW's is a float32 tensor: in bfloat16 it stops counting at 256, in float16 at 2048).
COUNTER_NAMES = ("step",)


def optimizer_states(root: Any) -> list[str]:
    """The keys of the optimizer ``state_dict()`` s in ``root``, found by their structure
    (:func:`ckpttool.model.structure.find_parts`): a resume file's ``optimizer``, a Lightning
    ``.ckpt``'s ``optimizer_states.0``, ``""`` for a file that is one (Trainer's
    ``optimizer.pt``)."""
    return sorted(find_parts(root).optimizers)


def cast_scope(root: Any, *, optimizer: bool) -> Any:
    """Which tensors of ``root`` ``--dtype`` may cast, as a test of a tensor's key: never a step
    counter (:data:`COUNTER_NAMES`), and an optimizer's state (:func:`optimizer_states`) only
    when ``optimizer`` (``--cast-optimizer``): the model's weights are what a cast is for; a
    resumed run needs its optimizer's state as it was saved."""
    parts = [] if optimizer else optimizer_states(root)

    def castable(key: str) -> bool:
        if key.rpartition(".")[2] in COUNTER_NAMES:
            return False
        return not any(not p or key == p or key.startswith(p + ".") for p in parts)

    return castable


def drop(root: Any, patterns: list[str], log: EditLog) -> Any:
    """``root`` without the dict entries whose key matches a pattern (``fnmatch``, ``*``
    crossing dots)."""
    if not patterns:
        return root
    matched: set[str] = set()

    def unwanted(key: str, _: Any) -> bool:
        hits = [p for p in patterns if fnmatchcase(key, p)]
        matched.update(hits)
        return bool(hits)

    out = _filter(root, "", unwanted, log)
    log.unmatched += [f"--drop {p!r}" for p in patterns if p not in matched]
    return out


def keep(root: Any, patterns: list[str], log: EditLog) -> Any:
    """``root`` without the tensors whose key matches no pattern; other values stay."""
    if not patterns:
        return root

    matched: set[str] = set()

    def unwanted(key: str, node: Any) -> bool:
        if not isinstance(node, TensorRecord):
            return False
        hits = [p for p in patterns if fnmatchcase(key, p)]
        matched.update(hits)
        return not hits

    out = _filter(root, "", unwanted, log)
    log.unmatched += [f"--keep {p!r}" for p in patterns if p not in matched]
    return out


def _filter(node: Any, key: str, unwanted: Any, log: EditLog) -> Any:
    """``node`` without what is unwanted; a dict or object in which nothing changed is
    ``node`` itself, so what two places share (a bound method's object, a shared config) is
    still one object when written back."""
    if isinstance(node, dict):
        out = {}
        for name, value in node.items():
            child = join_key(key, str(name))
            if unwanted(child, value) or _holds_unwanted_in_sequence(value, child, unwanted):
                log.dropped.append(child)
                continue
            out[name] = _filter(value, child, unwanted, log)
        if len(out) == len(node) and all(out[name] is value for name, value in node.items()):
            return node
        return out
    if is_pickled_module(node):
        _refuse_in_module(node, key, lambda name, record: unwanted(name, record))
        return node
    if isinstance(node, OpaqueObject):
        state = _filter(node.state, key, unwanted, log)
        dictitems = _filter(node.dictitems, key, unwanted, log)
        if state is node.state and dictitems is node.dictitems:
            return node
        rebuilt = node.rebuilt(node.args, state)
        rebuilt.dictitems = dictitems
        rebuilt.listitems = node.listitems
        return rebuilt
    return node


def _holds_unwanted_in_sequence(node: Any, key: str, unwanted: Any) -> bool:
    """Whether a list or tuple under ``node`` holds an element that must go: then the whole
    dict entry goes (a sequence cannot lose an element without shifting the rest)."""
    if isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            child = join_key(key, str(i))
            if unwanted(child, item):
                return True
            if isinstance(item, (list, tuple, dict)) and any(
                unwanted(k, v) for k, v in walk(item, child) if isinstance(v, TensorRecord)
            ):
                return True
    return False


def rename(root: Any, rules: list[str], log: EditLog) -> Any:
    """Rename tensors by ``REGEX=REPLACEMENT`` rules, applied in order to each tensor's key
    (``re.sub``, groups as ``\\1``); the new key must stay in the dict that holds the tensor,
    and two tensors must not end with one name."""
    if not rules:
        return root
    compiled = compile_rules(rules)
    log.rule_counts = [0] * len(compiled)
    out = _rename(root, "", compiled, log)
    log.unmatched += [f"--rename {r!r}" for r, n in zip(rules, log.rule_counts) if not n]
    return out


def refuse_unmatched(unmatched: list[str] | tuple[str, ...]) -> None:
    """A ``--drop``/``--keep``/``--rename`` pattern that matched no key is an error, not an
    edit that quietly did nothing (or, for ``--keep``, dropped every tensor): a typo, or the
    keys are named otherwise (``ckpttool show`` lists them)."""
    if unmatched:
        raise InputError(
            f"{', '.join(unmatched)}: matches no key in the checkpoint (ckpttool show lists "
            "them); nothing was written"
        )


def compile_rules(rules: list[str] | tuple[str, ...]) -> list[tuple[re.Pattern[str], str]]:
    """``--rename REGEX=REPLACEMENT`` rules, compiled (an error names a bad one)."""
    compiled = []
    for rule in rules:
        pattern, sep, replacement = rule.partition("=")
        if not sep or not pattern:
            raise InputError(f"--rename {rule!r}: expected REGEX=REPLACEMENT")
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as error:
            raise InputError(f"--rename {rule!r}: {error}") from None
    return compiled


def renamed_key(key: str, rules: list[tuple[re.Pattern[str], str]], counts: list[int]) -> str:
    """``key`` after every rule in turn (``re.sub``); ``counts[i]`` grows when rule i matched."""
    for i, (pattern, replacement) in enumerate(rules):
        try:
            new = pattern.sub(replacement, key)
        except (re.error, IndexError) as error:
            raise InputError(f"--rename {pattern.pattern!r}: {error}") from None
        if new != key:
            counts[i] += 1
            key = new
    return key


def _rename(node: Any, key: str, rules: list[tuple[re.Pattern[str], str]], log: EditLog) -> Any:
    if is_pickled_module(node):
        _refuse_in_module(
            node, key, lambda name, _: renamed_key(name, rules, log.rule_counts) != name
        )
        return node
    if isinstance(node, OpaqueObject):
        rebuilt = node.rebuilt(node.args, _rename(node.state, key, rules, log))
        rebuilt.dictitems = _rename(node.dictitems, key, rules, log)
        rebuilt.listitems = node.listitems
        return rebuilt
    if not isinstance(node, dict):
        return node
    out: dict[Any, Any] = {}
    origin: dict[Any, str] = {}
    for name, value in node.items():
        child = join_key(key, str(name))
        new_name: Any = name
        if isinstance(value, TensorRecord) and isinstance(name, str):
            new_key = renamed_key(child, rules, log.rule_counts)
            if new_key != child:
                prefix = f"{key}." if key else ""
                if not new_key.startswith(prefix) or len(new_key) == len(prefix):
                    raise InputError(
                        f"--rename would move {child!r} to {new_key!r}, out of {key or 'the top'}"
                        " (a rename changes a name inside the dict that holds it)"
                    )
                new_name = new_key[len(prefix) :]
                log.renamed.append((child, new_key))
        else:
            value = _rename(value, child, rules, log)
        if new_name in out:
            raise InputError(
                f"--rename: {origin[new_name]!r} and {child!r} would both be named "
                f"{join_key(key, str(new_name))!r}"
            )
        out[new_name] = value
        origin[new_name] = child
    return out


#: Storage keys :func:`compact` makes: a source storage's ``[first, end)`` bytes.
COMPACT_PREFIX = "\0compact\0"


def compact(root: Any, log: EditLog) -> tuple[Any, dict[str, tuple[str, int, int]]]:
    """``root`` with every storage cut to the bytes its tensors view (a view saved whole, such
    as ``torch.save(big[:10])``, keeps only its own bytes; tensors sharing a storage still share
    it); and, for each cut storage's new key, ``(source storage key, first byte, end byte)``.
    A storage viewed with two element sizes is left whole."""
    spans: dict[str, list[Any]] = {}  # storage key -> [first, end, itemsizes, storage]
    for _, record in walk(root):
        if not isinstance(record, TensorRecord) or not plain_record(record):
            continue
        assert record.storage is not None
        first = record.storage_offset * record.itemsize
        end = max(record.stored_extent_bytes, first)
        span = spans.setdefault(record.storage.key, [first, end, set(), record.storage])
        span[0], span[1] = min(span[0], first), max(span[1], end)
        span[2].add(record.itemsize)
    cut: dict[str, tuple[StorageRecord, int]] = {}  # source key -> (new storage, first byte)
    regions: dict[str, tuple[str, int, int]] = {}
    for key, (first, end, sizes, storage) in spans.items():
        if len(sizes) != 1 or storage.dtype not in ITEMSIZE:
            continue
        unit = max(next(iter(sizes)), ITEMSIZE[storage.dtype])
        first, end = first // unit * unit, -(-end // unit) * unit
        if (first, end) == (0, storage.nbytes) or end > storage.nbytes:
            continue
        new_key = COMPACT_PREFIX + key
        numel = (end - first) // ITEMSIZE[storage.dtype]
        cut[key] = (
            StorageRecord(new_key, storage.dtype, numel, storage.location, new_key, end - first,
                          storage.byteorder),
            first,
        )  # fmt: skip
        regions[new_key] = (key, first, end)

    def shrink(record: TensorRecord, key: str) -> TensorRecord:
        if record.storage is None or record.storage.key not in cut or not plain_record(record):
            return record
        storage, first = cut[record.storage.key]
        log.compacted.append(key)
        offset = record.storage_offset - first // record.itemsize
        return with_fields(record, storage=storage, storage_offset=offset)

    return map_tensors(root, shrink), regions


def plain_record(record: TensorRecord) -> bool:
    """A strided tensor whose elements are whole bytes of a storage in the file (not inline,
    not assembled from parts, not a packed dtype): one whose bytes an edit may move."""
    return (
        record.storage is not None
        and record.inline_data is None
        and not record.parts
        and record.layout == "strided"
        and record.dtype in ITEMSIZE
        and record.dtype not in ELEMENTS_PER_BYTE
    )


def map_tensors(root: Any, change: Any) -> Any:
    """``root`` with each tensor record replaced by ``change(record, key)``."""
    return _map_tensors(root, "", change)


def _refuse_in_module(module: OpaqueObject, key: str, touched: Any) -> None:
    """A pickled ``nn.Module`` is written back whole, as its class's ``__setstate__`` expects
    it: an error when ``touched(key, record)`` holds for a tensor of its state dict."""
    state_dict = module_state_dict(module) or {}
    for name, record in state_dict.items():
        child = join_key(key, name)
        if touched(child, record):
            where = f"{key!r}" if key else "the file"
            raise InputError(
                f"{child!r} is a tensor of the pickled {module.cls} in {where}, which edit "
                "writes back whole (its state dict as it is): drop or keep the whole part, or "
                "`ckpttool convert` it to a state dict and edit that"
            )


def _map_tensors(node: Any, key: str, change: Any) -> Any:
    if isinstance(node, TensorRecord):
        return change(node, key)
    if is_pickled_module(node):
        return _map_module(node, key, change)
    if isinstance(node, dict):
        return {name: _map_tensors(v, join_key(key, str(name)), change) for name, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_map_tensors(v, join_key(key, str(i)), change) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    if isinstance(node, OpaqueObject):
        rebuilt = node.rebuilt(node.args, _map_tensors(node.state, key, change))
        rebuilt.dictitems = _map_tensors(node.dictitems, key, change)
        rebuilt.listitems = node.listitems
        return rebuilt
    return node


def _map_module(module: OpaqueObject, key: str, change: Any) -> OpaqueObject:
    """A pickled ``nn.Module`` with ``change(record, key)`` applied to the tensors of its state
    dict, keyed as ``state_dict()`` keys them; its other attributes (non-persistent buffers,
    plain tensors) as they were."""
    state = dict(module.state)
    skipped = state.get("_non_persistent_buffers_set")
    transient = skipped if isinstance(skipped, (set, frozenset, list, tuple)) else ()
    for group in ("_parameters", "_buffers"):
        held = state.get(group)
        if isinstance(held, dict):
            state[group] = {
                name: change(value, join_key(key, str(name)))
                if isinstance(value, TensorRecord)
                and not (group == "_buffers" and name in transient)
                else value
                for name, value in held.items()
            }
    state["_modules"] = {
        name: _map_tensors(child, join_key(key, str(name)), change)
        for name, child in state["_modules"].items()
    }
    rebuilt = OpaqueObject(module.cls, module.args, state)
    rebuilt.dictitems = module.dictitems
    rebuilt.listitems = module.listitems
    return rebuilt


#: Where EMA weights are kept, besides :data:`~ckpttool.model.roles.EMA_PART_KEYS`: timm's.
EMA_KEYS = (*EMA_PART_KEYS, "state_dict_ema", "model_ema_state_dict")


def use_ema(root: Any, layout: str, where: str | None, log: EditLog) -> Any:
    """``root`` with the model's tensors replaced by their exponential moving average, which is
    then dropped: ``where`` (a dotted key) or the one top-level EMA part (``ema``,
    ``model_ema``, ``state_dict_ema``...). EMA keys are matched to the model's with DDP's and
    ``torch.compile``'s prefixes (``module.``, ``_orig_mod.``) aligned; every EMA tensor must
    have the dtype and shape of the model tensor it replaces. Model tensors the EMA does not
    hold (buffers, often) stay, and are listed."""
    swapped = _use_ema_module(root, where, log)
    if swapped is not None:
        return swapped
    model_key = model_part(root, layout)
    if not isinstance(root, dict) or model_key in (None, WHOLE_FILE):
        raise InputError("--use-ema: the checkpoint has no model part beside an EMA")
    assert model_key is not None
    if where is None:
        found = [key for key in EMA_KEYS if isinstance(root.get(key), dict)]
        if len(found) != 1:
            raise InputError(
                "--use-ema: "
                + ("no EMA weights found" if not found else f"several EMA parts {found}")
                + f" (looked for {', '.join(EMA_KEYS)}): name the EMA with --use-ema KEY"
            )
        where = found[0]
    try:
        ema = get_path(root, where)
    except KeyError:
        raise InputError(f"--use-ema {where}: no such key") from None
    ema_tensors = {
        _unwrapped(key): record for key, record in walk(ema) if isinstance(record, TensorRecord)
    }
    if not ema_tensors:
        raise InputError(f"--use-ema {where}: holds no tensors")
    log.ema = where

    def take(record: TensorRecord, key: str) -> TensorRecord:
        name = _unwrapped(key[len(model_key) + 1 :])
        average = ema_tensors.get(name)
        if average is None:
            log.ema_missing.append(key)
            return record
        if (average.dtype, average.shape) != (record.dtype, record.shape):
            raise InputError(
                f"--use-ema: {where}'s {name!r} is {average.dtype}{list(average.shape)}, the "
                f"model's is {record.dtype}{list(record.shape)}"
            )
        log.ema_taken.append(key)
        return average

    model = map_tensors({model_key: part_node(root, model_key)}, take)[model_key]
    if not log.ema_taken:
        raise InputError(f"--use-ema {where}: none of its tensors names a tensor of the model")
    return drop(with_part(root, model_key, model), [where], log)


def _use_ema_module(root: Any, where: str | None, log: EditLog) -> Any:
    """``root`` with its pickled EMA module in place of its pickled model, as ultralytics'
    ``strip_optimizer`` puts ``ema`` in ``model``: the module object whole, once its state
    dict is checked to be the model's (names, dtypes, shapes). None when the model part and
    the EMA are not both pickled modules."""
    if not isinstance(root, dict):
        return None
    models = [key for key in MODEL_PART_KEYS if is_pickled_module(root.get(key))]
    emas = [where] if where is not None else [k for k in EMA_KEYS if k in root]
    if len(models) != 1 or len(emas) != 1 or not is_pickled_module(root.get(emas[0])):
        return None
    model_key, ema_key = models[0], emas[0]
    model = module_state_dict(root[model_key]) or {}
    ema = module_state_dict(root[ema_key]) or {}
    mismatched = [
        name for name in model.keys() | ema.keys()
        if name not in model or name not in ema
        or (model[name].dtype, model[name].shape) != (ema[name].dtype, ema[name].shape)
    ]  # fmt: skip
    if mismatched:
        raise InputError(
            f"--use-ema: the pickled modules {ema_key!r} and {model_key!r} differ at "
            f"{sorted(mismatched)[0]!r} ({len(mismatched)} tensor(s)): not the same model"
        )
    log.ema = ema_key
    log.ema_taken.extend(join_key(model_key, name) for name in model)
    out = {key: (root[ema_key] if key == model_key else value) for key, value in root.items()}
    return drop(out, [ema_key], log)


def _unwrapped(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key
