"""Checkpoints that frameworks write as several files: what each file is, and which are missing.

One module per framework keeps that framework's file names, keys and completeness rules
(``huggingface``: ``save_pretrained`` model directories and ``Trainer`` ``checkpoint-N/``
folders; ``accelerate``: ``save_state`` folders; ``deepspeed``: ZeRO save and tag directories). :func:`detect_directory` lists a directory,
asks each framework whether it knows the layout, and returns a :class:`DirectoryLayout`:
the member files with their roles and where their content goes in the merged tree, the files
the framework would have written that are not there, and what the directory is called.

Nothing here reads a checkpoint's bytes: only names, sizes and the small JSON index files.
:mod:`ckpttool.frameworks.tree` reads the members through the one safe reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckpttool.errors import InputError
from ckpttool.io.source import is_url, join

# Roles a member file can have.
WEIGHTS = "weights"  # a whole weights file, or one shard of them
INDEX = "index"  # a *.index.json naming each tensor's shard
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
RNG = "rng"
SAMPLER = "sampler"
TRAINER_STATE = "trainer_state"
TRAINING_ARGS = "training_args"
CONFIG = "config"
CUSTOM = "custom"
OTHER = "other"  # tokenizer files, READMEs...: listed, not read

#: The layout of a directory that holds several checkpoints (a Trainer ``output_dir``).
COLLECTION = "hf_trainer_output"

#: How large a JSON member may be (an index of a million tensors is ~60 MB).
MAX_JSON_BYTES = 256 << 20


@dataclass(frozen=True)
class Member:
    """One file of a directory checkpoint."""

    name: str  # path relative to the checkpoint directory ("model-00001-of-00002.safetensors")
    role: str  # one of the role constants above
    section: str | None  # dotted key of its content in the merged tree; None: listed only
    size: int = 0  # bytes on disk
    rank: int | None = None  # the process that wrote it (per-rank RNG files)
    shard: bool = False  # one of several weights files merged into one dict at ``section``
    json: bool = False  # parsed as JSON rather than through the checkpoint reader


@dataclass
class DirectoryLayout:
    """What a framework says a directory holds."""

    layout: str  # "hf_model", "hf_trainer", "hf_trainer_output", "accelerate"
    title: str  # "Hugging Face Trainer checkpoint"
    directory: str
    members: list[Member]
    missing: list[str] = field(default_factory=list)  # expected files that are not there
    problems: list[str] = field(default_factory=list)  # inconsistencies between members
    details: dict[str, object] = field(default_factory=dict)  # shown by `show` (step, ranks...)
    index: str | None = None  # the index file, when the weights are sharded
    complete: bool = True  # everything the framework writes for a resumable checkpoint is there
    # JSON members already parsed (by name): detection reads an index or trainer_state.json,
    # and reading the directory uses what it found rather than reading the file again
    parsed_json: dict[str, object] = field(default_factory=dict, repr=False)

    def read_json(self, name: str) -> object:
        """The JSON member ``name``, parsed once."""
        if name not in self.parsed_json:
            from ckpttool.frameworks.huggingface.files import read_json

            self.parsed_json[name] = read_json(inside(self.directory, name))
        return self.parsed_json[name]


def list_files(directory: str) -> dict[str, int]:
    """Regular files directly in ``directory`` (no symlink that leaves it), by name, with sizes.
    A URL's are what its store lists (none over HTTP, which cannot list)."""
    if is_url(directory):
        from ckpttool.io.remote import member_listing

        return member_listing(directory)
    try:
        entries = list(os.scandir(directory))
    except OSError as error:
        raise InputError(f"{directory}: cannot list ({error.strerror})") from None
    files: dict[str, int] = {}
    real = os.path.realpath(directory)
    for entry in entries:
        if not entry.is_file():
            continue
        if entry.is_symlink() and os.path.dirname(os.path.realpath(entry.path)) != real:
            continue  # a reader opens only files inside the checkpoint's own directory
        files[entry.name] = entry.stat().st_size
    return dict(sorted(files.items()))


def detect_directory(path: str) -> DirectoryLayout | None:
    """The framework layout of ``path`` (a directory, or an ``*.index.json`` file), or None."""
    from ckpttool.frameworks.accelerate import files as accelerate
    from ckpttool.frameworks.deepspeed import files as deepspeed
    from ckpttool.frameworks.huggingface import files as huggingface

    # accelerate first: its folders hold a model.safetensors like a model directory does;
    # DeepSpeed last: a Trainer checkpoint-N/ of a DeepSpeed run holds a global_stepN/ too
    detectors = (accelerate.detect, huggingface.detect, huggingface.detect_output_dir,
                 deepspeed.detect)  # fmt: skip
    for detect in detectors:
        layout = detect(path)
        if layout is not None:
            return layout
    return None


def inside(directory: str, name: str) -> str:
    """``directory/name``, refusing a name that would leave the directory."""
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise InputError(f"{directory}: the index names a file outside the checkpoint: {name!r}")
    return join(directory, name)


def describe_collection(layout: object) -> str:
    """One line for a directory of several checkpoints: each with its step and completeness."""
    assert isinstance(layout, DirectoryLayout)
    listed = layout.details.get("checkpoints", [])
    assert isinstance(listed, list)
    parts = [
        f"{c['name']} {'complete' if c['complete'] else 'incomplete: no ' + ', '.join(c['missing'])}"
        for c in listed
    ]
    complete = [c["name"] for c in listed if c["complete"]]
    hint = (
        f"name one of them, e.g. {os.path.join(layout.directory, complete[-1])} (the latest complete)"
        if complete
        else "none is complete"
    )
    return (
        f"{layout.directory}: a {layout.title} with {len(listed)} checkpoints "
        f"({'; '.join(parts)}): {hint}"
    )
