"""``show``'s report: the header lines and tensor table (tabulate's format, ``text.table``), and
the ``--json`` document (written as made: :func:`json_chunks`)."""

from __future__ import annotations

from collections.abc import Iterator
from json.encoder import encode_basestring_ascii
from math import prod
from typing import Any

from ckpttool.commands.show import ShowReport
from ckpttool.formats.registry import format_lines
from ckpttool.frameworks.registry import framework_of
from ckpttool.model.records import (
    ELEMENTS_PER_BYTE,
    ITEMSIZE,
    ChunkedStorageRecord,
    StorageRecord,
    TensorRecord,
)
from ckpttool.model.roles import NESTED, TRAINING
from ckpttool.render.text import human_count, human_size, plain, short, table


def tensor_json(info: Any) -> dict[str, Any]:
    record: TensorRecord = info.record
    storage = record.storage
    numel = prod(record.shape)
    if record.parts:
        nbytes = record.stored_nbytes
    else:  # record.stored_nbytes without its property calls (this runs once per tensor)
        dtype = record.dtype
        nbytes = -(-numel // ELEMENTS_PER_BYTE.get(dtype, 1)) * ITEMSIZE.get(dtype, 1)
    out: dict[str, Any] = {
        "key": record.key,
        "dtype": record.dtype,
        "shape": list(record.shape),
        "numel": numel,
        "nbytes": nbytes,
        "stride": list(record.stride),
        "storage_offset": record.storage_offset,
        "storage": storage.key if storage is not None else None,
        "location": storage.location if storage is not None else record.location,
        "kind": record.kind,
        "layout": record.layout,
        "notes": info.notes,
    }
    if isinstance(storage, ChunkedStorageRecord):  # DCP: where each piece is stored
        out["chunks"] = [
            {"file": c.file, "offsets": list(c.offsets), "sizes": list(c.sizes)}
            for c in storage.chunks
        ]
        if storage.placement:
            out["placement"] = storage.placement
    if record.dtensor is not None:  # one rank's piece of a DTensor: what this file holds
        local = record.dtensor.local
        out["dtensor"] = {
            "placements": list(record.dtensor.placements),
            "local_shape": list(local.shape),
            "local_storage": local.storage.key if local.storage is not None else None,
            "mesh_shape": list(record.dtensor.mesh_shape),
            "mesh_dim_names": plain(record.dtensor.mesh_dim_names),
            "coordinate": plain(record.dtensor.coordinate),
        }
    if info.stats is not None:
        out["stats"] = {k: plain(v) for k, v in vars(info.stats).items()}
    elif info.stats_unavailable is not None:
        out["stats"] = None
        out["stats_unavailable"] = info.stats_unavailable
    return out


class TensorLines:
    """A tensor's line of ``show --json``: the text json writes for :func:`tensor_json`, made
    without the dict for a plain tensor (no stats, parts, chunks or DTensor: almost every tensor).

    At 100,000 tensors the dicts and their encoding were a third of the command's time after
    the pickle walk. A field whose value json might write otherwise than assumed here (a
    string subclass is written as a string; a bool where an int is expected is not) sends the
    tensor to the encoder with its dict.
    """

    def __init__(self) -> None:
        from ckpttool.render.json_text import item_encoder

        self.encode = item_encoder()
        # by (dtype, shape, stride): the text from "dtype" to "stride" (numel, nbytes between)
        self.sizes: dict[tuple[Any, ...], str] = {}
        # by (location, kind, layout): the text from "location" to the "notes" key
        self.places: dict[tuple[Any, ...], str] = {}

    def __call__(self, info: Any) -> str:
        record: TensorRecord = info.record
        storage = record.storage
        shape = record.shape
        stride = record.stride
        offset = record.storage_offset
        if (
            info.stats is not None
            or info.stats_unavailable is not None
            or record.parts
            or record.dtensor is not None
            or type(shape) is not tuple
            or type(stride) is not tuple
            or type(offset) is not int
            # True == 1: a text made for (1, 4) would not say [true, 4]
            or bool in map(type, shape)
            or bool in map(type, stride)
        ):
            return self.encode(tensor_json(info))
        if storage is None:
            storage_text = "null"
            location = record.location
        elif type(storage) is StorageRecord and type(storage.key) is str:
            storage_text = encode_basestring_ascii(storage.key)
            location = storage.location
        else:  # chunks, or a key json would write otherwise
            return self.encode(tensor_json(info))
        dtype = record.dtype
        sizes = self.sizes.get((dtype, shape, stride))
        if sizes is None:
            if type(dtype) is not str:
                return self.encode(tensor_json(info))
            numel = prod(shape)
            nbytes = -(-numel // ELEMENTS_PER_BYTE.get(dtype, 1)) * ITEMSIZE.get(dtype, 1)
            sizes = self.sizes[dtype, shape, stride] = (
                f', "dtype": {encode_basestring_ascii(dtype)}, "shape": {self.encode(list(shape))}'
                f', "numel": {numel}, "nbytes": {nbytes}, "stride": {self.encode(list(stride))}'
            )
        place = (location, record.kind, record.layout)
        places = self.places.get(place)
        if places is None:
            if not all(type(word) is str for word in place):
                return self.encode(tensor_json(info))
            location_text, kind_text, layout_text = map(encode_basestring_ascii, place)
            places = self.places[place] = (
                f', "location": {location_text}, "kind": {kind_text}, "layout": {layout_text}'
                ', "notes": '
            )
        key = record.key
        key_text = encode_basestring_ascii(key) if isinstance(key, str) else self.encode(key)
        notes = info.notes
        notes_text = self.encode(notes) if notes else "[]"
        return (
            f'{{"key": {key_text}{sizes}, "storage_offset": {offset}, "storage": {storage_text}'
            f"{places}{notes_text}}}"
        )


def render_json(report: ShowReport) -> dict[str, Any]:
    """``show --json``: docs/schemas/show.schema.json."""
    document = _document(report)
    document["tensors"] = document["tensors"].values()
    return document


def json_chunks(report: ShowReport) -> Iterator[str]:
    """The text of ``render_json(report)`` as :func:`~ckpttool.render.json_text.chunks` writes
    it, each tensor's record made as it is written (not all of them first)."""
    from ckpttool.render.json_text import chunks

    return chunks(_document(report))


def _document(report: ShowReport) -> dict[str, Any]:
    """``render_json``'s value with its tensors as a :class:`~ckpttool.render.json_text.Rows`."""
    from ckpttool.render.json_text import Rows

    optimizer = None
    if report.optimizer is not None:
        optimizer = plain(vars(report.optimizer))
    return {
        "file": report.path,
        "format": report.format,
        "size": report.file_size,
        "layout": report.layout,
        "details": plain(report.details),
        "fields": {k: plain(v) for k, v in report.fields.items()},
        "num_tensors": len(report.tensors),
        "num_parameters": report.num_parameters,
        "bytes_by_dtype": report.bytes_by_dtype,
        "num_bytes": report.num_bytes,
        "unreferenced_bytes": report.unreferenced[0],
        "total_tensors": report.total_tensors,
        "selection": (
            {"section": report.section, "filter": report.pattern} if report.is_selection else None
        ),
        "model_part": report.model_part,
        "optimizer_part": report.optimizer_part,
        "shared_storage": report.shared,
        "optimizer": optimizer,
        "rng": report.rng,
        "parts": {name: plain(settings) for name, settings in report.parts.items()},
        "warnings": report.warnings,
        "tensors": Rows(report.tensors, tensor_json, TensorLines()),
    }


def render_text(report: ShowReport) -> str:
    """The header (file, format, layout, counts, fields, optimizer), then the tensor table."""
    lines = [
        f"file:       {report.path}",
        f"format:     {report.format}  ({human_size(report.file_size)} on disk)",
        *_data_files_line(report.details),
        f"layout:     {report.layout_title}{_parts_note(report)}",
        *_member_lines(report.details),
        *_module_lines(report.details),
        *format_lines(report.format, report.details),
        *_framework_lines(report.details),
        *_count_lines(report),
    ]
    top = {k: v for k, v in report.fields.items() if "." not in k}
    for key, value in top.items():
        lines.append(f"{key + ':':<11} {short(value)}")
    for name, settings in report.parts.items():
        lines.append(f"{name + ':':<11} {_settings_line(settings)}")
    history = _rescale_history(report.fields)
    if history:
        lines.append(f"rescaled_from: {history}")
    if report.rng:
        lines.append("rng:        " + ", ".join(report.rng))
    if report.optimizer is not None:
        lines.extend(_optimizer_lines(report))
    framework = framework_of(report.details.get("layout"))
    parameters = framework.show_table(report.details) if framework is not None else []
    if parameters:
        lines.append("")
        headers = ["parameter", "shape", "numel", "kind"]
        lines.append(table(parameters, headers))
    if not report.tensors:
        return "\n".join(lines)
    lines.append("")
    rows = []
    sizes: dict[int, str] = {}  # human_size by bytes: most tensors share a few sizes
    for info in report.tensors:
        record = info.record
        numel = prod(record.shape)
        if record.parts:
            nbytes = record.stored_nbytes
        else:  # record.stored_nbytes without its property calls
            dtype = record.dtype
            nbytes = -(-numel // ELEMENTS_PER_BYTE.get(dtype, 1)) * ITEMSIZE.get(dtype, 1)
        size = sizes.get(nbytes)
        if size is None:
            size = sizes[nbytes] = human_size(nbytes)
        row = [record.key, record.dtype, list(record.shape), numel, size,
               "; ".join(info.notes) or None]  # fmt: skip
        if info.stats is not None:
            s = info.stats
            row[5:5] = [_num(s.min), _num(s.max), _num(s.mean), _num(s.std), s.nan, s.inf]
        elif info.stats_unavailable is not None:
            row[5:5] = ["n/a", None, None, None, None, None]
            row[-1] = "; ".join([*info.notes, f"no stats: {info.stats_unavailable}"])
        rows.append(row)
    headers = ["key", "dtype", "shape", "numel", "size", "notes"]
    if any(info.stats is not None or info.stats_unavailable for info in report.tensors):
        # the population standard deviation (divided by N): named so in the header
        headers[5:5] = ["min", "max", "mean", "std(ddof=0)", "nan", "inf"]
    # tabulate's text (text.table): None is an empty cell
    lines.append(table(rows, headers))
    return "\n".join(lines)


def _parts_note(report: ShowReport) -> str:
    """Where a nested dict keeps its model and optimizer, when found by their key names."""
    if report.layout not in (NESTED, TRAINING):
        return ""
    parts = [f"{name} in {key!r}"
             for name, key in (("model", report.model_part), ("optimizer", report.optimizer_part))
             if key]  # fmt: skip
    return f" ({', '.join(parts)})" if parts else ""


def _count_lines(report: ShowReport) -> list[str]:
    """The ``tensors:``, ``bytes:`` and ``tied:`` lines: what the selected tensors hold."""
    if report.total_tensors == 0:
        return ["tensors:    none (this checkpoint holds no tensors)"]
    where = ", ".join(
        f"{name} {value!r}"
        for name, value in (("section", report.section), ("filter", report.pattern))
        if value
    )
    if not report.tensors:
        return [f"tensors:    0 of {report.total_tensors}  ({where} matched no tensor)"]
    count = (
        f"{len(report.tensors)} of {report.total_tensors}" if where else str(len(report.tensors))
    )
    extras = [where] if where else []
    if report.num_parameters is not None:
        extras.append(
            f"{human_count(report.num_parameters)} parameter{'s' * (report.num_parameters != 1)}"
        )
    lines = [
        f"tensors:    {count}" + (f"  ({'; '.join(extras)})" if extras else ""),
        "bytes:      "
        + ", ".join(f"{d} {human_size(n)}" for d, n in report.bytes_by_dtype.items()),
    ]
    unreferenced, holding = report.unreferenced
    if unreferenced:
        lines.append(
            f"unreferenced: {human_size(unreferenced)} in {holding} "
            f"storage{'s' if holding > 1 else ''} (stored, but viewed by no tensor: "
            "`ckpttool edit --compact` drops it)"
        )
    if report.shared:
        keys = sum(len(group) for group in report.shared)
        first = report.shared[0]
        example = ", ".join(first[:2]) + (f" +{len(first) - 2}" if len(first) > 2 else "")
        more = f"; {len(report.shared) - 1} more" if len(report.shared) > 1 else ""
        storages = f"{len(report.shared)} storage{'s' if len(report.shared) > 1 else ''}"
        lines.append(
            f"tied:       {storages} shared by {keys} keys, counted once ({example}{more})"
        )
    return lines


def _module_lines(details: dict[str, Any]) -> list[str]:
    """The classes of the pickled ``nn.Module`` objects a single file holds, read as their
    state dicts (a directory's member lines name its own)."""
    if isinstance(details.get("members"), list):
        return []
    if "module_class" in details:
        return [f"class:      {details['module_class']}"]
    classes = details.get("module_classes")
    if not isinstance(classes, dict):
        return []
    listed = ", ".join(f"{key} {cls}" for key, cls in classes.items())
    return [f"modules:    {listed}  (pickled nn.Modules, read as their state dicts)"]


def _framework_lines(details: dict[str, Any]) -> list[str]:
    """The lines a framework adds under the header (DeepSpeed: stage, ranks, tag, counters)."""
    framework = framework_of(details.get("layout"))
    return framework.show_lines(details) if framework is not None else []


def _data_files_line(details: dict[str, Any]) -> list[str]:
    """A directory checkpoint's data files (DCP: one per rank), missing ones marked."""
    files = details.get("files")
    if not isinstance(files, dict):
        return []
    sizes = [f"{name} {human_size(size) if size is not None else 'MISSING'}"
             for name, size in files.items()]  # fmt: skip
    chunks = details.get("tensor_chunks")
    return [f"files:      {', '.join(sizes)}" + (f"  ({chunks} tensor chunks)" if chunks else "")]


#: Counters a framework's directory records (trainer_state.json, the rank files), shown first.
_DIRECTORY_COUNTERS = ("global_step", "step", "epoch", "max_steps", "num_train_epochs",
                       "train_batch_size", "checkpoint_step", "scheduler_last_epoch",
                       "ranks")  # fmt: skip


def _member_lines(details: dict[str, Any]) -> list[str]:
    """A framework directory's counters, its files with roles and sizes, and what is missing."""
    files = details.get("members")
    if not isinstance(files, list):
        return []
    lines = [
        f"{key + ':':<11} {short(details[key])}" for key in _DIRECTORY_COUNTERS if key in details
    ]
    if "module_class" in details:
        lines.append(f"class:      {details['module_class']}")
    width = max((len(str(f.get("name", ""))) for f in files), default=0)
    lines.append(f"files:      {len(files)}")
    for member in files:
        role = str(member.get("role"))
        where = f" -> {member['section']}" if member.get("section") else ""
        lines.append(
            f"  {member.get('name')!s:<{width}}  {human_size(int(member.get('size') or 0)):>9}"
            f"  {role}{where}"
        )
    weights = details.get("weights_section")
    if weights:
        lines.append(
            f"keys:       the weights' keys as their files store them (section {weights!r})"
        )
    missing = details.get("missing") or []
    if missing:
        lines.append(f"missing:    {', '.join(str(m) for m in missing)}")
    if details.get("complete") is False:
        lines.append("complete:   no (the framework's resume would fail or be inexact)")
    return lines


#: Settings of one part on its line; the rest are counted (all of them are in --json).
MAX_SETTINGS_SHOWN = 10


def _settings_line(settings: dict[str, Any]) -> str:
    """``last_epoch=8, base_lrs=[0.001, 0.001], ...`` (the first ones, then how many more)."""
    shown = [f"{key}={short(value, 40)}" for key, value in
             list(settings.items())[:MAX_SETTINGS_SHOWN]]  # fmt: skip
    more = len(settings) - MAX_SETTINGS_SHOWN
    return ", ".join(shown) + (f", ... (+{more} more)" if more > 0 else "")


def _rescale_history(fields: dict[str, Any]) -> str:
    """``rescale-step``'s history (``rescaled_from.N.<key>`` fields) as one line, oldest first."""
    entries: dict[str, dict[str, Any]] = {}
    for key, value in fields.items():
        if not key.startswith("rescaled_from."):  # most fields (a file's lookup table: 500,000)
            continue
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "rescaled_from":
            entries.setdefault(parts[1], {})[parts[2]] = value
    return "; ".join(
        ", ".join(f"{name} {value}" for name, value in entries[index].items())
        for index in sorted(entries, key=lambda index: (len(index), index))  # "10" after "9"
    )


def _optimizer_lines(report: ShowReport) -> list[str]:
    opt = report.optimizer
    assert opt is not None
    dtypes = ", ".join(f"{d} {human_size(n)}" for d, n in opt.state_dtypes.items())
    lines = [
        f"optimizer:  {opt.type_guess}, state for {opt.params_with_state} "
        f"param{'s' * (opt.params_with_state != 1)} ({dtypes})",
    ]
    for index, group in enumerate(opt.param_groups):
        hyper = ", ".join(f"{k}={short(v, 24)}" for k, v in group.items() if v is not None)
        lines.append(f"  group {index}: {hyper}")
    if opt.param_names and opt.mapping_rule == "decay groups":
        lines.append(
            f"  state entries map to model parameters by the Trainer's weight-decay groups "
            f"({len(opt.param_names)}; a guess from names and order, checked against shapes)"
        )
    elif opt.param_names:
        lines.append(f"  state entries map to model parameters by order ({len(opt.param_names)})")
    return lines


def _num(value: float) -> str:
    return f"{value:.4g}"


def collection_json(layout: Any) -> dict[str, Any]:
    """``show`` of a directory holding several checkpoints (a Trainer ``output_dir``)."""
    listing = {
        "file": layout.directory,
        "format": "directory",
        "layout": layout.kind,
        "layout_title": layout.title,
        "checkpoints": plain(layout.details.get("checkpoints", [])),
    }
    for key in ("counter", "recipe_state"):  # torchtune's output_dir: epochs, its resume state
        if key in layout.details:
            listing[key] = plain(layout.details[key])
    return listing


def collection_text(listing: dict[str, Any]) -> str:
    rows = [
        [c["name"], c["step"], "yes" if c["complete"] else "no", ", ".join(c["missing"]) or None]
        for c in listing["checkpoints"]
    ]
    header = [
        f"file:       {listing['file']}",
        f"layout:     {listing['layout_title']} ({len(rows)} checkpoint{'s' * (len(rows) != 1)}; "
        "show one for its contents)",
    ]
    recipe = listing.get("recipe_state")
    if isinstance(recipe, dict):
        counters = ", ".join(
            f"{key} {value}" for key, value in recipe.items()
            if key not in ("file", "optimizer", "dataloader")
        )  # fmt: skip
        held = "present" if recipe.get("optimizer") else "absent"
        header.append(f"resume:     {recipe['file']}: {counters or 'no counters'}; optimizer "
                      f"state: {held}")  # fmt: skip
    header.append("")
    notes = [
        f"note: {c['name']}: not checkpoint-<N>, so Trainer's get_last_checkpoint never resumes "
        "from it, but its rotation (save_total_limit) counts it and may delete it"
        for c in listing["checkpoints"]
        if not c.get("resumable", True)
    ]
    counter = listing.get("counter", "step")
    text = "\n".join(header) + table(rows, ["checkpoint", counter, "complete", "missing"])
    return "\n".join([text, *notes])
