"""What ``convert`` will write, decided from the reader's records before any byte is written.

Which tensors (section, prefixes, ``--filter``), under which names, in which dtype; which names
are aliases of a stored tensor (tied weights); which non-tensor entries become ``__metadata__``
fields and which are reported as left out. Pure functions over an open
:class:`~ckpttool.checkpoint.Checkpoint`; nothing here reads tensor bytes.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.mapped import (
    DerivedCheckpoint,
    config_dirs,
    declared_facts,
    map_named,
    step_counts,
)
from ckpttool.commands.selection import (
    OWN_KEYS,
    Selection,
    add_recorded_aliases,
    dequantized_subclasses,
    refuse_placeholders,
    refuse_without_model,
    select,
    wrapper_hint,
)
from ckpttool.errors import InputError
from ckpttool.formats.base import OutTensor
from ckpttool.formats.registry import carries_metadata
from ckpttool.frameworks.base import reported_layout
from ckpttool.model.dtypes import CASTABLE, TARGETS
from ckpttool.model.edits import compile_rules, renamed_key
from ckpttool.model.mapping import load_map
from ckpttool.model.records import (
    ITEMSIZE,
    TensorRecord,
    container_values,
    is_container,
    tensor_keys,
    tensor_subclasses,
    walk,
    without_values,
)

#: ``__metadata__`` key holding ``{"alias name": "stored name"}`` as a JSON object.
#: Prefix of the ``__metadata__`` keys that keep a checkpoint's scalar fields (JSON values).
FIELD_PREFIX = "ckpttool.field."
MAX_FIELD_CHARS = 1024  # longer strings are left out (listed in a note) rather than stored
MAX_FIELDS_PER_ENTRY = 64  # an entry with more scalars (RNG state, loop counters) is left out


@dataclass(frozen=True, slots=True)
class Planned:
    """One tensor to store: its output name, its source record and its output dtype."""

    name: str
    record: TensorRecord
    dtype: str
    kept: bool = False  # a sparse, nested or quantized tensor a .pth keeps as it is

    @property
    def out(self) -> OutTensor:
        return OutTensor(self.name, self.dtype, self.record.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.record.shape) * ITEMSIZE[self.dtype]  # self.out's, not built


@dataclass
class Plan:
    layout: str
    section: str | None
    names: list[str]  # every output name (stored and aliases), in source order
    stored: list[Planned]  # source order
    aliases: dict[str, str]  # alias name -> stored name
    fields: dict[str, str]  # FIELD_PREFIX + dotted key -> JSON value
    carried: dict[str, str]  # a safetensors source's own __metadata__ entries, kept
    left_out: list[str]  # entries not converted, described for a note
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what the output may not be as wanted

    @property
    def tensor_bytes(self) -> int:
        return sum(p.nbytes for p in self.stored)


def build_plan(
    ckpt: Checkpoint,
    choice: Selection,
    options: ConversionOptions,
    *,
    keep_kinds: bool = False,
) -> Plan:
    """Decide names, dtypes, aliases and metadata fields for converting ``ckpt``.

    Sparse and nested tensors are refused unless ``densify`` (then stored dense), quantized
    ones unless ``dequantize`` (then stored as float32 values, or cast to ``dtype``); with
    ``keep_kinds`` (a .pth output) those not densified or dequantized are kept as they are.
    Tensors the file holds no values of (DTensor shards, meta tensors) are refused unless
    ``skip_missing_values`` (then left out, with a note): an output never holds fewer tensors
    than were selected without the user asking for it."""
    section, strip, ignore_wrappers, pattern = (
        choice.section, choice.strip, choice.ignore_wrappers, choice.pattern
    )  # fmt: skip
    dtype, keep_shared, densify, dequantize, skip_missing_values = (
        options.dtype, options.keep_shared, options.densify, options.dequantize,
        options.skip_missing_values,
    )  # fmt: skip
    if dtype != "keep" and dtype not in TARGETS:
        raise InputError(f"--dtype must be one of keep, {', '.join(TARGETS)}; got {dtype!r}")
    selection = select(ckpt, section=section, strip=strip, ignore_wrappers=ignore_wrappers)
    if selection.section is None and selection.weights is None and pattern is None:
        refuse_without_model(ckpt, selection.layout, "nothing to convert")
    selected_keys = {record.key for record in selection.tensors.values()}
    named = dict(selection.tensors)
    notes: list[str] = []
    if dequantize:
        named, replaced = dequantized_subclasses(ckpt, named)
        if replaced:
            notes.append(
                f"dequantized {len(replaced)} tensor subclass(es) from their inner tensors: "
                f"{_some(replaced)}"
            )
    prefixes = choice.prefixes
    alias_entries = add_recorded_aliases(ckpt, named, prefixes, notes)
    if pattern is not None:
        named = filtered(named, pattern)
        if not named:
            raise InputError(
                f"{ckpt.name}: --filter {pattern!r} matches no tensor (it is matched against "
                "each tensor's key as show prints it, and the name it would be written under)"
            )
    if choice.drop:
        named = {
            k: r for k, r in named.items()
            if not any(fnmatch.fnmatchcase(r.key, p) or fnmatch.fnmatchcase(k, p) for p in choice.drop)
        }  # fmt: skip
        if not named:
            raise InputError(f"{ckpt.name}: --drop leaves no tensor to convert")
    if choice.rename:
        named = _renamed(named, choice.rename, notes)
    if choice.map is not None:
        named = _mapped(ckpt, named, choice, notes, decode=options.dequantize)
    # a ZeRO-3 rank file's 0-element stand-ins: never written as the weights
    refuse_placeholders(ckpt, [r.key for r in named.values()])
    warnings = [] if ignore_wrappers else _wrapper_warning(named)
    kept = {k for k, r in named.items() if keep_kinds and _keeps(r, densify, dequantize)}
    _refuse_unwritable(
        {k: r for k, r in named.items() if k not in kept}, densify=densify, dequantize=dequantize
    )
    for what, keys in (
        ("densified", [k for k, r in named.items() if r.parts and k not in kept]),
        ("dequantized", [k for k, r in named.items() if r.quant is not None and k not in kept]),
        (KEPT_NOTE, [k for k in named if k in kept]),
    ):
        if keys:
            notes.append(f"{what} {len(keys)} tensor(s): {_some(keys)}")
    missing = [k for k, r in named.items() if r.is_meta]
    if missing:
        named = _leave_out_missing(ckpt.name, named, missing, skip_missing_values, notes)
    if not named:
        where = f" in section {selection.section!r}" if selection.section else ""
        why = f": {notes[-1]}" if missing else ""
        raise InputError(f"{ckpt.name}: no tensors to convert{where}{why}")
    target = TARGETS.get(dtype)
    uncastable = sorted(
        {
            r.dtype
            for k, r in named.items()
            if target and r.is_floating and r.dtype not in CASTABLE and k not in kept
        }
    )
    if uncastable:
        notes.append(f"{', '.join(uncastable)} tensors are kept as they are (not cast)")
    if target and kept:
        notes.append(f"sparse, nested and quantized tensors are not cast: {_some(sorted(kept))}")
    aliases = {} if keep_shared else find_aliases(named)
    stored = [
        Planned(name, record, record.dtype, kept=True)
        if name in kept
        else Planned(name, record, _output_dtype(record, target))
        for name, record in named.items()
        if name not in aliases
    ]
    fields, left_out = collect_fields(ckpt.root, selection.section, selected_keys)
    if not ckpt.without_objects:  # (no tensor subclass in a tree without objects)
        fields.update(subclass_fields(ckpt.root, {r.key for r in named.values()}))
    carried = {}
    if carries_metadata(ckpt.format):
        # the file's string metadata travels with it (safetensors: save_model-style alias
        # entries are re-recorded under ckpttool.aliases)
        skip = OWN_KEYS | alias_entries
        carried = {k: v for k, v in ckpt.metadata.items() if k not in skip}
    return Plan(reported_layout(ckpt, selection.layout), selection.section, list(named), stored, aliases, fields,
                carried, left_out, notes, warnings)  # fmt: skip


#: The field (after ``ckpttool.field.<key>``) that says what a tensor subclass kept as its
#: inner tensors was.
SUBCLASS_FIELD = "__tensor_subclass__"


def subclass_fields(root: Any, written: set[str]) -> dict[str, str]:
    """Per tensor subclass whose inner tensors are written (not dequantized), a metadata field
    ``ckpttool.field.<key>.__tensor_subclass__`` naming its class, logical dtype and shape,
    block size and inner tensors (JSON): what the inner tensors stand for."""
    fields = {}
    for key, obj in tensor_subclasses(root, outermost=True).items():
        inner = tensor_keys(obj)
        if not inner or not all(f"{key}.{name}" in written for name in inner):
            continue
        block = obj.fact("block_size")
        facts = {
            "class": obj.cls,
            "dtype": obj.dtype,
            "shape": list(obj.shape),
            "block_size": list(block) if isinstance(block, (list, tuple)) else None,
            "inner": inner,
        }
        fields[f"{FIELD_PREFIX}{key}.{SUBCLASS_FIELD}"] = json.dumps(facts)
    return fields


def _wrapper_warning(named: dict[str, TensorRecord]) -> list[str]:
    """Names that would be written with DDP/torch.compile prefixes: said, with the option."""
    count, prefixes = wrapper_hint(named)
    if not count:
        return []
    which = " and ".join(repr(p) for p in prefixes)
    return [
        f"{count} of the {len(named)} tensor names start with the DDP/torch.compile wrapper "
        f"prefix {which} and are written with it; add --ignore-wrappers to remove it"
    ]


def _renamed(
    named: dict[str, TensorRecord], rules: tuple[str, ...], notes: list[str]
) -> dict[str, TensorRecord]:
    """The output names after ``--rename`` (``edit``'s rules, on the names written); two
    tensors given one name are an error."""
    compiled = compile_rules(rules)
    counts = [0] * len(compiled)
    out: dict[str, TensorRecord] = {}
    origin: dict[str, str] = {}
    for name, record in named.items():
        new = renamed_key(name, compiled, counts)
        if new in out:
            raise InputError(f"--rename: {origin[new]!r} and {name!r} would both be named {new!r}")
        out[new] = record
        origin[new] = name
    notes.extend(f"--rename {rule!r}: {count} name(s)" for rule, count in zip(rules, counts))
    return out


def _mapped(
    ckpt: Checkpoint,
    named: dict[str, TensorRecord],
    choice: Selection,
    notes: list[str],
    *,
    decode: bool,
) -> dict[str, TensorRecord]:
    """The output names and tensors after ``--map`` (``edit``'s maps and presets, on the names
    written, after ``--drop`` and ``--rename`` as in ``edit``); the tensors a rule computes are
    read through ``ckpt``, which must be a :class:`DerivedCheckpoint` (``decode``: those made
    from tensors quantized in blocks are made from their float32 values, with --dequantize)."""
    assert choice.map is not None
    if not isinstance(ckpt, DerivedCheckpoint):
        raise TypeError("convert --map reads the source as a DerivedCheckpoint (with_derived)")
    spec = load_map(
        choice.map, dict(choice.map_params), config_dirs([ckpt.name]), declared_facts(ckpt)
    )
    mapped, steps, unmatched = map_named(named, spec, ckpt, decode=decode)
    notes.append(f"--map {choice.map}: {step_counts(steps)}")
    if unmatched:
        kept = "kept under their own names" if spec.unmatched == "keep" else "left out"
        notes.append(f"--map {choice.map}: {len(unmatched)} tensor(s) no rule maps {kept}: "
                     f"{_some(unmatched)}")  # fmt: skip
    if not mapped:
        raise InputError(f"{ckpt.name}: --map {choice.map} leaves no tensor to convert")
    return mapped


def filtered(named: dict[str, TensorRecord], pattern: str) -> dict[str, TensorRecord]:
    """The tensors ``--filter`` keeps: those whose key in the file (as ``show`` prints it and
    matches it: ``model.model.layers.0.mlp.up_proj.weight`` in a resume file) or whose output
    name (below the section, prefixes removed: ``model.layers.0.mlp.up_proj.weight``) matches
    ``pattern``, so that a pattern means the same in both commands."""
    match = fnmatch.fnmatchcase
    return {k: r for k, r in named.items() if match(r.key, pattern) or match(k, pattern)}


def _leave_out_missing(
    source: str,
    named: dict[str, TensorRecord],
    missing: list[str],
    skip: bool,
    notes: list[str],
) -> dict[str, TensorRecord]:
    """``named`` without the tensors that have no values, when ``skip``; else the error that
    says why they have none and what to do."""
    reasons = "; ".join(without_values([named[k] for k in missing]))
    if not skip:
        raise InputError(
            f"{source}: {len(missing)} of the {len(named)} tensors selected "
            f"{'has' if len(missing) == 1 else 'have'} no values in this file, so nothing was "
            f"written: {reasons}. To write the other tensors without them, add "
            "--skip-missing-values"
        )
    notes.append(
        f"left out {len(missing)} tensor(s) without values (--skip-missing-values): "
        f"{_some(missing)}; {reasons}"
    )
    left_out = set(missing)
    return {k: r for k, r in named.items() if k not in left_out}


def _output_dtype(record: TensorRecord, target: str | None) -> str:
    """What a tensor is stored as: cast to ``target`` if floating, a quantized one as its
    dequantized float32 values (or ``target``)."""
    if record.quant is not None:
        return target or "float32"
    return target if target and record.dtype in CASTABLE else record.dtype


KEPT_NOTE = "kept (sparse, nested or quantized, in torch's own form)"


def _keeps(record: TensorRecord, densify: bool, dequantize: bool) -> bool:
    """Whether a .pth output keeps ``record`` as it is: a nested tensor always (it has no
    dense form), a sparse one unless ``densify``, a quantized one unless ``dequantize``."""
    if record.layout == "nested":
        return True
    if record.parts:
        return not densify
    # GGUF's block quantization has no torch form: it is dequantized or refused
    return record.quant is not None and not record.quant.in_blocks and not dequantize


def _refuse_unwritable(named: dict[str, TensorRecord], *, densify: bool, dequantize: bool) -> None:
    """Sparse, nested and quantized tensors in a safetensors output: it has no such layouts
    or schemes; they are written dense (--densify) or dequantized (--dequantize) when asked,
    never as anonymous parts. (A .pth output keeps them: ``_keeps``.)"""
    for name, record in named.items():
        if record.layout == "nested":
            raise InputError(
                f"{name}: a nested tensor; safetensors cannot hold its ragged values. Write a "
                ".pth (--to pth keeps it), or leave it out with --filter"
            )
        if record.parts and not densify:
            raise InputError(
                f"{name}: a {record.layout} tensor; safetensors stores dense tensors only: add "
                "--densify to store its dense values, --to pth to keep it as it is, or leave it "
                "out with --filter"
            )
        if record.quant is not None and record.quant.in_blocks and not dequantize:
            raise InputError(
                f"{name}: a {record.dtype} tensor, quantized in GGML blocks; neither safetensors "
                "nor torch stores them: add --dequantize to store its values (float32, or "
                "--dtype), or leave it out with --filter"
            )
        if record.quant is not None and not dequantize:
            raise InputError(
                f"{name}: a quantized {record.dtype} tensor ({record.quant.describe()}); "
                "safetensors stores no quantization: add --dequantize to store its float values, "
                "--to pth to keep it as it is, or leave it out with --filter"
            )


def find_aliases(named: dict[str, TensorRecord]) -> dict[str, str]:
    """Names that are the very same tensor as another (same storage, offset, shape, stride).

    Which name is stored follows ``safetensors.torch._remove_duplicate_names``: the first in
    sorted order (all names of a group cover the same elements, so all are equally complete).
    ``safetensors.torch.load_model`` accepts whichever name a file kept. Tensors that share a
    storage as *different* views are not aliases: each is stored with its own values.
    """
    groups: dict[Any, list[str]] = {}
    for name, record in named.items():
        if record.storage is None or record.inline_data is not None or record.numel == 0:
            continue
        view = (record.storage, record.dtype, record.storage_offset, record.shape, record.stride)
        groups.setdefault(view, []).append(name)
    aliases: dict[str, str] = {}
    for names in groups.values():
        keep, *others = sorted(names)
        aliases.update({other: keep for other in others})
    return aliases


def collect_fields(
    root: Any, section: str | None, selected_keys: set[str]
) -> tuple[dict[str, str], list[str]]:
    """Scalar entries outside the weights as metadata fields; the rest described for a note.

    Entries are judged as a whole (``epoch``, ``config``, ``optimizer``...): one made only of
    scalars and short strings becomes ``ckpttool.field.<dotted key>`` fields with JSON values;
    any other (optimizer state, RNG state, bytes) is listed as left out, never dropped silently.
    """
    groups: dict[str, list[tuple[str, Any]]] = {}
    too_many: dict[str, int] = {}  # entries left out for sure: how many other values they hold
    # the root's children in walk's order where it is a dict, else the root itself
    tops = [(str(n), c) for n, c in root.items()] if root.__class__ is dict else [("", root)]
    for top, node in tops:
        # every leaf under a child is of the child's entry unless the section's name may start
        # its key (a key under it is the child's name or begins with it and a dot)
        by_child = bool(top) and not (
            section and (top.startswith(section) or f"{section}.".startswith(top))
        )
        entry = _entry_name(top, section)
        count = _plain_leaf_count(node) if by_child else None
        if count is not None:  # no key made for what is only counted
            groups.setdefault(entry, [])
            too_many[entry] = too_many.get(entry, 0) + count
            continue
        for key, leaf in walk(node, top):
            if isinstance(leaf, TensorRecord) and key in selected_keys:
                continue
            groups.setdefault(entry if by_child else _entry_name(key, section), []).append(
                (key, leaf)
            )
    fields: dict[str, str] = {}
    left_out: list[str] = []
    for entry, leaves in groups.items():
        if (
            entry not in too_many
            and len(leaves) <= MAX_FIELDS_PER_ENTRY
            and all(_is_small_scalar(v) for _, v in leaves)
        ):
            fields.update({FIELD_PREFIX + key: json.dumps(value) for key, value in leaves})
            continue
        count = sum(isinstance(v, TensorRecord) for _, v in leaves)
        parts = [f"{count} tensor{'s' * (count != 1)}"] if count else []
        others = len(leaves) - count + too_many.get(entry, 0)
        if others:
            parts.append(f"{others} other value{'s' * (others != 1)}")
        left_out.append(f"{entry or '(root)'} ({', '.join(parts)})")
    return fields, left_out


def _plain_leaf_count(node: Any) -> int | None:
    """How many leaves :func:`walk` yields under the container ``node`` when none of them is a
    tensor and the entry holding them is left out whatever else it holds (more than
    ``MAX_FIELDS_PER_ENTRY`` leaves, or one that is not a small scalar); else None. A
    keyless count: a lookup table of 150,000 small objects is half a million leaves
    (bench/object_table.py), and its keys were most of ``convert``'s time after the walk."""
    if not is_container(node):
        return None
    count = 0
    small = True
    stack = [node]
    while stack:
        current = stack.pop()
        for value in container_values(current) or ():
            kind = value.__class__
            if kind is int or kind is float or kind is bool or value is None:
                count += 1
            elif kind is str:
                count += 1
                small = small and len(value) <= MAX_FIELD_CHARS
            elif isinstance(value, TensorRecord):
                return None
            elif is_container(value):
                stack.append(value)
            else:
                count += 1
                small = small and _is_small_scalar(value)
    return count if count > MAX_FIELDS_PER_ENTRY or not small else None


def _entry_name(key: str, section: str | None) -> str:
    if section and key.startswith(section + "."):
        return f"{section}.{key[len(section) + 1 :].split('.')[0]}"
    return key.split(".")[0]


def _is_small_scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_FIELD_CHARS
    return value is None or isinstance(value, (bool, int, float))


def _some(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
