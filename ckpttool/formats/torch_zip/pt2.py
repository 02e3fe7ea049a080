"""A torch.export archive (``.pt2``, ``torch.export.save``) read for its tensors: the exported
program's weights (its ``state_dict``) and tensor constants, by their FQNs, lazily.

torch.export writes each weight and tensor constant as a raw storage record
(``data/weights/weight_<n>``, ``data/constants/tensor_<n>``, stored, 64-byte aligned) and a JSON
payload config per folder (``model_weights_config.json``, ``model_constants_config.json``) that
gives, by FQN, the record, the dtype (``torch._export.serde.schema.ScalarType``), sizes,
strides, storage offset, device and whether it is a parameter; FQNs sharing a record share its
storage, as ``torch.export.load`` rebuilds them (``_build_file_map``: the storage's dtype is the
first entry's). Entries the config marks ``use_pickle`` (a ``torch.save`` archive inside the
archive) and custom or opaque objects are not read: they are refused by name (``scan`` walks
them). Nothing here unpickles anything; the program's graph (``models/*.json``) is not read.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, BinaryIO

from ckpttool.errors import CorruptCheckpointError, NotACheckpointError
from ckpttool.formats.base import Parsed
from ckpttool.formats.torch_zip import kinds
from ckpttool.formats.torch_zip.reader import member_span, read_record
from ckpttool.formats.torch_zip.zip_index import ZipIndex
from ckpttool.io.source import source_size
from ckpttool.model.records import ITEMSIZE, StorageRecord, TensorRecord, fits_int64

FORMAT_ID = kinds.TORCH_EXPORT
#: torch._export.serde.schema.ScalarType -> ckpttool's dtype names (torch 2.13).
SCALAR_TYPES = {
    1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32",
    8: "float64", 9: "complex32", 10: "complex64", 11: "complex128", 12: "bool", 13: "bfloat16",
    28: "uint16", 29: "float8_e4m3fn", 30: "float8_e5m2", 31: "float8_e4m3fnuz",
    32: "float8_e5m2fnuz", 33: "float8_e8m0fnu", 34: "uint32", 35: "uint64",
}  # fmt: skip
MAX_CONFIG = 64 << 20  # a payload config lists one entry per weight: far below this
MODEL = "model"  # the model torch.export.save writes (others' FQNs are prefixed by their name)


def read_pt2(handle: BinaryIO, archive: ZipIndex) -> Parsed:
    """The archive's weights then tensor constants, ``{fqn: TensorRecord}``."""
    names = archive.namelist()
    root_folder = names[0].split("/", 1)[0] if names and "/" in names[0] else ""
    prefix = f"{root_folder}/" if root_folder else ""
    file_size = source_size(handle)
    models = sorted(
        kinds.inner_name(n)[len("models/") : -len(".json")]
        for n in names
        if kinds.inner_name(n).startswith("models/") and n.endswith(".json")
    )
    if not models:
        raise NotACheckpointError("a torch.export archive without a model (models/*.json)")
    tree: OrderedDict[str, Any] = OrderedDict()
    storages: dict[str, StorageRecord] = {}
    counts = {"weights": 0, "constants": 0}
    for model in models:
        for folder, kind in (("weights", "weights"), ("constants", "constants")):
            config_name = f"{prefix}data/{folder}/{model}_{folder}_config.json"
            info = archive.find(config_name)
            if info is None:
                if archive.find(f"{prefix}data/{folder}/{model}.pt") is not None:
                    raise NotACheckpointError(
                        f"a torch.export archive of the legacy layout (data/{folder}/{model}.pt, "
                        "a torch.save archive inside it): not read; `ckpttool scan` walks it"
                    )
                continue
            config = _config(read_record(handle, info, archive, file_size, limit=MAX_CONFIG))
            for fqn, entry in config.items():
                name = fqn if model == MODEL else f"{model}.{fqn}"
                record = _record(entry, f"{prefix}data/{folder}/", archive, storages, fqn)
                tree[name] = record
                counts[kind] += 1
    spans: dict[str, tuple[int, int]] = {}

    def span(storage: StorageRecord) -> tuple[int, int]:
        found = spans.get(storage.record)
        if found is None:
            found = spans[storage.record] = member_span(handle, archive.getinfo(storage.record))
        return found

    pickled = [
        kinds.inner_name(n)
        for n in names
        if kinds.pt2_member_role(kinds.inner_name(n), set(), configs_readable=True) == "load"
    ]
    return Parsed(
        format=FORMAT_ID,
        root=tree,
        span=span,
        details={"prefix": root_folder, "models": models, **counts, "pickled": pickled},
        storages=list(storages.values()),
    )


def show_lines(details: dict[str, Any]) -> list[str]:
    """``show``'s lines: what the archive holds beside the tensors, and what is not read."""
    lines = [
        f"export:     {details.get('weights', 0)} weights, {details.get('constants', 0)} "
        f"tensor constants (model{'s' * (len(details.get('models', ())) != 1)}: "
        f"{', '.join(details.get('models', ()))})"
    ]
    pickled = details.get("pickled") or []
    if pickled:
        shown = ", ".join(pickled[:3]) + (
            f" and {len(pickled) - 3} more" if len(pickled) > 3 else ""
        )
        lines.append(
            f"pickles:    {shown}: not read (torch.export.load unpickles them; "
            "`ckpttool scan` checks them)"
        )
    return lines


def _config(data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data)["config"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(f"unreadable payload config ({error!r:.80})") from None
    if not isinstance(config, dict):
        raise CorruptCheckpointError("a payload config whose 'config' is not an object")
    return config


def _ints(values: Any, what: str, fqn: str) -> tuple[int, ...]:
    """``[{"as_int": 2}, ...]`` as integers; a symbolic size is refused."""
    try:
        result = tuple(value["as_int"] for value in values)
    except (KeyError, TypeError):
        raise NotACheckpointError(f"{fqn}: {what} that are not integers (symbolic?)") from None
    if not all(isinstance(v, int) and v >= 0 and fits_int64(v) for v in result):
        raise CorruptCheckpointError(f"{fqn}: bad {what} {list(result)!r:.80}")
    return result


def _record(
    entry: Any, folder: str, archive: ZipIndex, storages: dict[str, StorageRecord], fqn: str
) -> TensorRecord:
    if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
        raise CorruptCheckpointError(f"{fqn}: a payload entry without a path_name")
    path_name = entry["path_name"]
    if entry.get("use_pickle") or not isinstance(entry.get("tensor_meta"), dict):
        raise NotACheckpointError(
            f"{fqn} is a pickled object in the torch.export archive ({path_name}): not read "
            "(torch.export.load unpickles it: `ckpttool scan` walks it)"
        )
    meta = entry["tensor_meta"]
    dtype = SCALAR_TYPES.get(meta.get("dtype"))
    if dtype is None:
        raise NotACheckpointError(f"{fqn}: dtype {meta.get('dtype')!r:.20} is not known")
    shape = _ints(meta.get("sizes"), "sizes", fqn)
    stride = _ints(meta.get("strides"), "strides", fqn)
    (offset,) = _ints([meta.get("storage_offset")], "storage offset", fqn)
    if len(stride) != len(shape):
        raise CorruptCheckpointError(f"{fqn}: {len(shape)} sizes but {len(stride)} strides")
    storage = storages.get(path_name)
    if storage is None:
        member = archive.find(folder + path_name)
        if member is None:
            raise CorruptCheckpointError(f"{fqn}: record {folder + path_name!r} is missing")
        device = meta.get("device") or {}
        location = str(device.get("type", "cpu")) + (
            f":{device['index']}" if device.get("index") is not None else ""
        )
        itemsize = ITEMSIZE.get(dtype, 1)
        storage = StorageRecord(
            path_name, dtype, member.file_size // itemsize, location, member.filename,
            member.file_size,
        )  # fmt: skip
        storages[path_name] = storage
    return TensorRecord(
        "",
        dtype,
        shape,
        stride,
        offset,
        storage,
        requires_grad=bool(meta.get("requires_grad")),
        kind="parameter" if entry.get("is_param") else "tensor",
    )
