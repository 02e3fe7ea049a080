"""``convert`` into a framework's model directory (Hugging Face: one ``from_pretrained`` loads).

The framework says what its model directory holds
(:meth:`~ckpttool.frameworks.base.Framework.model_directory`); this module writes it. When SRC
is a Hugging Face model directory (or its index file) or a Trainer ``checkpoint-N/``
and DST names a directory (an existing one, a path ending in ``/``, or a path without a
suffix), the output is a model directory as transformers' ``save_pretrained`` writes it:
``model.safetensors`` (or ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` with ``--max-shard-size``), and the source's ``config.json``
and ``generation_config.json`` copied byte for byte, but for ``config.json``'s dtype after
``--dtype`` (:func:`config_dtype`: ``from_pretrained`` loads the weights in the dtype it says).

Tied weights are stored under the name transformers keeps: it drops the output embedding
(``lm_head.weight``) and ties it back to the input embedding from the config's
``tie_word_embeddings`` when loading, so the input embedding is the name stored and the output
embedding is recorded as its alias.

The directory appears all-or-nothing (:func:`ckpttool.io.atomic.staged_directory`): every
file is written into a temp directory next to DST, fsynced, verified, and the temp directory is
renamed to DST. An existing DST is replaced only with ``force`` and only when it holds nothing
but a model directory's files; it is swapped out, and removed once the new one is in place.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.convert.output import INDEX_SUFFIX, OutFile
from ckpttool.commands.convert.plan import FIELD_PREFIX, Plan
from ckpttool.errors import InputError, OutputExistsError
from ckpttool.frameworks.base import (
    MAX_JSON_BYTES,
    MODEL_CONFIG,
    ModelDirectoryOutput,
    config_with_dtype,
    list_files,
)
from ckpttool.frameworks.registry import framework_of
from ckpttool.io.atomic import staged_directory as _staged
from ckpttool.io.source import join, read_small


def model_directory(ckpt: Checkpoint) -> ModelDirectoryOutput | None:
    """What the model directory of ``ckpt``'s framework holds (None: ``ckpt`` was not read
    from a framework's directory that has one)."""
    if ckpt.format != "directory":
        return None
    framework = framework_of(ckpt.details.get("layout"))
    return framework.model_directory(ckpt.details) if framework is not None else None


def wants_model_dir(
    output: ModelDirectoryOutput | None, dst: str | os.PathLike[str] | None
) -> bool:
    """DST names a directory for a source with a model directory: existing, ending in ``/``,
    no suffix."""
    if dst is None or output is None:
        return False
    path = Path(dst)
    if path.name.endswith(INDEX_SUFFIX):
        return False
    return path.is_dir() or str(dst).endswith(("/", os.sep)) or not path.suffix


def for_transformers(plan: Plan, output: ModelDirectoryOutput) -> Plan:
    """The plan with tied output embeddings as aliases of the input embedding, and without
    the metadata fields a model directory keeps elsewhere (``config.json``) or not at all."""
    aliases = dict(plan.aliases)
    by_name = {p.name: p for p in plan.stored}
    for output_name in output.tied_output_names:
        if output_name not in by_name:
            continue
        group = [alias for alias, kept in aliases.items() if kept == output_name]
        if not group:
            continue
        keep = sorted(group)[0]
        aliases = {a: (keep if k == output_name else k) for a, k in aliases.items() if a != keep}
        aliases[output_name] = keep
        by_name[keep] = replace(by_name.pop(output_name), name=keep)
    stored = [by_name[name] for name in plan.names if name in by_name]
    notes = list(plan.notes)
    entries = sorted({_entry(key) for key in plan.fields} - set(output.config_entries))
    if entries:
        notes.append(f"a model directory holds the model only; not written: {', '.join(entries)}")
    return replace(plan, stored=stored, aliases=aliases, fields={}, notes=notes)


def _entry(field_key: str) -> str:
    return field_key.removeprefix(FIELD_PREFIX).split(".")[0]


def check_target(output: ModelDirectoryOutput, target: Path, force: bool) -> None:
    """Refuse the source itself, a file, and an existing directory without ``force`` or with
    files a model directory does not hold (``force`` must never remove a user's other files)."""
    src_dir = output.directory
    if (
        isinstance(src_dir, Path)
        and target.exists()
        and src_dir.exists()
        and os.path.samefile(target, src_dir)
    ):
        raise InputError(f"{target}: the output would overwrite the source; name another DST")
    if target.exists() and not target.is_dir():
        raise InputError(f"{target}: exists and is not a directory")
    if not target.parent.is_dir():
        raise InputError(f"{target.parent}: no such directory for the output")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not force:
        raise OutputExistsError(f"{target} exists and is not empty; pass --force to replace it")
    others = sorted(p.name for p in target.iterdir() if not (p.is_file() and output.owns(p.name)))
    if others:
        raise InputError(
            f"{target}: holds files a model directory does not ({', '.join(others[:3])}); "
            "--force replaces only a model directory; name another DST"
        )


def staged_directory(target: Path) -> contextlib.AbstractContextManager[Path]:
    """A temp directory next to ``target`` that becomes ``target`` on a clean exit (an existing
    one, which :func:`check_target` allowed, replaced); any exception leaves ``target`` as it was."""
    return _staged(target, replace_existing=True)


def copy_files(output: ModelDirectoryOutput, staging: Path) -> list[str]:
    """Copy the framework's files (Hugging Face: ``config.json`` and
    ``generation_config.json``) byte for byte, fsynced; return the names copied (from a URL's
    directory: those its listing holds)."""
    src_dir = output.directory
    copied = []
    listed = list_files(src_dir) if isinstance(src_dir, str) else None
    for name in output.copied_files:
        if listed is not None:
            if name not in listed:
                continue
            data = read_small(join(str(src_dir), name), MAX_JSON_BYTES)
        else:
            assert isinstance(src_dir, Path)
            source = src_dir / name
            if not source.is_file():
                continue
            data = source.read_bytes()
        with open(staging / name, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if (staging / name).read_bytes() != data:
            raise InputError(f"{name} did not copy byte for byte")
        copied.append(name)
    return copied


def config_dtype(plan: Plan, staging: Path, copied: list[str]) -> str | None:
    """The copied ``config.json`` saying the dtype ``plan`` casts the weights to (``--dtype``),
    as ``edit --dtype`` of a model directory says it
    (:func:`~ckpttool.frameworks.base.config_with_dtype`), fsynced; as copied when nothing is
    cast. Returns the note that says so (None: copied as it was)."""
    cast = {p.dtype for p in plan.stored if p.dtype != p.record.dtype}
    if MODEL_CONFIG not in copied or len(cast) != 1:
        return None
    (dtype,) = cast
    config = staging / MODEL_CONFIG
    config_with_dtype(config, dtype)
    with open(config, "rb+") as handle:
        os.fsync(handle.fileno())
    return f"{MODEL_CONFIG}: its dtype set to {dtype}, the weights' (from_pretrained loads them so)"


def moved(files: list[OutFile], target: Path) -> list[OutFile]:
    """``files`` as they are named once the staging directory became ``target``."""
    return [replace(f, target=target / f.target.name) for f in files]
