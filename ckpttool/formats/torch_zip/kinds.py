"""Which torch loader a zip archive is for, by the archive's own markers, and what that loader
unpickles, imports or runs: the one place ``scan`` and the reader's refusals ask.

torch writes four kinds of zip, each under a root folder of the writer's choosing:

- ``torch.save`` (``torch-zip``): ``data.pkl``, one record per storage; ``torch.load``.
- TorchScript (``torch.jit.save``): ``code/`` (Python-like source ``torch.jit.load`` compiles
  and runs), ``constants.pkl``, ``data.pkl``.
- torch.export (``torch.export.save``, ``.pt2``): ``archive_format`` holding ``pt2`` (the
  loader refuses an archive without it), ``models/<name>.json``, ``data/weights/``,
  ``data/constants/``, ``data/sample_inputs/<name>.pt``. ``torch.export.load`` unpickles the
  sample inputs with ``torch.load`` (``weights_only=True``, then, when that fails,
  ``weights_only=False``: a payload runs either way), every weight or constant its config marks
  ``use_pickle`` with ``torch.load(weights_only=False)``, ``custom_obj_*`` constants with
  TorchScript's unpickler and ``opaque_obj_*`` ones with ``pickle.loads``; the legacy
  ``data/weights/<name>.pt`` and ``data/constants/<name>.pt`` files are ``torch.load``-ed too.
  ``data/aotinductor/`` holds compiled shared libraries that AOTInductor's loader runs.
- torch.package (``PackageExporter``): ``.data/extern_modules``, ``.data/version``, the
  pickles ``save_pickle`` wrote (any name; protocol 3), and the ``*.py`` source of every
  interned module, which ``PackageImporter`` imports (runs) when a pickle names it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ckpttool.formats.torch_zip.zip_index import fold

TORCH_ZIP = "torch-zip"
TORCHSCRIPT = "torchscript"
TORCH_EXPORT = "torch-export"
TORCH_PACKAGE = "torch-package"

#: How each kind is named in messages.
KIND_NAMES = {
    TORCH_ZIP: "a torch.save zip archive",
    TORCHSCRIPT: "a TorchScript archive (torch.jit.save)",
    TORCH_EXPORT: "a torch.export archive (.pt2, torch.export.save)",
    TORCH_PACKAGE: "a torch.package archive (torch.package.PackageExporter)",
}

PT2_SAMPLE_INPUTS = "data/sample_inputs/"
PT2_WEIGHTS = "data/weights/"
PT2_CONSTANTS = "data/constants/"
PT2_AOTINDUCTOR = "data/aotinductor/"
#: Constants torch.export.load unpickles whatever their config says (custom and opaque objects).
PT2_PICKLED_PREFIXES = ("custom_obj_", "opaque_obj_")


def inner_name(name: str) -> str:
    """A member's name below the archive's root folder (``m/data/weights/weight_0`` gives
    ``data/weights/weight_0``); a name without a folder is its own."""
    return name.split("/", 1)[1] if "/" in name else name


def is_torchscript(names: Iterable[str]) -> bool:
    return any(n.endswith("constants.pkl") or "/code/" in n or n.startswith("code/") for n in names)


def is_torch_export(names: Iterable[str]) -> bool:
    return any(
        inner_name(n) == "archive_format"
        or (inner_name(n).startswith("models/") and inner_name(n).endswith(".json"))
        for n in names
    )


def has_pt2_folders(names: Iterable[str]) -> bool:
    """Whether names lie in a torch.export archive's own folders: what a ``.pt2`` cut before
    its ``archive_format`` record still shows (a torch.save zip's records are ``data/<key>``,
    so only a zip with no ``data.pkl`` is judged by this)."""
    folders = (PT2_WEIGHTS, PT2_CONSTANTS, PT2_SAMPLE_INPUTS, "models/")
    return any(inner_name(n).startswith(folders) for n in names)


def is_torch_package(names: Iterable[str]) -> bool:
    return any(inner_name(n) in (".data/extern_modules", ".data/python_version") for n in names)


def archive_kind(names: Iterable[str]) -> str:
    """The loader a zip's member names say it is for (one of the kinds above)."""
    names = list(names)
    if is_torch_export(names):
        return TORCH_EXPORT
    if is_torch_package(names):
        return TORCH_PACKAGE
    if is_torchscript(names):
        return TORCHSCRIPT
    return TORCH_ZIP


def package_modules(names: Iterable[str]) -> list[str]:
    """The modules whose Python source a torch.package archive ships (``pkg/__init__.py`` is
    ``pkg``, ``pkg/mod.py`` is ``pkg.mod``), sorted."""
    modules = set()
    for name in names:
        inner = inner_name(name)
        if not inner.endswith(".py") or inner.startswith(".data/"):
            continue
        module = inner[: -len(".py")].replace("/", ".")
        modules.add(module.removesuffix(".__init__"))
    return sorted(modules)


def pt2_pickled_payloads(configs: Iterable[tuple[str, bytes]]) -> tuple[set[str], list[str]]:
    """The ``path_name`` of each weight or constant that a torch.export archive's payload
    configs (``(config member name, its bytes)``) mark ``use_pickle``, and why a config could
    not be read (each such config leaves every payload of its folder to be walked)."""
    pickled: set[str] = set()
    unreadable = []
    for name, data in configs:
        try:
            entries = json.loads(data)["config"].values()
            pickled.update(str(entry["path_name"]) for entry in entries if entry.get("use_pickle"))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            unreadable.append(f"{name}: unreadable payload config ({error!r})")
    return pickled, unreadable


def pt2_member_role(inner: str, pickled: set[str], configs_readable: bool) -> str | None:
    """What torch.export.load does with a member (its name below the root): ``"load"`` when it
    hands the bytes to ``torch.load``/an unpickler, None when it never unpickles them."""
    if inner.startswith(PT2_SAMPLE_INPUTS):
        return "load"
    for folder in (PT2_WEIGHTS, PT2_CONSTANTS):
        if inner.startswith(folder) and not inner.endswith(".json"):
            base = inner[len(folder) :]
            if (
                base in pickled
                or base.startswith(PT2_PICKLED_PREFIXES)
                or fold(base).endswith(".pt")
                or not configs_readable
            ):
                return "load"
    return None


__all__ = [
    "KIND_NAMES",
    "TORCHSCRIPT",
    "TORCH_EXPORT",
    "TORCH_PACKAGE",
    "TORCH_ZIP",
    "archive_kind",
    "has_pt2_folders",
    "inner_name",
    "is_torch_export",
    "is_torch_package",
    "is_torchscript",
    "package_modules",
    "pt2_member_role",
    "pt2_pickled_payloads",
]
