"""Archives of torch's other loaders (torch.export, torch.package, TorchScript), written by torch
itself, benign and with a payload in each place the loader unpickles or imports.

Every hostile archive starts from one torch wrote (``torch.export.save``, ``PackageExporter``,
``torch.jit.save``) and has one member replaced or added, so that its loader reads it as usual up
to the payload. Each payload's harmless effect is creating the file ``marker`` (for TorchScript,
whose code cannot write files, printing ``MARKER_TEXT`` plus the marker's name). Which loader
reads each archive: :data:`LOADERS`; :mod:`tests.workers.loader_worker` proves them live.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from tests.support import adversarial

#: What TorchScript code prints to show it ran (followed by the marker's name).
MARKER_TEXT = "ckpttool-test-marker:"


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 2)
        self.register_buffer("offset", torch.ones(2))
        self.scale = torch.tensor([2.0, 3.0])  # a plain tensor attribute: a constant in a .pt2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale + self.offset


def exported(path: Path) -> Path:
    """A tiny model exported with its sample inputs (``torch.export.save``)."""
    program = torch.export.export(_Tiny(), (torch.randn(1, 3),))
    torch.export.save(program, path)
    return path


def scripted(path: Path) -> Path:
    torch.jit.save(torch.jit.script(_Tiny()), path)
    return path


def tensor_package(path: Path) -> Path:
    """A torch.package archive of only tensors (no Python source)."""
    with torch.package.PackageExporter(path) as exporter:
        exporter.save_pickle("weights", "state.pkl", {"w": torch.ones(2, 3), "b": torch.zeros(2)})
    return path


def _rewrite(
    path: Path, change: Callable[[str, bytes], bytes | None], add: dict[str, bytes]
) -> None:
    """Rewrite a zip: each member through ``change`` (None drops it), then ``add``'s members
    (names below the archive's root folder)."""
    with zipfile.ZipFile(path) as source:
        members = [(info.filename, source.read(info)) for info in source.infolist()]
    root = members[0][0].split("/", 1)[0]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as target:
        for name, data in members:
            changed = change(name.split("/", 1)[1], data)
            if changed is not None:
                target.writestr(name, changed)
        for inner, data in add.items():
            target.writestr(f"{root}/{inner}", data)
    path.write_bytes(buffer.getvalue())


def _payload(marker: Path) -> bytes:
    return adversarial.global_reduce_p2(marker)


def _pickled_payload_config(config: bytes, path_name: str) -> bytes:
    """A payload config with ``path_name``'s entry marked ``use_pickle``."""
    parsed = json.loads(config)
    for entry in parsed["config"].values():
        if entry["path_name"] == path_name:
            entry["use_pickle"] = True
    return json.dumps(parsed).encode()


def pt2_sample_inputs(path: Path, marker: Path) -> Path:
    """torch.export.load's sample inputs: a torch.save zip whose pickle runs the payload."""
    exported(path)
    nested = adversarial.torch_zip(_payload(marker), prefix="model")
    _rewrite(
        path, lambda inner, data: nested if inner.startswith("data/sample_inputs/") else data, {}
    )
    return path


def pt2_sample_inputs_legacy(path: Path, marker: Path) -> Path:
    """The sample inputs as a legacy torch.save stream (not a zip), payload in its object."""
    exported(path)
    nested = adversarial.legacy_stream(_payload(marker))
    _rewrite(
        path, lambda inner, data: nested if inner.startswith("data/sample_inputs/") else data, {}
    )
    return path


def _pt2_pickled(path: Path, marker: Path, folder: str, config_name: str, member: str) -> Path:
    exported(path)
    nested = adversarial.torch_zip(_payload(marker))

    def change(inner: str, data: bytes) -> bytes:
        if inner == f"data/{folder}/{config_name}":
            return _pickled_payload_config(data, member)
        return nested if inner == f"data/{folder}/{member}" else data

    _rewrite(path, change, {})
    return path


def pt2_pickled_weight(path: Path, marker: Path) -> Path:
    """A weight its config marks ``use_pickle``: torch.load(weights_only=False) of its bytes."""
    return _pt2_pickled(path, marker, "weights", "model_weights_config.json", "weight_0")


def pt2_pickled_constant(path: Path, marker: Path) -> Path:
    """A tensor constant marked ``use_pickle`` (a module's plain tensor attribute)."""
    return _pt2_pickled(path, marker, "constants", "model_constants_config.json", "tensor_0")


def pt2_opaque_object(path: Path, marker: Path) -> Path:
    """An ``opaque_obj_*`` constant: ``pickle.loads`` of its bytes."""
    exported(path)

    def change(inner: str, data: bytes) -> bytes:
        if inner != "data/constants/model_constants_config.json":
            return data
        parsed = json.loads(data)
        parsed["config"]["opaque"] = {"path_name": "opaque_obj_0", "is_param": False,
                                      "use_pickle": True, "tensor_meta": None}  # fmt: skip
        return json.dumps(parsed).encode()

    _rewrite(path, change, {"data/constants/opaque_obj_0": _payload(marker)})
    return path


def package_source(path: Path, marker: Path) -> Path:
    """An interned module whose import creates the marker, named by the package's pickle."""
    source = f"open({str(marker)!r}, 'w').close()\n\nclass Config:\n    pass\n"
    with torch.package.PackageExporter(path) as exporter:
        exporter.save_source_string("configs", source)
        exporter.save_pickle("weights", "state.pkl", {"w": torch.ones(2)})
    config = b"\x80\x03cconfigs\nConfig\nq\x00)\x81q\x01."  # NEWOBJ of configs.Config
    _rewrite(path, lambda inner, data: config if inner == "weights/state.pkl" else data, {})
    return path


def package_pickle(path: Path, marker: Path) -> Path:
    """A package of only tensors whose pickle names ``builtins.exec`` (no source shipped)."""
    tensor_package(path)
    command = f"open({str(marker)!r}, 'w').close()"
    payload = b"\x80\x03cbuiltins\nexec\nX" + len(command).to_bytes(4, "little")
    payload += command.encode() + b"\x85R."
    _rewrite(path, lambda inner, data: payload if inner == "weights/state.pkl" else data, {})
    return path


def package_text_resource(path: Path, marker: Path) -> Path:
    """A protocol-0 pickle saved as a text resource (``notes.txt``) beside a harmless README:
    ``load_pickle("weights", "notes.txt")`` runs it."""
    tensor_package(path)
    # builtins: PackageImporter imports only the modules the archive lists as extern, and builtins
    code = f'open("{marker}", "w").close()'
    payload = f"cbuiltins\nexec\n(S'{code}'\ntR.".encode()
    readme = b"config files and weights\n"
    _rewrite(path, lambda inner, data: data,
             {"weights/notes.txt": payload, "weights/README": readme})  # fmt: skip
    return path


class _Printing(torch.nn.Module):
    """A scripted module whose ``__setstate__`` (TorchScript code, run by torch.jit.load) prints."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.register_buffer("weight", torch.ones(2))

    @torch.jit.export
    def __getstate__(self) -> tuple[str, torch.Tensor]:
        return (self.text, self.weight)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, torch.Tensor]) -> None:
        print(state[0])
        self.text = state[0]
        self.weight = state[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def torchscript_code(path: Path, marker: Path) -> Path:
    torch.jit.save(torch.jit.script(_Printing(f"{MARKER_TEXT}{marker.name}")), path)
    return path


#: name -> (builder(path, marker), the loader that runs it: export / package / jit)
HOSTILE: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "pt2_sample_inputs.pt2": (pt2_sample_inputs, "export"),
    "pt2_sample_inputs_legacy.pt2": (pt2_sample_inputs_legacy, "export"),
    "pt2_pickled_weight.pt2": (pt2_pickled_weight, "export"),
    "pt2_pickled_constant.pt2": (pt2_pickled_constant, "export"),
    "pt2_opaque_object.pt2": (pt2_opaque_object, "export"),
    "package_source.pt": (package_source, "package"),
    "package_pickle.pt": (package_pickle, "package"),
    "package_text_resource.pt": (package_text_resource, "package"),
    "torchscript_code.pt": (torchscript_code, "jit"),
}
#: name -> (builder(path), its loader)
BENIGN: dict[str, tuple[Callable[[Path], Path], str]] = {
    "exported.pt2": (exported, "export"),
    "tensors_package.pt": (tensor_package, "package"),
    "scripted.pt": (scripted, "jit"),
}
