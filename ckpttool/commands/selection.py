"""Which tensors an operation works on, and under which names: sections and key prefixes.

Shared by ``diff`` and ``convert``: a resume checkpoint's weights live under ``model``, a
Lightning checkpoint's under ``state_dict``; DDP and ``torch.compile`` add ``module.`` and
``_orig_mod.`` to every key.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckpttool.checkpoint import Checkpoint
from ckpttool.errors import CorruptCheckpointError, InputError, LayoutError, SameKeyError
from ckpttool.formats.registry import carries_metadata
from ckpttool.frameworks.base import PARTS, Placeholders
from ckpttool.frameworks.registry import file_placeholders
from ckpttool.model.records import (
    TensorRecord,
    paths_of,
    tensor_keys,
    tensor_subclasses,
    tensors,
)
from ckpttool.model.roles import WRAPPER_PREFIXES as WRAPPER_PREFIXES  # diff and convert's door
from ckpttool.model.roles import layout_of, model_part, model_section
from ckpttool.model.structure import find_parts
from ckpttool.model.text import plural

#: safetensors ``__metadata__`` key under which ``convert`` records ``{alias: stored name}``.
ALIASES_KEY = "ckpttool.aliases"
SOURCE_KEY = "ckpttool.source"
VERSION_KEY = "ckpttool.version"
#: Keys convert computes itself; a safetensors source's values for them are not carried over,
#: and none of them declares an alias.
OWN_KEYS = frozenset({"format", SOURCE_KEY, VERSION_KEY, ALIASES_KEY})
#: A component (``--component``) is a section: naming both for one side is refused.
COMPONENT_OR_SECTION = "a component and a section both pick a part: give one"


@dataclass(frozen=True)
class Selection:
    """Which tensors a command works on, and under which names: the options ``--section``,
    ``--strip-prefix``, ``--ignore-wrappers`` and ``--filter``, as ``diff`` and ``convert``
    take them, and ``convert``'s ``--drop``, ``--rename``, ``--map`` and ``--use-ema`` (the
    rules ``edit`` applies too; ``diff`` takes ``--map`` for A) (built once by the command
    line, or from a library call's keywords)."""

    section: str | None = None  # the subtree used (None: the layout's model section, or all)
    strip: tuple[str, ...] = ()  # prefixes removed from every key (--strip-prefix)
    ignore_wrappers: bool = False  # remove DDP/torch.compile prefixes too (--ignore-wrappers)
    pattern: str | None = None  # --filter GLOB (convert); None: every tensor
    drop: tuple[str, ...] = ()  # --drop GLOB (convert): tensors left out
    rename: tuple[str, ...] = ()  # --rename REGEX=REPLACEMENT (convert): output names changed
    # --map FILE|PRESET: names and layout mapped (convert: after --drop and --rename, as edit;
    # diff: A's names, to compare with B's), with --map-param NAME=N numbers
    map: str | None = None
    map_params: tuple[tuple[str, int], ...] = ()
    use_ema: str | None = None  # --use-ema (convert): "" for the one EMA part, or its key
    component: str | None = None  # --component NAME: a named part's section (component_section)

    @property
    def prefixes(self) -> list[str]:
        """Every prefix removed from keys: ``strip``, then the wrappers' if ignored."""
        return [*self.strip, *(WRAPPER_PREFIXES if self.ignore_wrappers else ())]


@dataclass(frozen=True)
class Selected:
    """The tensors of one checkpoint an operation uses, keyed relative to ``section``."""

    layout: str
    section: str | None  # "model", "state_dict", a user's --section, or None (whole file)
    auto: bool  # True when the section was chosen from the layout, not by the user
    tensors: dict[str, TensorRecord]  # normalised key -> record (record.key is the original)
    # a framework directory compared whole: the section its weights files fill, whose name was
    # taken off the keys under it (they are keyed as the files store them)
    weights: str | None = None


def component_section(ckpt: Checkpoint, name: str) -> str:
    """The section of the part ``name`` of a folder of named parts (a diffusers pipeline's
    ``unet``, a sentence-transformers folder's ``2`` or ``2_Dense``): its tensors keyed as the
    part's own files store them, as the part's folder alone reads. Raises
    :class:`~ckpttool.errors.InputError` where ``ckpt`` has no parts, no part ``name``, or a part
    without weights."""
    part = find_part(ckpt, name)
    if part is None:
        raise InputError(unknown_component(ckpt, name))
    if not part.get("tensors"):
        raise InputError(
            f"{ckpt.name}: component {part['name']!r} ({part.get('type')}) has no weights"
        )
    return str(part["section"])


def find_part(ckpt: Checkpoint, name: str) -> dict[str, Any] | None:
    """The part ``name`` (its name or its folder) of a folder of named parts, as
    ``details["parts"]`` lists it; None where it has no such part. Raises
    :class:`~ckpttool.errors.InputError` where ``ckpt`` has no parts at all."""
    parts = ckpt.details.get(PARTS)
    if not isinstance(parts, list) or not parts:
        raise InputError(
            f"{ckpt.name}: no components to pick {name!r} from (components are the parts of a "
            "diffusers pipeline or sentence-transformers model folder, or the files of a zip or "
            "folder of checkpoint files)"
        )
    for part in parts:
        if name in (part["name"], part.get("folder") or part["name"]):
            return dict(part)
    return None


def unknown_component(ckpt: Checkpoint, name: str) -> str:
    """The message for a component ``name`` that ``ckpt`` does not have, listing those it has."""
    shown = ", ".join(str(part["name"]) for part in ckpt.details.get(PARTS) or [])
    return f"{ckpt.name}: no component {name!r}; its components: {shown}"


def in_folder(path: str, folder: str | None) -> bool:
    """Whether ``path`` (a file relative to a directory checkpoint, or a folder ``name/``) lies
    in ``folder`` itself ("": the root; None: anywhere), as the part of a multi-component folder
    kept there owns it."""
    if folder is None:
        return True
    owner = path.rstrip("/") if path.endswith("/") else posixpath.dirname(path)
    return posixpath.normpath(owner or ".") == posixpath.normpath(folder or ".")


def with_component(ckpt: Checkpoint, selection: Selection) -> Selection:
    """``selection`` with its ``component`` turned into its section (unchanged without one)."""
    if selection.component is None:
        return selection
    if selection.section is not None:
        raise InputError(COMPONENT_OR_SECTION)
    section = component_section(ckpt, selection.component)
    return replace(selection, section=section, component=None)


def side_section(ckpt: Checkpoint, section: str | None, component: str | None) -> str | None:
    """One side's section where ``diff`` names it: ``section``, or ``component``'s."""
    if component is None:
        return section
    if section is not None:
        raise InputError(COMPONENT_OR_SECTION)
    return component_section(ckpt, component)


def strip_prefixes(key: str, prefixes: Sequence[str]) -> str:
    """Remove any of ``prefixes`` from the start of ``key``, repeatedly (``module._orig_mod.x``)."""
    changed = True
    while changed:
        changed = False
        for prefix in prefixes:
            if prefix and key.startswith(prefix):
                key = key[len(prefix) :]
                changed = True
    return key


def leading_wrappers(key: str) -> str:
    """The DDP/``torch.compile`` prefixes that lead ``key`` (``"module._orig_mod."``), or ""."""
    return key[: len(key) - len(strip_prefixes(key, WRAPPER_PREFIXES))]


def wrapper_hint(keys: Iterable[str]) -> tuple[int, list[str]]:
    """How many of ``keys`` start with wrapper prefixes, and which prefixes (first seen first)."""
    count = 0
    prefixes: dict[str, None] = {}
    for key in keys:
        if key.startswith(WRAPPER_PREFIXES):
            count += 1
            prefixes.setdefault(leading_wrappers(key))
    return count, list(prefixes)


def normalise(
    records: Iterable[TensorRecord],
    *,
    section: str | None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
) -> dict[str, TensorRecord]:
    """Key each record by its path below ``section`` with prefixes removed.

    Raises :class:`InputError` when two tensors end up with the same name.
    """
    prefixes = list(strip) + (list(WRAPPER_PREFIXES) if ignore_wrappers else [])
    out: dict[str, TensorRecord] = {}
    for record in records:
        key = record.key
        if section and key.startswith(section + "."):
            key = key[len(section) + 1 :]
        key = strip_prefixes(key, prefixes)
        if key in out:
            if out[key].key == record.key:
                raise SameKeyError(record.key)
            raise InputError(
                f"after removing prefixes, {out[key].key!r} and {record.key!r} are both {key!r}"
            )
        out[key] = record
    return out


def same_key_message(ckpt: Checkpoint, key: str) -> str:
    """The error for :class:`SameKeyError`: the file, the key and both paths to it."""
    paths = " and ".join(paths_of(ckpt.root, key)) or "two tensors"
    return (
        f"{ckpt.name}: two paths flatten to the same key {key!r}: {paths}; tensors are named "
        "by their dotted path, which cannot tell them apart"
    )


def select(
    ckpt: Checkpoint,
    *,
    section: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
    auto_section: bool = True,
    weights: str | None = None,
) -> Selected:
    """The weights of ``ckpt``: ``section`` if given, else the layout's model section.

    ``weights``: with no section, the section a framework directory's weights files fill;
    the keys under it lose its name (as the files store them).
    """
    layout = layout_of(ckpt)
    auto = False
    if section is None and auto_section:
        section = model_section(layout, ckpt.root)
        auto = section is not None
    if section:
        records, weights = tensors(ckpt.section(section), section), None
    else:
        records = ckpt.tensors()
    try:
        keyed = normalise(
            records, section=section or weights, strip=strip, ignore_wrappers=ignore_wrappers
        )
    except SameKeyError as error:
        raise InputError(same_key_message(ckpt, error.key)) from None
    return Selected(layout, section, auto, keyed, weights)


def dequantized_subclasses(
    ckpt: Checkpoint, named: dict[str, TensorRecord]
) -> tuple[dict[str, TensorRecord], list[str]]:
    """``named`` with the inner tensors of each quantized tensor subclass (torchao's
    ``0.weight.qdata``, ``.scale``, ``.zero_point``) replaced by its dequantized values under
    its own name (``0.weight``), in the place of its first inner tensor; and the keys of the
    subclasses so replaced. The one path of ``convert --dequantize`` and
    ``ckpttool.load_state_dict(dequantize=True)``."""
    subclasses = tensor_subclasses(ckpt.root, outermost=True)
    if not subclasses:
        return named, []
    # (here: listing a file, as show does through this module, never reads values)
    from ckpttool.io.subclass_values import dequantized_subclass, subclass_scheme

    name_of = {record.key: name for name, record in named.items()}
    replaced: dict[str, TensorRecord] = {}  # output name of the first inner tensor -> values
    dropped: set[str] = set()
    for key, obj in subclasses.items():
        inner = [f"{key}.{name}" for name in tensor_keys(obj)]
        if not inner or not all(k in name_of for k in inner):
            continue  # not selected
        data_path = subclass_scheme(obj).data
        out_name = name_of[f"{key}.{data_path}"].removesuffix(f".{data_path}")
        replaced[name_of[inner[0]]] = dequantized_subclass(ckpt, obj, key)
        dropped.update(name_of[k] for k in inner)
        name_of[inner[0]] = out_name
    if not replaced:
        return named, []
    out: dict[str, TensorRecord] = {}
    for name, record in named.items():
        if name in replaced:
            out[name_of[record.key]] = replaced[name]
        elif name not in dropped:
            out[name] = record
    return out, [record.key for record in replaced.values()]


def refuse_without_model(
    ckpt: Checkpoint,
    layout: str,
    what: str,
    hint: str = "name a part with --section (or pick tensors with --filter) to take them anyway",
) -> None:
    """Raise :class:`~ckpttool.errors.LayoutError` where ``ckpt`` holds no model weights, only
    training state: every tensor lies in an optimizer, RNG or trainer state found by its
    structure (torchtune's ``recipe_state.pt``, a bare ``optimizer.pt``). ``what``: the
    operation refused, for the message ("nothing to convert"); ``hint``: how to take the
    tensors anyway. A file whose model part is
    known, or that holds any other tensor, passes: its weights are what it holds."""
    if model_part(ckpt.root, layout) is not None:
        return
    parts = find_parts(ckpt.root)
    held = parts.training_only
    keys = [record.key for record in ckpt.tensors()]
    if not held or not keys or not all(_under_any(key, held) for key in keys):
        return
    counted = {
        (kind, key): sum(_under_any(k, (key,)) for k in keys)
        for kind, found in (
            ("an optimizer state", parts.optimizers),
            ("an RNG state", parts.rng),
            ("a scheduler/trainer state", parts.trainer),
        )
        for key in found
    }
    described = [
        f"{kind} in {key!r} ({n} {plural(n, 'tensor')})"
        if key
        else f"{kind} ({n} {plural(n, 'tensor')}: the whole file)"
        for (kind, key), n in counted.items()
        if n
    ]
    root = ckpt.root
    scalars = [str(k) for k, v in root.items() if isinstance(v, (int, float, str, bool))
               or v is None] if isinstance(root, dict) else []  # fmt: skip
    if scalars:
        shown = ", ".join(scalars[:4]) + (", ..." if len(scalars) > 4 else "")
        described.append(f"{len(scalars)} other {plural(len(scalars), 'value')} ({shown})")
    raise LayoutError(
        f"{ckpt.name}: no model weights, {what}: it holds only {', '.join(described)}; {hint}"
    )


def _under_any(key: str, parts: Iterable[str]) -> bool:
    return any(not part or key == part or key.startswith(f"{part}.") for part in parts)


def rekey(record: TensorRecord, key: str) -> TensorRecord:
    return replace(record, key=key)


def declared_aliases(
    metadata: Mapping[str, str], stored: Collection[str], ignore: Collection[str] = ()
) -> tuple[dict[str, str], bool]:
    """``{alias: stored name}`` that a safetensors file's ``__metadata__`` declares.

    Both conventions: ckpttool's ``ckpttool.aliases`` JSON object, and
    ``safetensors.torch.save_model``'s one entry per alias (a key that names no tensor, whose
    value names one). Only aliases of tensors in ``stored`` are kept. The flag is True when
    the ``ckpttool.aliases`` entry is there but is not a JSON object of names.
    """
    declared: dict[str, str] = {}
    malformed = False
    if ALIASES_KEY in metadata:
        try:
            parsed = json.loads(metadata[ALIASES_KEY])
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in parsed.items()
        ):
            declared.update(parsed)
        else:
            malformed = True
    for name, target in metadata.items():
        if name != ALIASES_KEY and name not in ignore and name not in stored and target in stored:
            declared.setdefault(name, target)
    return {alias: target for alias, target in declared.items() if target in stored}, malformed


def recorded_aliases(
    metadata: dict[str, str], stored: set[str], notes: list[str]
) -> dict[str, str]:
    """``{alias: stored}`` a safetensors file's ``__metadata__`` declares, as ``diff`` reads it.

    Both conventions: ckpttool's ``ckpttool.aliases`` JSON object, and
    ``safetensors.torch.save_model``'s one entry per alias (a key that is not a tensor whose
    value is one).
    """
    declared, malformed = declared_aliases(metadata, stored, ignore=OWN_KEYS)
    if malformed:
        notes.append(f"ignored {ALIASES_KEY} in the source's metadata: not a JSON object")
    return declared


def add_recorded_aliases(
    ckpt: Checkpoint, named: dict[str, TensorRecord], prefixes: list[str], notes: list[str]
) -> set[str]:
    """Give back the names a tied-weights file stored once, as its string metadata declares
    them (added to ``named``, keyed as ``prefixes`` key it: ``convert`` writes them,
    ``ckpttool.load_state_dict`` returns them); return the metadata keys used."""
    if not carries_metadata(ckpt.format):
        return set()
    stored = {record.key: record for record in named.values()}
    declared = recorded_aliases(ckpt.metadata, set(stored), notes)
    for alias, target in declared.items():
        name = strip_prefixes(alias, prefixes)
        if name not in named:
            named[name] = replace(stored[target], key=alias)
    return {alias for alias in declared if alias in ckpt.metadata}


def placeholders_of(ckpt: Checkpoint) -> Placeholders | None:
    """The tensors of ``ckpt`` that are 0-element placeholders for values it does not hold
    (a DeepSpeed ZeRO-3 rank's ``model_states.pt`` read alone), with their real shapes; None:
    none."""
    return file_placeholders(ckpt.root, ckpt.name)


def refuse_incomplete(ckpt: Checkpoint) -> None:
    """Raise :class:`CorruptCheckpointError` naming the files a framework directory lacks (a
    shard an index lists, a module's or component's weights, the model weights of a training
    state folder: ``details["missing"]``, what ``show`` and ``verify`` report): a command that
    writes or combines its tensors would quietly leave theirs out."""
    missing = [str(name) for name in ckpt.details.get("missing") or ()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CorruptCheckpointError(
            f"{ckpt.name}: incomplete: no {missing[0]}{more}; its tensors would be missing from "
            "the output (ckpttool verify lists what it lacks)"
        )


def refuse_placeholders(ckpt: Checkpoint, keys: Iterable[str]) -> None:
    """Raise :class:`InputError` (one line: which tensors, where their values are) when any of
    ``keys`` (tensor keys of ``ckpt``, as stored) is a placeholder: it is never written,
    returned or compared as a weight."""
    found = placeholders_of(ckpt)
    if found is None:
        return
    hit = [key for key in keys if key in found.shapes]
    if hit:
        raise InputError(f"{ckpt.name}: {found.refusal(hit)}")
