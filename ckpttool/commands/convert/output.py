"""Where ``convert``'s output goes: its format, file names, shards, metadata, and refusals.

Decided before any byte is written: DST (or its default) gives the format by suffix; with
``--max-shard-size`` the tensors are split the way Hugging Face does and an index is added;
existing outputs are refused without ``force``, and an output that is the source always. The
default name is never the source: SRC's name with the output's suffix, or with ``.converted``
before it when that is SRC's own name (``c_ddp.pth --to pth`` writes ``c_ddp.converted.pth``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.commands.convert.plan import Plan, Planned
from ckpttool.commands.selection import ALIASES_KEY, SOURCE_KEY, VERSION_KEY
from ckpttool.errors import InputError, OutputExistsError
from ckpttool.io.units import launched_ranks
from ckpttool.model.records import ITEMSIZE
from ckpttool.version import __version__

FORMATS = ("safetensors", "pth")
PTH_SUFFIXES = (".pth", ".pt", ".bin")
INDEX_SUFFIX = ".safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """``2GB`` -> 2*10**9, ``500MiB`` -> 500*2**20, ``1048576`` -> bytes (as Hugging Face)."""
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if not match:
            raise InputError(f"cannot read {text!r} as a size (examples: 2GB, 500MB, 1048576)")
        unit = (match.group(2) or "").lower().removesuffix("b")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InputError(f"a shard size must be positive, got {text!r}")
    return size


@dataclass
class OutFile:
    """One file to write: a safetensors file or shard, a .pth, or a shard index."""

    target: Path
    kind: str  # "safetensors", "pth" or "index"
    tensors: list[Planned] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    content: bytes = b""  # the index's JSON
    expected_size: int = 0


# --- where the output goes ------------------------------------------------------------------


def default_output(src: Path, directory: Path, to: str | None) -> Path:
    """``directory/NAME.safetensors`` (``.pth`` for ``to="pth"``) for SRC ``NAME.*``, or
    ``NAME.converted.SUFFIX`` when that is the source itself (a .pth to .pth, a safetensors
    file cast to another dtype)."""
    suffix = ".pth" if to == "pth" else ".safetensors"
    target = directory / (src.stem + suffix)
    if _is_source(target, src):
        target = directory / f"{src.stem}.converted{suffix}"
    return target


def _is_source(target: Path, src: Path) -> bool:
    if target.exists() and src.exists() and os.path.samefile(target, src):
        return True
    return target.resolve() == src.resolve()


def _output_format(path: Path, to: str | None) -> str:
    suffix = path.suffix.lower()
    guessed = (
        "safetensors" if suffix == ".safetensors" else "pth" if suffix in PTH_SUFFIXES else None
    )
    if to is not None:
        if guessed is not None and guessed != to and not path.name.endswith(INDEX_SUFFIX):
            raise InputError(f"{path}: a {suffix} name for --to {to} output; rename DST")
        return to
    if guessed is None:
        raise InputError(
            f"{path}: cannot tell the output format from its suffix; name it .safetensors or "
            ".pth (.pt, .bin), or pass --to"
        )
    return guessed


def writes_pth(dst: str | os.PathLike[str] | None, to: str | None) -> bool:
    """Whether the output is a .pth (known before planning: it decides what can be kept)."""
    if to is not None:
        return to == "pth"
    return dst is not None and Path(dst).suffix.lower() in PTH_SUFFIXES


def plan_outputs(
    src: Path,
    dst: str | os.PathLike[str] | None,
    to: str | None,
    shard_size: int | None,
    plan: Plan,
) -> list[OutFile]:
    """The files to write, in write order (index last), with their tensors and metadata."""
    if dst is None:
        path = default_output(src, src.parent, to)
    else:
        path = Path(dst)
        if (path.is_dir() or names_directory(dst)) and shard_size is None:
            path = default_output(src, path, to)  # a missing DIR/ is made by check_targets
    if shard_size is None:
        kind = _output_format(path, to)
        out = OutFile(path, kind, list(plan.stored), dict(plan.aliases))
        if kind == "safetensors":
            out.tensors = _aligned_order(out.tensors)
            out.metadata = _metadata(src, plan, plan.aliases)
        return [out]
    if to == "pth":
        raise InputError(
            "--max-shard-size writes safetensors shards; it cannot be used with --to pth"
        )
    if path.name.endswith(INDEX_SUFFIX):
        directory, stem = path.parent, path.name[: -len(INDEX_SUFFIX)]
    elif path.is_dir() or not path.suffix or names_directory(dst):
        directory, stem = path, "model"  # created by check_targets if missing
    elif path.suffix.lower() == ".safetensors":
        directory, stem = path.parent, path.stem
    else:
        raise InputError(
            f"{path}: with --max-shard-size, DST is a directory, a NAME.safetensors or a "
            "NAME.safetensors.index.json"
        )
    groups: list[list[Planned]] = [[]]
    size = 0
    for planned in plan.stored:  # Hugging Face's rule: a tensor larger than SIZE gets its own
        if groups[-1] and size + planned.nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(planned)
        size += planned.nbytes
    files = []
    for number, group in enumerate(groups, start=1):
        name = f"{stem}-{number:05d}-of-{len(groups):05d}.safetensors"
        names = {p.name for p in group}
        aliases = {a: s for a, s in plan.aliases.items() if s in names}
        out = OutFile(directory / name, "safetensors", _aligned_order(group), aliases)
        out.metadata = _metadata(src, plan, aliases)
        files.append(out)
    index = {
        # as transformers' save_pretrained writes it (num_parameters() counts tied ones once)
        "metadata": {
            "total_parameters": sum(p.record.numel for p in plan.stored),
            "total_size": plan.tensor_bytes,
        },
        "weight_map": {p.name: f.target.name for f in files for p in f.tensors},
    }
    content = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
    files.append(OutFile(directory / (stem + INDEX_SUFFIX), "index", content=content))
    return files


def _aligned_order(tensors: list[Planned]) -> list[Planned]:
    """Widest elements first (stable): after the 8-aligned header every tensor is aligned."""
    return sorted(tensors, key=lambda p: -ITEMSIZE[p.dtype])


def _metadata(src: Path, plan: Plan, aliases: dict[str, str]) -> dict[str, str]:
    metadata = {**plan.carried, **plan.fields}
    metadata.update({"format": "pt", SOURCE_KEY: src.name, VERSION_KEY: __version__})
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(dict(sorted(aliases.items())))
    return metadata


def names_directory(dst: str | os.PathLike[str] | None) -> bool:
    """Whether DST ends in ``/``: a directory, never a file of that name."""
    return dst is not None and os.fspath(dst).endswith(("/", os.sep))


def check_targets(
    src: Path, files: list[OutFile], force: bool, *, make_directory: bool = False
) -> Path | None:
    """Refuse to overwrite the source, or an existing output without ``force``.

    A shard directory that does not exist yet (or, with ``make_directory``, the directory of
    one output file: DST ``DIR/``) is created once everything else is checked; the first
    directory created is returned, for :func:`remove_created` should the write fail.
    """
    for target in (f.target for f in files):
        if _is_source(target, src):
            raise InputError(f"{target}: the output would overwrite the source; name another DST")
        if target.is_dir():
            raise InputError(f"{target}: is a directory")
        if (target.exists() or target.is_symlink()) and not force:
            raise OutputExistsError(f"{target} exists; pass --force to overwrite it")
    directory = files[0].target.parent
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{directory}: not a directory")
    if not directory.exists():
        if len(files) == 1 and not make_directory:
            raise InputError(f"{directory}: no such directory for the output")
        created = directory
        while not created.parent.exists():
            created = created.parent
        directory.mkdir(parents=True, exist_ok=True)  # torchrun's ranks check it at once
        return created
    if launched_ranks() is not None and not any(directory.iterdir()):
        # another rank of this run made it a moment ago: whichever rank stops last removes it
        # (an empty directory a user made for the output goes too, on a failed write)
        return directory
    return None


def remove_created(created: Path | None, directory: Path) -> None:
    """After a failed or interrupted write: the directories :func:`check_targets` made, from
    ``directory`` up to ``created``, removed where empty (another rank's files stay)."""
    if created is None:
        return
    for path in (directory, *directory.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == created:
            return
