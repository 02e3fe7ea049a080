"""Which tensor of A is compared with which of B, and which fields differ (metadata only).

Split from :mod:`ckpttool.commands.diff.run` because matching has rules of its own (docs/diff.md):

* keys are compared relative to the chosen section, with prefixes removed;
* a key present on one side only is matched with a tensor the other side stores under another
  name when (1) that side's safetensors ``__metadata__`` declares it an alias, as ckpttool's
  ``"ckpttool.aliases"`` JSON object ``{alias: stored}`` (what ``convert`` writes) or as
  ``safetensors.torch.save_model``'s one ``{alias: stored}`` entry per alias; or (2) on its own
  side it is *tied* to a key both sides have (same storage, offset, shape, stride and dtype),
  as when a file dropped the tied duplicate without saying so (Hugging Face). Two separate
  copies are not a tie: without metadata they stay "only in A";
* a key that is a scalar field on one side and a tensor on the other is one field change
  (``type_changed``), not a field only in A and a tensor only in B (:func:`merge_type_changes`);
* when the two sides share no key, and one side's keys under one extra leading component
  (``model.``, ``model_state_dict.``, ``module.``) pair one to one with all of the other's,
  that prefix is where they align (:func:`extra_prefixes`). Keys that match only in part are
  never aligned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.selection import (
    ALIASES_KEY,
    WRAPPER_PREFIXES,
    Selected,
    declared_aliases,
    strip_prefixes,
    wrapper_hint,
)
from ckpttool.model.records import TensorRecord
from ckpttool.model.roles import scalar_fields

#: safetensors ``__metadata__`` keys where ``convert`` records provenance (not compared).
PROVENANCE_KEYS = ("ckpttool.source", "ckpttool.version")


@dataclass(frozen=True, slots=True)
class Alias:
    """A key one side lacks, matched with a tensor that side stores under another name."""

    side: str  # "a" or "b": the side without the key
    stored_as: str  # the key (as compared) of the tensor it was matched with on that side
    rule: str  # "metadata" or "shared_storage"


CHANGED = "changed"
TYPE_CHANGED = "type_changed"  # a scalar on one side, a tensor on the other


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """A scalar or string field whose value differs (or that only one side has)."""

    key: str  # dotted path below the compared subtree ("step", "optimizer.param_groups.0.lr")
    status: str  # CHANGED, TYPE_CHANGED, "only_a" or "only_b"
    a: Any  # None when status is "only_b"; a tensor side's value (one element, once read)
    b: Any  # None when status is "only_a"
    a_tensor: TensorRecord | None = None  # TYPE_CHANGED: the side that holds a tensor
    b_tensor: TensorRecord | None = None


@dataclass(frozen=True, slots=True)
class TensorPair:
    key: str  # normalised key
    a: TensorRecord | None
    b: TensorRecord | None
    alias: Alias | None = None


def described_metadata(ckpt: Checkpoint) -> dict[str, Any]:
    """The ``__metadata__`` entries compared as fields. Not alias declarations (either
    convention: they are resolved as tensors) nor provenance (which file and ckpttool version
    ``convert`` wrote it from), so that the same tensors saved two ways compare equal."""
    names = {record.key for record in ckpt.tensors()}
    kept = {
        key: value
        for key, value in ckpt.metadata.items()
        if key not in (ALIASES_KEY, *PROVENANCE_KEYS) and not (key not in names and value in names)
    }
    return {"__metadata__": kept}


def _normalised(key: str, section: str | None, prefixes: Sequence[str]) -> str:
    if section and key.startswith(section + "."):
        key = key[len(section) + 1 :]
    return strip_prefixes(key, prefixes)


def metadata_aliases(
    ckpt: Checkpoint, selection: Selected, prefixes: Sequence[str], label: str, notes: list[str]
) -> dict[str, str]:
    """alias -> stored key, both as compared, from a safetensors file's ``__metadata__``."""
    stored = {record.key for record in selection.tensors.values()}
    declared, malformed = declared_aliases(ckpt.metadata, stored)
    if malformed:
        notes.append(f"{label}: ignoring {ALIASES_KEY!r} metadata: not a JSON object of names")
    section = selection.section or selection.weights
    return {
        _normalised(name, section, prefixes): _normalised(target, section, prefixes)
        for name, target in declared.items()
        if target in stored
    }


def _view(record: TensorRecord) -> tuple[Any, ...] | None:
    """Identity of the exact view a record is: two keys with the same view are tied."""
    if record.storage is None or record.inline_data is not None:
        return None
    return (record.storage, record.storage_offset, record.shape, record.stride, record.dtype)


def _views(
    own: dict[str, TensorRecord], other: dict[str, TensorRecord]
) -> dict[tuple[Any, ...], list[str]]:
    """Per exact view, the first two of ``own``'s names (file order) that ``other`` also has.

    Two suffice (a key is never its own alias), and building it once keeps matching linear:
    a hostile file can hang thousands of names on one view.
    """
    index: dict[tuple[Any, ...], list[str]] = {}
    for name, record in own.items():
        view = _view(record)
        if view is not None and name in other:
            names = index.setdefault(view, [])
            if len(names) < 2:
                names.append(name)
    return index


def _find_alias(
    key: str,
    own: dict[str, TensorRecord],
    own_views: dict[tuple[Any, ...], list[str]],
    other: dict[str, TensorRecord],
    other_aliases: dict[str, str],
    other_label: str,
) -> tuple[TensorRecord, Alias] | None:
    """Match ``key`` (present in ``own`` only) with a tensor ``other`` stores under another name."""
    target = other_aliases.get(key)
    if target is not None and target in other:
        return other[target], Alias(other_label, target, "metadata")
    view = _view(own[key])
    if view is None:
        return None
    for name in own_views.get(view, ()):
        if name != key:
            return other[name], Alias(other_label, name, "shared_storage")
    return None


def match_tensors(
    tensors_a: dict[str, TensorRecord],
    tensors_b: dict[str, TensorRecord],
    aliases_a: dict[str, str] | None = None,
    aliases_b: dict[str, str] | None = None,
) -> list[TensorPair]:
    """Pair tensors by key, resolving aliases; A's order, then B's keys that A lacks."""
    pairs: list[TensorPair] = []
    # the view indexes serve keys one side lacks: built only when there are such keys (at
    # 100,000 tensors they are 25 MB)
    lone = tensors_a.keys() != tensors_b.keys()
    views_a = _views(tensors_a, tensors_b) if lone else {}
    views_b = _views(tensors_b, tensors_a) if lone else {}
    for key, record in tensors_a.items():
        if key in tensors_b:
            pairs.append(TensorPair(key, record, tensors_b[key]))
            continue
        found = _find_alias(key, tensors_a, views_a, tensors_b, aliases_b or {}, "b")
        if found is None:
            pairs.append(TensorPair(key, record, None))
        else:
            pairs.append(TensorPair(key, record, found[0], found[1]))
    for key, record in tensors_b.items():
        if key in tensors_a:
            continue
        found = _find_alias(key, tensors_b, views_b, tensors_a, aliases_a or {}, "a")
        if found is None:
            pairs.append(TensorPair(key, None, record))
        else:
            pairs.append(TensorPair(key, found[0], record, found[1]))
    return pairs


def wrapper_note(pairs: list[TensorPair]) -> list[str]:
    """The hint ``show`` gives, when keys only in A and keys only in B are the same keys once
    DDP/``torch.compile`` wrapper prefixes are removed (``module._orig_mod.x`` against ``x``,
    ``_orig_mod.x`` against ``module.x``): name the prefixes and ``--ignore-wrappers``."""
    only_a = [pair.key for pair in pairs if pair.b is None]
    only_b = [pair.key for pair in pairs if pair.a is None]
    if not only_a or not only_b:
        return []
    bare_b = {strip_prefixes(key, WRAPPER_PREFIXES) for key in only_b}
    matching = sum(1 for key in only_a if strip_prefixes(key, WRAPPER_PREFIXES) in bare_b)
    if not matching:
        return []
    sides = []
    for label, keys in (("A", only_a), ("B", only_b)):
        count, prefixes = wrapper_hint(keys)
        if count:
            sides.append(f"{count} of {label}'s start with {' and '.join(map(repr, prefixes))}")
    return [
        f"{matching} keys only in A are keys only in B once DDP/torch.compile wrapper prefixes "
        f"are removed ({'; '.join(sides)}): use --ignore-wrappers to compare them"
    ]


def alias_note(pair: TensorPair) -> str:
    alias = pair.alias
    assert alias is not None
    lacking, having = ("B", "A") if alias.side == "b" else ("A", "B")
    if alias.rule == "metadata":
        why = f"{lacking}'s metadata names it an alias of {alias.stored_as!r}"
    else:
        why = f"{having} ties it to {alias.stored_as!r} (shared storage)"
    return f"{lacking} has no {pair.key!r}: {why}, so it was compared with that tensor"


def same_value(a: Any, b: Any) -> bool:
    """Equal values of the same type (1 and 1.0 differ; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def compare_fields(node_a: Any, node_b: Any) -> list[FieldDiff]:
    """Scalar and string fields that differ between two subtrees (RNG state runs skipped)."""
    fields_a, fields_b = scalar_fields(node_a), scalar_fields(node_b)
    out: list[FieldDiff] = []
    for key, value in fields_a.items():
        if key not in fields_b:
            out.append(FieldDiff(key, "only_a", value, None))
            continue
        other = fields_b[key]
        if type(value) is type(other) and value == other:  # ``same_value``'s common case, inline
            continue
        if not same_value(value, other):
            out.append(FieldDiff(key, CHANGED, value, other))
    out.extend(FieldDiff(k, "only_b", None, v) for k, v in fields_b.items() if k not in fields_a)
    return out


def merge_type_changes(
    fields: list[FieldDiff],
    pairs: list[TensorPair],
    prefixes_a: Sequence[str],
    prefixes_b: Sequence[str],
) -> tuple[list[FieldDiff], list[TensorPair]]:
    """Join a field one side has with the tensor the other side has under the same key
    (``loss`` a float in A, a 0-d tensor in B) into one :data:`TYPE_CHANGED` field."""
    lone = {
        (pair.key, "a" if pair.b is None else "b"): pair
        for pair in pairs
        if (pair.a is None) != (pair.b is None) and pair.alias is None
    }
    merged: set[str] = set()
    out: list[FieldDiff] = []
    for entry in fields:
        if entry.status == "only_a":
            pair = lone.get((strip_prefixes(entry.key, prefixes_a), "b"))
            if pair is not None:
                out.append(FieldDiff(entry.key, TYPE_CHANGED, entry.a, None, b_tensor=pair.b))
                merged.add(pair.key)
                continue
        elif entry.status == "only_b":
            pair = lone.get((strip_prefixes(entry.key, prefixes_b), "a"))
            if pair is not None:
                out.append(FieldDiff(entry.key, TYPE_CHANGED, None, entry.b, a_tensor=pair.a))
                merged.add(pair.key)
                continue
        out.append(entry)
    kept = [pair for pair in pairs if pair.key not in merged]
    return out, kept


def extra_prefixes(
    own: dict[str, TensorRecord],
    other: dict[str, TensorRecord],
    own_aliases: dict[str, str],
    other_aliases: dict[str, str],
    limit: int = 2,
) -> list[str]:
    """The prefixes ``P`` (one leading key component and its dot) such that ``own``'s tensors
    under ``P``, with ``P`` removed, pair one to one with all of ``other``'s (aliases and ties
    resolved as :func:`match_tensors` does); at most ``limit`` of them (two already make the
    choice ambiguous). Empty when the two sides share a key: the keys then already align, at
    least in part.
    """
    if not own or not other or not own.keys().isdisjoint(other.keys()):
        return []
    groups: dict[str, dict[str, TensorRecord]] = {}
    for key, record in own.items():
        head, dot, rest = key.partition(".")
        if dot and rest:
            groups.setdefault(head + dot, {})[rest] = record
    found = []
    for prefix, under in groups.items():
        # cheap necessary test first: keeps a file of many small groups linear
        if 2 * sum(1 for key in under if key in other) < len(other):
            continue
        aliases = {
            alias[len(prefix) :]: stored[len(prefix) :]
            for alias, stored in own_aliases.items()
            if alias.startswith(prefix) and stored.startswith(prefix)
        }
        paired = match_tensors(under, other, aliases, other_aliases)
        if all(pair.a is not None and pair.b is not None for pair in paired):
            found.append(prefix)
            if len(found) == limit:
                break
    return found
