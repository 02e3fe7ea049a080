"""Which part of each checkpoint ``diff`` compares, and under which keys.

Split from :mod:`ckpttool.commands.diff.run`, whose job is comparing. The rules, in order:

1. ``section_a``/``section_b`` name one side's subtree, ``section`` both sides' (a side named by
   neither is compared whole). A shared ``section`` only one side has fails with a hint to
   name one side's.
2. With no section named, two files of the same kind are compared whole; when the kinds differ
   (a resume file against a plain state dict, a Lightning checkpoint against a resume file,
   a torchtitan ``step-N/`` against a Hugging Face model directory, though both keep their
   weights under ``model``) each side's weights (``model``, ``state_dict``) are compared, and
   a note says so; two framework directories whose weights files fill the same section are
   compared whole, as below.
3. Then, if the two sides share no tensor key but one side's keys under one extra prefix pair
   one to one with the other's (``{"model": ...}`` against the bare state dict, ``module.``
   keys against plain ones; :func:`ckpttool.commands.diff.match.extra_prefixes`), they are aligned
   there, with a note: by taking that subtree as the side's section when it is one, else by
   removing the prefix from that side's keys. Two candidate prefixes are not guessed between.
4. A label never narrows what is compared silently: when rule 2 took each side's weights, what
   both sides hold outside them (a resume file's optimizer, scheduler, epoch...) is compared
   too, keyed as the files key it (:func:`compare_rest`); when only one side holds more than
   its weights (a resume file against a plain state dict), a note names what was not compared.

Two framework directories compared whole whose weights files fill the same section (two
Trainer ``checkpoint-N/``, two model directories) key those tensors as the files store them,
without the section's name (``model.layers.0...``, not ``model.model.layers.0...``), as ``show``
lists them, with a note that names the section once; unless a stored key would then equal
another part's (``show`` keeps the full keys then too). Whatever the part compared, a record
under a directory's weights section carries the key its file stores (:attr:`Part.stored`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.diff.match import (
    FieldDiff,
    TensorPair,
    compare_fields,
    extra_prefixes,
    match_tensors,
    merge_type_changes,
    metadata_aliases,
)
from ckpttool.commands.selection import Selected, Selection, select
from ckpttool.commands.show import weights_section
from ckpttool.errors import InputError
from ckpttool.model.records import TensorRecord, tensors
from ckpttool.model.roles import LAYOUT_TITLES, layout_of, model_section, scalar_fields


@dataclass(frozen=True)
class Part:
    """The tensors of one side that are compared, and how they were chosen."""

    layout: str
    selection: Selected  # .section: the subtree compared (None: the whole file)
    auto: bool  # the section was chosen (layouts of different kinds, or alignment), not named
    prefixes: tuple[str, ...]  # removed from keys: --strip-prefix, wrappers, aligned prefix
    aligned_prefix: str | None  # the extra prefix removed to align this side's keys
    # a framework directory: the section its weights files fill, when the part compared holds
    # tensors of it; their records carry the keys the files store (see stored_section)
    stored: str | None = None
    by_kind: bool = False  # the layouts differ: the section is the side's weights (rule 2)


def choose_parts(
    ckpt_a: Checkpoint,
    ckpt_b: Checkpoint,
    selection: Selection,
    *,
    section_a: str | None,
    section_b: str | None,
    notes: list[str],
) -> tuple[Part, Part]:
    """Apply the rules of the module docstring; notes say what was chosen and why.
    ``section_a``/``section_b`` override ``selection.section`` for one side."""
    section = selection.section
    layout_a = layout_of(ckpt_a)
    layout_b = layout_of(ckpt_b)
    auto = by_kind = False
    named_a = section_a if section_a is not None else section
    named_b = section_b if section_b is not None else section
    if named_a is not None or named_b is not None:
        _check_sections(ckpt_a, named_a, ckpt_b, named_b, shared=section)
        section_a, section_b = named_a or None, named_b or None
    else:
        section_a = model_section(layout_a, ckpt_a.root)
        section_b = model_section(layout_b, ckpt_b.root)
        if section_a == section_b and not _same_section_apart(
            ckpt_a, layout_a, ckpt_b, layout_b, section_a
        ):
            section_a = section_b = None  # same kind of file: compare all of it
        else:
            auto = by_kind = True
            notes.append(
                f"A ({LAYOUT_TITLES.get(layout_a, layout_a)}) and B "
                f"({LAYOUT_TITLES.get(layout_b, layout_b)}) are different kinds: comparing "
                f"{_part('A', section_a)} with {_part('B', section_b)} "
                "(use --section-a/--section-b to choose)"
            )
    options: dict[str, Any] = {
        "strip": selection.strip, "ignore_wrappers": selection.ignore_wrappers
    }  # fmt: skip
    sel_a = select(ckpt_a, section=section_a, auto_section=False, **options)
    sel_b = select(ckpt_b, section=section_b, auto_section=False, **options)
    if section_a is None and section_b is None:
        sel_a, sel_b = _weights_as_stored(ckpt_a, sel_a, ckpt_b, sel_b, options, notes)
    prefixes = selection.prefixes
    aliases_a = metadata_aliases(ckpt_a, sel_a, prefixes, "A", [])  # notes: once, by the caller
    aliases_b = metadata_aliases(ckpt_b, sel_b, prefixes, "B", [])
    sel_a, sel_b, prefix_a, prefix_b = _align(
        ckpt_a, sel_a, aliases_a, ckpt_b, sel_b, aliases_b, options, notes
    )
    return (
        Part(
            layout_a, sel_a, auto or sel_a.auto, (*prefixes, *prefix_a), _first(prefix_a),
            _stored_in(ckpt_a, sel_a), by_kind,
        ),
        Part(
            layout_b, sel_b, auto or sel_b.auto, (*prefixes, *prefix_b), _first(prefix_b),
            _stored_in(ckpt_b, sel_b), by_kind,
        ),
    )  # fmt: skip


def _same_section_apart(
    ckpt_a: Checkpoint, layout_a: str, ckpt_b: Checkpoint, layout_b: str, section: str | None
) -> bool:
    """Whether two checkpoints of different layouts that keep their weights under the same
    ``section`` are compared by that section on both sides rather than whole: a torchtitan
    ``step-N/`` or a Lightning sharded directory (the model gathered under ``model`` beside the
    training states) against a Hugging Face model directory (its weights files fill ``model``).
    Two directories whose weights files both fill ``section`` are compared whole (keyed as
    their files store them, :func:`_weights_as_stored`)."""
    if section is None or layout_a == layout_b:
        return False
    stored_a, stored_b = stored_section(ckpt_a), stored_section(ckpt_b)
    return not (stored_a is not None and stored_a == stored_b)


def _weights_as_stored(
    ckpt_a: Checkpoint,
    sel_a: Selected,
    ckpt_b: Checkpoint,
    sel_b: Selected,
    options: dict[str, Any],
    notes: list[str],
) -> tuple[Selected, Selected]:
    """Both whole selections keyed with the weights as their files store them, when A and B
    are framework directories whose weights fill the same section (see the module
    docstring); else both unchanged."""
    weights = stored_section(ckpt_a)
    if weights is None or stored_section(ckpt_b) != weights:
        return sel_a, sel_b
    try:
        keyed_a = select(ckpt_a, auto_section=False, weights=weights, **options)
        keyed_b = select(ckpt_b, auto_section=False, weights=weights, **options)
    except InputError:  # a stored key, once prefixes are removed, equals another's
        return sel_a, sel_b
    notes.append(
        f"A's and B's weights files fill their {weights!r} section: their tensors are keyed as "
        f"the files store them, without {weights + '.'!r}"
    )
    return keyed_a, keyed_b


def stored_section(ckpt: Checkpoint) -> str | None:
    """The section a framework directory's weights files fill, when its tensors can be keyed
    as those files store them (no stored key equals another part's key: ``show``'s rule)."""
    weights = weights_section(ckpt)
    if weights is None:
        return None
    start = weights + "."
    records = ckpt.tensors()
    keys = {r.key[len(start) :] if r.key.startswith(start) else r.key for r in records}
    return weights if len(keys) == len(records) else None


def _stored_in(ckpt: Checkpoint, selection: Selected) -> str | None:
    """:attr:`Part.stored` for a side: its weights section when the part compared holds it or
    lies in it."""
    if selection.weights is not None:
        return selection.weights
    weights = stored_section(ckpt)
    section = selection.section
    if weights is None or section is None:
        return None
    return weights if section == weights or section.startswith(weights + ".") else None


def _first(prefixes: list[str]) -> str | None:
    return prefixes[0] if prefixes else None


def _check_sections(
    ckpt_a: Checkpoint,
    section_a: str | None,
    ckpt_b: Checkpoint,
    section_b: str | None,
    *,
    shared: str | None,
) -> None:
    """Each named section exists; when ``--section`` named one only the other side has, say how
    to name one side's."""
    for ckpt, name, label in ((ckpt_a, section_a, "a"), (ckpt_b, section_b, "b")):
        if not name:
            continue
        try:
            ckpt.section(name)
        except InputError as error:
            other = ckpt_b if label == "a" else ckpt_a
            if name != shared or not _has_section(other, name):
                raise
            having = "B" if label == "a" else "A"
            hint = (
                f" (--section applies to both files; to compare {having}'s {name!r} with all of "
                f"{label.upper()}, use --section-{having.lower()} {name})"
            )
            raise InputError(f"{error}{hint}") from None


def _has_section(ckpt: Checkpoint, name: str) -> bool:
    try:
        ckpt.section(name)
    except InputError:
        return False
    return True


def _align(
    ckpt_a: Checkpoint,
    sel_a: Selected,
    aliases_a: dict[str, str],
    ckpt_b: Checkpoint,
    sel_b: Selected,
    aliases_b: dict[str, str],
    options: dict[str, Any],
    notes: list[str],
) -> tuple[Selected, Selected, list[str], list[str]]:
    """Align two selections that share no key when one side's keys are the other's under one
    extra prefix (see the module docstring). Returns both selections and each side's removed
    prefix (an empty list, or the prefix)."""
    found_a = extra_prefixes(sel_a.tensors, sel_b.tensors, aliases_a, aliases_b)
    found_b = extra_prefixes(sel_b.tensors, sel_a.tensors, aliases_b, aliases_a)
    found = [("A", prefix) for prefix in found_a] + [("B", prefix) for prefix in found_b]
    if not found:
        return sel_a, sel_b, [], []
    if len(found) > 1:
        where = ", ".join(f"{label}'s {prefix!r}" for label, prefix in found)
        notes.append(
            f"the keys of one side are the other's under more than one prefix ({where}): "
            "not aligned (use --section-a/--section-b to choose)"
        )
        return sel_a, sel_b, [], []
    label, prefix = found[0]
    ckpt, own = (ckpt_a, sel_a) if label == "A" else (ckpt_b, sel_b)
    other_label = "B" if label == "A" else "A"
    subtree = _subtree(ckpt, own, prefix)
    if subtree is not None:
        chosen = select(ckpt, section=subtree, auto_section=False, **options)
        chosen = Selected(chosen.layout, chosen.section, True, chosen.tensors)
        sections = {"A": sel_a.section, "B": sel_b.section, label: subtree}
        notes.append(
            f"{other_label}'s tensor keys are {label}'s under {prefix!r}: comparing "
            f"{_part('A', sections['A'])} with {_part('B', sections['B'])} "
            "(use --section-a/--section-b to choose)"
        )
        removed: list[str] = []
    elif all(key.startswith(prefix) for key in own.tensors):
        rekeyed = {key[len(prefix) :]: record for key, record in own.tensors.items()}
        chosen = Selected(own.layout, own.section, own.auto, rekeyed, own.weights)
        notes.append(
            f"{label}'s tensor keys are {other_label}'s with the prefix {prefix!r}: "
            "compared without it"
        )
        removed = [prefix]
    else:  # the other's keys are a part of this side that is not one subtree: not aligned
        return sel_a, sel_b, [], []
    if label == "A":
        return chosen, sel_b, removed, []
    return sel_a, chosen, [], removed


def _subtree(ckpt: Checkpoint, selection: Selected, prefix: str) -> str | None:
    """The section path of the subtree that holds exactly ``selection``'s keys under ``prefix``
    (None: they are not one subtree, e.g. flat keys that merely share ``module.``; nor when
    the weights' keys are as their files store them, which are not paths of the tree)."""
    if selection.weights is not None:
        return None
    path = (f"{selection.section}." if selection.section else "") + prefix[:-1]
    try:
        node = ckpt.section(path)
    except InputError:
        return None
    below = {record.key for record in tensors(node, path)}
    under = {r.key for key, r in selection.tensors.items() if key.startswith(prefix)}
    return path if below and below == under else None


def _part(label: str, section: str | None) -> str:
    return f"{label}'s {section!r} section" if section else f"all of {label}"


@dataclass(frozen=True)
class Rest:
    """What one side holds outside the section compared."""

    tensors: dict[str, TensorRecord]  # keyed as the file keys them
    tree: dict[Any, Any]  # the root without the section (its fields)
    entries: tuple[str, ...]  # the top-level entries that hold them ("optimizer", "epoch")


def compare_rest(
    ckpt_a: Checkpoint,
    part_a: Part,
    ckpt_b: Checkpoint,
    part_b: Part,
    keys: set[str],
    notes: list[str],
) -> tuple[list[TensorPair], list[FieldDiff]]:
    """Rule 4: when the parts are each side's weights (the layouts differ), the tensors and
    fields both sides hold outside them, paired by the keys the files use (``keys``: those
    the weights' pairs already take), when the two sides name at least one such entry alike
    (``optimizer``, ``epoch``); else a note naming what was not compared, and nothing (a
    resume file against a plain state dict, a torchtitan ``step-N/``'s training state against
    a model directory's ``config``)."""
    if not part_a.by_kind:
        return [], []
    rest_a = _rest(ckpt_a, part_a.selection.section)
    rest_b = _rest(ckpt_b, part_b.selection.section)
    if rest_a is None and rest_b is None:
        return [], []
    if rest_a is None or rest_b is None or not set(rest_a.entries) & set(rest_b.entries):
        held = [
            f"{label}'s {_listed(rest.entries)} (outside its {section!r} section)"
            for label, rest, section in (
                ("A", rest_a, part_a.selection.section), ("B", rest_b, part_b.selection.section)
            )
            if rest is not None
        ]  # fmt: skip
        notes.append(
            f"not compared: {' and '.join(held)}: "
            + ("the other side holds nothing under those names" if len(held) == 1
               else "the two sides hold nothing under the same names")
        )  # fmt: skip
        return [], []
    clash = sorted((rest_a.tensors.keys() | rest_b.tensors.keys()) & keys)
    if clash:
        notes.append(
            f"not compared: A's {_listed(rest_a.entries)} and B's {_listed(rest_b.entries)}, "
            f"outside the sections compared: {clash[0]!r} is also a key of the weights "
            "(use --section-a/--section-b to compare them)"
        )
        return [], []
    pairs = match_tensors(rest_a.tensors, rest_b.tensors)
    fields = compare_fields(rest_a.tree, rest_b.tree)
    fields, pairs = merge_type_changes(fields, pairs, (), ())
    notes.append(
        f"also compared, under the files' own keys: what both hold outside those sections (A: "
        f"{_listed(rest_a.entries)}; B: {_listed(rest_b.entries)})"
    )
    return pairs, fields


def _rest(ckpt: Checkpoint, section: str | None) -> Rest | None:
    """What ``ckpt`` holds outside ``section`` (None: nothing, or the side is compared whole)."""
    root = ckpt.root
    if section is None or not isinstance(root, dict):
        return None
    tree = _without(root, section.split("."))
    if tree is None:
        return None
    start = section + "."
    kept = {r.key: r for r in ckpt.tensors() if r.key != section and not r.key.startswith(start)}
    fields = scalar_fields(tree)
    held = [*kept, *fields]
    entries = tuple(
        str(name)
        for name in tree
        if any(key == str(name) or key.startswith(f"{name}.") for key in held)
    )
    return Rest(kept, tree, entries) if entries else None


def _without(node: dict[Any, Any], path: list[str]) -> dict[Any, Any] | None:
    """A shallow copy of ``node`` without the entry at ``path`` (None: no such entry)."""
    head, *tail = path
    if head not in node:
        return None
    if not tail:
        return {key: value for key, value in node.items() if key != head}
    child = node[head]
    if not isinstance(child, dict):
        return None
    pruned = _without(child, tail)
    return None if pruned is None else {**node, head: pruned}


def _listed(entries: tuple[str, ...]) -> str:
    shown = ", ".join(entries[:8])
    return shown + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
