"""diffusers: model folders (``ModelMixin.save_pretrained``), ``EMAModel.save_pretrained``, and
pipeline folders (``DiffusionPipeline.save_pretrained``).

A model folder holds ``config.json`` (``_class_name``, ``_diffusers_version``) beside
``diffusion_pytorch_model.safetensors``, or ``diffusion_pytorch_model.bin``
(``safe_serialization=False``), or ``diffusion_pytorch_model-0000k-of-0000n.safetensors``
shards listed by ``diffusion_pytorch_model.safetensors.index.json`` (diffusers'
``utils/constants.py``: ``WEIGHTS_NAME``, ``SAFETENSORS_WEIGHTS_NAME``, the index names);
``from_pretrained`` prefers safetensors. ``EMAModel.save_pretrained`` writes a model folder of
the averaged weights whose config also holds the EMA's ``decay``, ``optimization_step``,
``min_decay``, ``update_after_step``, ``use_ema_warmup``, ``inv_gamma``, ``power``.

A pipeline folder holds ``model_index.json`` (``_class_name``; each component's name ->
``[library, class]``) and one folder per component: models (diffusers' names, or transformers'
``model.safetensors`` for a text encoder), schedulers and tokenizers (no weights). Each model
component is a named part, its weights keyed ``<component>.<name>`` as
``pipeline.components[component].state_dict()`` names them.
"""

from __future__ import annotations

import os
import re

from ckpttool.frameworks.base import CONFIG, OTHER, FrameworkDirectory, Member, list_files
from ckpttool.frameworks.parts import PARTS, WeightNames, folder_weights, unlisted_folders
from ckpttool.io.source import is_dir, is_file, join

CONFIG_NAME = "config.json"
MODEL_INDEX_NAME = "model_index.json"
DIFFUSERS_WEIGHTS = WeightNames(
    singles=("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
    indexes=(
        "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model.bin.index.json",
    ),
    shards=(
        re.compile(r"^diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors$"),
        re.compile(r"^diffusion_pytorch_model-\d{5}-of-\d{5}\.bin$"),
    ),
)
#: A pipeline component saved by transformers (a text encoder).
TRANSFORMERS_WEIGHTS = WeightNames(
    singles=("model.safetensors", "pytorch_model.bin"),
    indexes=("model.safetensors.index.json", "pytorch_model.bin.index.json"),
    shards=(
        re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$"),
        re.compile(r"^pytorch_model-\d{5}-of-\d{5}\.bin$"),
    ),
)
#: What ``EMAModel.save_pretrained`` adds to the model's config.
EMA_FIELDS = ("decay", "min_decay", "optimization_step", "update_after_step", "use_ema_warmup",
              "inv_gamma", "power")  # fmt: skip
#: A weights file of a variant (``diffusion_pytorch_model.fp16.safetensors``): loaded only when
#: ``from_pretrained(variant=...)`` asks for it.
VARIANT = re.compile(r"^(diffusion_pytorch_model|model)\.[^.]+\.(safetensors|bin)$")

DIFFUSERS_MODEL = "diffusers_model"
DIFFUSERS_EMA = "diffusers_ema"
DIFFUSERS_PIPELINE = "diffusers_pipeline"


def detect(path: str) -> FrameworkDirectory | None:
    """A pipeline folder (``model_index.json``) or a model folder (``config.json`` beside
    diffusers' weights), or an index file inside one."""
    directory = path
    if path.endswith(".index.json") and is_file(path):
        if os.path.basename(path) not in DIFFUSERS_WEIGHTS.indexes:
            return None
        directory = os.path.dirname(path) or "."
    if not is_dir(directory):
        return None
    files = list_files(directory)
    if MODEL_INDEX_NAME in files and directory == path:
        return _pipeline(directory, files)
    if CONFIG_NAME in files:
        return _model(directory, files)
    return None


def _model(directory: str, files: dict[str, int]) -> FrameworkDirectory | None:
    members, problems, index = folder_weights(directory, "", files, "model", DIFFUSERS_WEIGHTS)
    if not members:
        return None
    layout = FrameworkDirectory(
        kind=DIFFUSERS_MODEL,
        title="diffusers model folder",
        directory=directory,
        members=[*members, Member(CONFIG_NAME, CONFIG, "config", files[CONFIG_NAME], json=True)],
        problems=problems,
        index=index,
    )
    config = layout.read_json(CONFIG_NAME)
    if isinstance(config, dict):
        for key in ("_class_name", "_diffusers_version"):
            if isinstance(config.get(key), str):
                layout.details[key.lstrip("_")] = config[key]
        if "decay" in config and "optimization_step" in config:
            layout.kind, layout.title = DIFFUSERS_EMA, "diffusers EMAModel save"
            layout.details["ema"] = {k: config[k] for k in EMA_FIELDS if k in config}
    known = {member.name for member in layout.members}
    variants = [name for name in files if VARIANT.match(name)]
    if variants:
        layout.details["not_read"] = [
            f"{n} (a variant: from_pretrained(variant=...))" for n in variants
        ]
    layout.members += [Member(n, OTHER, None, size) for n, size in files.items() if n not in known]
    layout.complete = not problems
    return layout


def _pipeline(directory: str, files: dict[str, int]) -> FrameworkDirectory:
    layout = FrameworkDirectory(
        kind=DIFFUSERS_PIPELINE,
        title="diffusers pipeline folder",
        directory=directory,
        members=[Member(MODEL_INDEX_NAME, CONFIG, None, files[MODEL_INDEX_NAME], json=True)],
    )
    index = layout.read_json(MODEL_INDEX_NAME)
    index = index if isinstance(index, dict) else {}
    if isinstance(index.get("_class_name"), str):
        layout.details["class_name"] = index["_class_name"]
    if isinstance(index.get("_diffusers_version"), str):
        layout.details["diffusers_version"] = index["_diffusers_version"]
    parts = []
    not_read: list[str] = []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        library, cls = entry
        if library is None or cls is None:  # a component saved as absent (safety_checker)
            continue
        folder = join(directory, name)
        if "/" in name or name in (".", "..") or not is_dir(folder):
            layout.missing.append(f"{name}/ (component {library}.{cls})")
            continue
        folder_files = list_files(folder)
        section = f"model.{name}"
        members: list[Member] = []
        for names in (DIFFUSERS_WEIGHTS, TRANSFORMERS_WEIGHTS):
            members, problems, _ = folder_weights(directory, name, folder_files, section, names)
            if members:
                layout.problems += problems
                break
        if members:
            parts.append({"name": name, "folder": name, "type": cls, "prefix": f"{name}.",
                          "section": section, "tensors": 0})  # fmt: skip
        elif CONFIG_NAME in folder_files:  # a model without weights: from_pretrained fails
            layout.missing.append(
                f"{name}/{DIFFUSERS_WEIGHTS.singles[0]} (the weights of component {name}, {cls})"
            )
        known = {m.name for m in members}
        layout.members += members
        for file, size in folder_files.items():
            if f"{name}/{file}" not in known:
                role = CONFIG if file.endswith(".json") else OTHER
                layout.members.append(Member(f"{name}/{file}", role, None, size))
                if VARIANT.match(file):
                    not_read.append(f"{name}/{file} (a variant: from_pretrained(variant=...))")
    layout.members += [
        Member(n, OTHER, None, size) for n, size in files.items() if n != MODEL_INDEX_NAME
    ]
    layout.details[PARTS] = parts
    listed = {p["name"] for p in parts} | {k for k in index if not k.startswith("_")}
    not_read += unlisted_folders(directory, listed)
    if not_read:
        layout.details["not_read"] = not_read
    layout.complete = not layout.missing and not layout.problems
    return layout
