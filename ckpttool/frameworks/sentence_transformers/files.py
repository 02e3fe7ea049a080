"""sentence-transformers model folders: what ``SentenceTransformer.save(dir)`` writes.

``modules.json`` lists the modules in order (``idx``, ``name``, ``path``, ``type``); each module
saves into its folder (``path``; "" for the first module, the Transformer, at the root):
the Transformer's Hugging Face model (``model.safetensors``, or ``pytorch_model.bin``, or
shards with an index) with its tokenizer, ``1_Pooling/config.json`` (no weights),
``2_Dense/model.safetensors``... ``SentenceTransformer(dir).state_dict()`` (sentence-transformers
6.2) names each module's weights after its ``name`` (``2.linear.weight``), the Transformer's
under its ``model`` attribute (``0.model.embeddings.word_embeddings.weight``): the keys here are
those names.
"""

from __future__ import annotations

import re

from ckpttool.errors import CorruptCheckpointError
from ckpttool.frameworks.base import CONFIG, OTHER, FrameworkDirectory, Member, inside, list_files
from ckpttool.frameworks.parts import PARTS, WeightNames, folder_weights, unlisted_folders
from ckpttool.io.source import is_dir, join

MODULES_NAME = "modules.json"
CONFIG_NAME = "config_sentence_transformers.json"
#: Each module's weights, as ``save_pretrained``/``save_torch_weights`` name them.
WEIGHT_NAMES = WeightNames(
    singles=("model.safetensors", "pytorch_model.bin"),
    indexes=("model.safetensors.index.json", "pytorch_model.bin.index.json"),
    shards=(
        re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$"),
        re.compile(r"^pytorch_model-\d{5}-of-\d{5}\.bin$"),
    ),
)
#: Module classes that hold no weights: a folder of theirs without any is complete.
WEIGHTLESS = frozenset({"Pooling", "Normalize", "Dropout"})
#: Module classes that save other modules in folders of their own, below theirs (a ``Router``'s
#: routes): not read, and said so.
NESTING = frozenset({"Router"})
#: Module classes that keep their Hugging Face model under ``model`` (``Transformer.model``).
HF_WRAPPERS = frozenset({"Transformer", "MLMTransformer"})

SENTENCE_TRANSFORMERS = "sentence_transformers"


def detect(path: str) -> FrameworkDirectory | None:
    """A folder holding ``modules.json``: each module a named part."""
    if not is_dir(path):
        return None
    files = list_files(path)
    if MODULES_NAME not in files:
        return None
    layout = FrameworkDirectory(
        kind=SENTENCE_TRANSFORMERS,
        title="sentence-transformers model folder",
        directory=path,
        members=[Member(MODULES_NAME, CONFIG, None, files[MODULES_NAME], json=True)],
    )
    modules = layout.read_json(MODULES_NAME)
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(m.get("path"), str)
        for m in modules
    ):
        raise CorruptCheckpointError(
            f"{join(path, MODULES_NAME)}: not a list of modules with a name and a path"
        )
    parts = []
    nested: list[str] = []
    known = {MODULES_NAME}
    for module in modules:
        name, folder = module["name"], module["path"].strip("/")
        kind = str(module.get("type") or "").rsplit(".", 1)[-1]
        if folder:
            inside(path, folder)
            folder_files = list_files(join(path, folder)) if is_dir(join(path, folder)) else None
        else:
            folder_files = files
        prefix = f"{name}.model." if kind in HF_WRAPPERS else f"{name}."
        section = f"model.{name}.model" if kind in HF_WRAPPERS else f"model.{name}"
        parts.append({"name": name, "folder": folder, "type": kind, "prefix": prefix,
                      "section": section, "tensors": 0})  # fmt: skip
        if folder_files is None:
            layout.missing.append(f"{folder}/ (module {name}, {kind})")
            continue
        if kind in NESTING:
            nested.append(f"{folder or '.'}/ (module {name}, a {kind}: its modules are not read)")
            continue
        members, problems, _ = folder_weights(path, folder, folder_files, section, WEIGHT_NAMES)
        layout.members += members
        layout.problems += problems
        if not members and kind not in WEIGHTLESS:
            layout.missing.append(
                f"{folder or '.'}/{WEIGHT_NAMES.singles[0]} (the weights of module {name}, {kind})"
            )
        known |= {m.name for m in members}
        if folder:  # the module's other files: its config, tokenizer files...
            for file, size in folder_files.items():
                member = f"{folder}/{file}"
                if member not in known:
                    known.add(member)
                    role = CONFIG if file.endswith(".json") else OTHER
                    layout.members.append(Member(member, role, None, size))
    for file, size in files.items():
        if file not in known:
            layout.members.append(
                Member(file, CONFIG if file.endswith(".json") else OTHER, None, size)
            )
    layout.details[PARTS] = parts
    not_read = nested + unlisted_folders(path, {p["folder"] for p in parts})
    if not_read:
        layout.details["not_read"] = not_read
    layout.complete = not layout.missing and not layout.problems
    return layout
