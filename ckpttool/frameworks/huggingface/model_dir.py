"""``convert`` into a Hugging Face model directory that ``from_pretrained`` loads.

When SRC is a Hugging Face model directory (or its index file) or a Trainer ``checkpoint-N/``
and DST names a directory (an existing one, a path ending in ``/``, or a path without a
suffix), the output is a model directory as transformers' ``save_pretrained`` writes it:
``model.safetensors`` (or ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` with ``--max-shard-size``), and the source's ``config.json``
and ``generation_config.json`` copied byte for byte.

Tied weights are stored under the name transformers keeps: it drops the output embedding
(``lm_head.weight``) and ties it back to the input embedding from the config's
``tie_word_embeddings`` when loading, so the input embedding is the name stored and the output
embedding is recorded as its alias.

The directory appears all-or-nothing: every file is written into a temp directory next to
DST, fsynced, verified, and the temp directory is renamed to DST. An existing DST is replaced
only with ``force`` and only when it holds nothing but a model directory's files; it is
renamed aside first, and removed once the new one is in place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from ckpttool.checkpoint import Checkpoint
from ckpttool.commands.convert.output import INDEX_SUFFIX, OutFile
from ckpttool.commands.convert.plan import FIELD_PREFIX, Plan
from ckpttool.errors import InputError, OutputExistsError
from ckpttool.frameworks.base import MAX_JSON_BYTES, list_files
from ckpttool.frameworks.huggingface.files import (
    BIN_SHARD,
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    HF_MODEL,
    HF_TRAINER,
    SAFE_SHARD,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from ckpttool.io.atomic import TMP_SUFFIX, fsync_dir
from ckpttool.io.source import is_url, join, read_small

#: The layouts whose model a model directory is written from.
SOURCE_LAYOUTS = (HF_MODEL, HF_TRAINER)
#: Copied byte for byte from the source directory when it has them.
COPIED_FILES = (CONFIG_NAME, GENERATION_CONFIG_NAME)
#: Output embeddings transformers drops when ``tie_word_embeddings`` ties them to the input
#: embedding (``_tied_weights_keys`` of the ``*ForCausalLM`` classes).
TIED_OUTPUT_NAMES = ("lm_head.weight",)
#: What ``save_pretrained`` writes besides shards (``--force`` replaces only such a directory).
MODEL_DIR_FILES = frozenset(
    {*COPIED_FILES, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
)
#: Top-level entries of a merged model directory that its copied JSON files already hold.
CONFIG_ENTRIES = ("config", "generation_config")


def source_directory(ckpt: Checkpoint) -> Path | str | None:
    """The Hugging Face directory ``ckpt`` was read from (a URL as a str), or None for any
    other source."""
    if ckpt.format != "directory" or ckpt.details.get("layout") not in SOURCE_LAYOUTS:
        return None
    directory = str(ckpt.details["directory"])
    return directory if is_url(directory) else Path(directory)


def wants_model_dir(ckpt: Checkpoint, dst: str | os.PathLike[str] | None) -> bool:
    """DST names a directory for a Hugging Face source: existing, ending in ``/``, no suffix."""
    if dst is None or source_directory(ckpt) is None:
        return False
    path = Path(dst)
    if path.name.endswith(INDEX_SUFFIX):
        return False
    return path.is_dir() or str(dst).endswith(("/", os.sep)) or not path.suffix


def for_transformers(plan: Plan) -> Plan:
    """The plan with tied output embeddings as aliases of the input embedding, and without
    the metadata fields a model directory keeps elsewhere (``config.json``) or not at all."""
    aliases = dict(plan.aliases)
    by_name = {p.name: p for p in plan.stored}
    for output_name in TIED_OUTPUT_NAMES:
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
    entries = sorted({_entry(key) for key in plan.fields} - set(CONFIG_ENTRIES))
    if entries:
        notes.append(f"a model directory holds the model only; not written: {', '.join(entries)}")
    return replace(plan, stored=stored, aliases=aliases, fields={}, notes=notes)


def _entry(field_key: str) -> str:
    return field_key.removeprefix(FIELD_PREFIX).split(".")[0]


def check_target(src_dir: Path | str, target: Path, force: bool) -> None:
    """Refuse the source itself, a file, and an existing directory without ``force`` or with
    files a model directory does not hold (``force`` must never remove a user's other files)."""
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
    others = sorted(p.name for p in target.iterdir() if not _model_dir_file(p))
    if others:
        raise InputError(
            f"{target}: holds files a model directory does not ({', '.join(others[:3])}); "
            "--force replaces only a model directory; name another DST"
        )


def _model_dir_file(path: Path) -> bool:
    return path.is_file() and (
        path.name in MODEL_DIR_FILES
        or bool(SAFE_SHARD.match(path.name) or BIN_SHARD.match(path.name))
    )


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A temp directory next to ``target`` that becomes ``target`` on a clean exit.

    The caller writes (and fsyncs) its files; here the directory itself is fsynced, renamed
    over ``target`` (an existing one moved aside, then removed) and the parent fsynced. Any
    exception removes the temp directory and leaves ``target`` as it was.
    """
    parent = target.parent if str(target.parent) else Path(".")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=parent))
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
        fsync_dir(staging)
        if not target.exists():
            os.replace(staging, target)
        else:
            _replace_directory(staging, target, parent)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_directory(staging: Path, target: Path, parent: Path) -> None:
    """Move ``target`` aside, ``staging`` in its place, then remove the old one (a rename
    cannot replace a non-empty directory). A failed second rename puts the old one back."""
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", suffix=TMP_SUFFIX, dir=parent))
    os.replace(target, aside / target.name)
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(aside / target.name, target)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def copy_files(src_dir: Path | str, staging: Path) -> list[str]:
    """Copy ``config.json`` and ``generation_config.json`` byte for byte, fsynced; return the
    names copied (from a URL's directory: those its listing holds)."""
    copied = []
    listed = list_files(src_dir) if isinstance(src_dir, str) else None
    for name in COPIED_FILES:
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


def moved(files: list[OutFile], target: Path) -> list[OutFile]:
    """``files`` as they are named once the staging directory became ``target``."""
    return [replace(f, target=target / f.target.name) for f in files]
