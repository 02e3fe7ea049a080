"""The frameworks ckpttool knows, in detection order, as import strings.

Each line names a :class:`~ckpttool.frameworks.base.Framework` instance (``module:NAME``) and
the ``details["layout"]`` values it answers for, so that finding the framework of an open
checkpoint imports that framework alone, and start-up imports none. Adding a framework is one
line here (see docs/development.md, "How to add a framework").

Order matters: Lightning's sharded checkpoints first (a DCP directory with ``meta.pt``: no other
framework's files), torchtitan's ``step-N/`` DCP directories next; torchtune's ``epoch_N/`` (a model
directory with an adapter beside it, named by the epoch) before PEFT and Hugging Face; PEFT next (a Trainer ``checkpoint-N/`` of a PEFT model holds the adapter
instead of the weights); sentence-transformers next (its root module is a Hugging Face model
directory, with ``modules.json`` beside it); diffusers next (``model_index.json``, or
``config.json`` beside ``diffusion_pytorch_model*``: no other framework's names); accelerate next (its folders hold a ``model.safetensors`` like a model
directory does); DeepSpeed next (a Trainer ``checkpoint-N/`` of a DeepSpeed run holds a
``global_stepN/`` too); Megatron next (``mp_rank_XX/`` folders, or a DCP directory with
``metadata.json``); per-rank sets next (a directory of ``*rank<N>.pt`` files); the generic
container of checkpoint files last (a folder of differently named checkpoint files that no
framework above names: each file a part).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpttool.formats.base import Parsed
    from ckpttool.frameworks.base import Framework, FrameworkDirectory, Placeholders

#: (import string, the layouts it detects), in detection order.
FRAMEWORKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ckpttool.frameworks.lightning_sharded.framework:FRAMEWORK", ("lightning_sharded",)),
    ("ckpttool.frameworks.torchtitan.framework:FRAMEWORK", ("torchtitan", "torchtitan_run")),
    ("ckpttool.frameworks.torchtune.framework:FRAMEWORK", ("torchtune", "torchtune_run")),
    ("ckpttool.frameworks.peft.framework:FRAMEWORK", ("peft_adapter",)),
    ("ckpttool.frameworks.sentence_transformers.framework:FRAMEWORK", ("sentence_transformers",)),
    ("ckpttool.frameworks.diffusers.framework:FRAMEWORK", ("diffusers_model", "diffusers_ema", "diffusers_pipeline")),
    ("ckpttool.frameworks.accelerate.framework:FRAMEWORK", ("accelerate",)),
    ("ckpttool.frameworks.huggingface.framework:FRAMEWORK", ("hf_model", "hf_trainer", "hf_trainer_output")),
    ("ckpttool.frameworks.deepspeed.framework:FRAMEWORK", ("deepspeed",)),
    ("ckpttool.frameworks.megatron.framework:FRAMEWORK", ("megatron_torch_dist", "megatron_legacy")),
    ("ckpttool.frameworks.rank_set.framework:FRAMEWORK", ("rank_set",)),
    ("ckpttool.frameworks.container.framework:FRAMEWORK", ("checkpoint_parts",)),
)  # fmt: skip

#: The frameworks that also read a file no format reads as an archive of checkpoint files (a zip
#: of ``.pth`` members): the door asks them after every format has refused the file.
READS_ARCHIVES: frozenset[str] = frozenset({
    "ckpttool.frameworks.container.framework:FRAMEWORK",
})  # fmt: skip

#: The frameworks whose layouts are directories a directory format reads too (a DCP directory
#: with a file of the framework's own beside it, or a DCP directory named as the framework
#: names its checkpoints): the door asks them before it opens such a directory as the format's.
BEFORE_DIRECTORY_FORMATS: frozenset[str] = frozenset({
    "ckpttool.frameworks.lightning_sharded.framework:FRAMEWORK",
    "ckpttool.frameworks.torchtitan.framework:FRAMEWORK",
    "ckpttool.frameworks.megatron.framework:FRAMEWORK",
})  # fmt: skip

#: (a top-level key of a single file, the framework that may find placeholders in it:
#: :meth:`~ckpttool.frameworks.base.Framework.file_placeholders`): the key is looked up before
#: the framework is imported, so a file without it imports none.
FILE_MARKS: tuple[tuple[str, str], ...] = (
    ("param_shapes", "ckpttool.frameworks.deepspeed.framework:FRAMEWORK"),
)

_loaded: dict[str, Framework] = {}


def load(spec: str) -> Framework:
    """The framework an import string names (imported once)."""
    found = _loaded.get(spec)
    if found is None:
        module, _, name = spec.partition(":")
        found = _loaded[spec] = getattr(importlib.import_module(module), name)
    return found


def frameworks() -> Iterator[Framework]:
    """Every framework, in detection order (each imported when reached)."""
    for spec, _ in FRAMEWORKS:
        yield load(spec)


def file_placeholders(root: object, path: str) -> Placeholders | None:
    """The 0-element placeholders of the single file ``path`` (its tree ``root``) that a
    framework recognises by its mark (:data:`FILE_MARKS`); None: none."""
    if not isinstance(root, dict):
        return None
    for mark, spec in FILE_MARKS:
        if mark in root:
            found = load(spec).file_placeholders(root, path)
            if found is not None:
                return found
    return None


def framework_of(layout: object) -> Framework | None:
    """The framework whose directories have ``details["layout"] == layout`` (None for any
    other checkpoint: nothing is imported then)."""
    for spec, layouts in FRAMEWORKS:
        if layout in layouts:
            return load(spec)
    return None


def verified_file_by_file(found: FrameworkDirectory | dict[str, Any]) -> bool:
    """Whether ``verify`` and ``repair`` take the checkpoint (a detected layout, or an opened
    directory's ``details``) as a plain directory, file by file (a folder of parts): its
    framework's :meth:`~ckpttool.frameworks.base.Framework.verified_file_by_file`."""
    if not isinstance(found, dict):
        found = {"layout": found.kind, "layout_title": found.title}
    framework = framework_of(found.get("layout"))
    return framework is not None and framework.verified_file_by_file(found)


def detect_directory(
    path: str, known: dict[str, FrameworkDirectory | None] | None = None
) -> FrameworkDirectory | None:
    """The layout of ``path`` (a directory, or an ``*.index.json`` file) by the first framework
    that knows it, or None. ``known`` holds what frameworks already answered for ``path`` (by
    name), so that one open asks each framework once."""
    for framework in frameworks():
        layout = detect_once(framework, path, known)
        if layout is not None:
            return layout
    return None


def detect_before_format(
    path: str, known: dict[str, FrameworkDirectory | None] | None = None
) -> FrameworkDirectory | None:
    """The layout of the directory ``path``, which a directory format (DCP) also reads, by a
    framework of :data:`BEFORE_DIRECTORY_FORMATS` (None: it is the format's alone)."""
    for spec, _ in FRAMEWORKS:
        if spec in BEFORE_DIRECTORY_FORMATS:
            layout = detect_once(load(spec), path, known)
            if layout is not None:
                return layout
    return None


def detect_archive(
    path: str, known: dict[str, FrameworkDirectory | None] | None = None
) -> tuple[FrameworkDirectory, Framework] | None:
    """The layout of the file ``path``, which no format reads, as an archive of checkpoint files
    by a framework of :data:`READS_ARCHIVES`, with that framework (None: none knows it)."""
    for spec, _ in FRAMEWORKS:
        if spec in READS_ARCHIVES:
            framework = load(spec)
            layout = detect_once(framework, path, known)
            if layout is not None:
                return layout, framework
    return None


def detect_once(
    framework: Framework, path: str, known: dict[str, FrameworkDirectory | None] | None
) -> FrameworkDirectory | None:
    """``framework.detect(path)``, remembered in ``known``."""
    if known is None:
        return framework.detect(path)
    if framework.name not in known:
        known[framework.name] = framework.detect(path)
    return known[framework.name]


def read_directory(
    layout: FrameworkDirectory, framework: Framework, *, strict: bool, refuse_dangerous: bool
) -> tuple[Parsed, int]:
    """The directory ``framework`` detected as ``layout``, its members read and merged into
    one tree (:mod:`ckpttool.frameworks.tree`), and its size on disk."""
    from ckpttool.frameworks import tree

    parsed = tree.read_directory(
        layout, framework, strict=strict, refuse_dangerous=refuse_dangerous
    )
    return parsed, tree.directory_size(layout)
