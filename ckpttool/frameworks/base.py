"""The framework protocol: what a framework that writes checkpoints as several files tells.

One folder per framework (``huggingface``: ``save_pretrained`` model directories and
``Trainer`` ``checkpoint-N/`` folders; ``accelerate``: ``save_state`` folders; ``deepspeed``:
ZeRO save and tag directories) keeps that framework's file names, keys and rules, and exposes
them as one :class:`Framework` object, listed by import string in
:mod:`ckpttool.frameworks.registry` in detection order. Nothing here names a framework.

The order of calls (like ``torch.distributed.checkpoint``'s planner, documented on each method):

1. :meth:`Framework.detect` ``(path)``: the door (:func:`ckpttool.checkpoint.open_checkpoint`)
   asks each framework in registry order; the first that knows the directory returns a
   :class:`FrameworkDirectory`: its members with their roles and where their content goes in the
   merged tree, the files it would have written that are not there (completeness), the
   problems between them, and what the directory is called.
2. :meth:`Framework.open_view` ``(layout, view)``: when a caller asks for a view by name
   (``open_checkpoint(path, view=WEIGHTS_VIEW)``), the frameworks that declare it in
   :attr:`Framework.views` are asked first; one returns the view as a Checkpoint. A reader of
   the model's tensors asks for :data:`DEFAULT_VIEW`: each framework's own
   :attr:`Framework.default_view`, asked the same way.
3. Otherwise :meth:`Framework.open_directory` may read the directory as one Checkpoint itself
   (a set of per-rank files: each tensor assembled from every rank's piece); when it returns
   None, :func:`ckpttool.frameworks.tree.read_directory` opens the members through the
   format registry, merges their trees and calls :meth:`Framework.check_tree` for what the
   framework reads out of the merged tree (details for ``show``, problems between files).
4. Commands then ask the framework of ``details["layout"]`` (:func:`registry.framework_of`)
   for what they need: :meth:`Framework.show_lines` / :meth:`Framework.show_table` /
   :meth:`Framework.num_parameters` (``show``, as data the renderer formats),
   :meth:`Framework.model_directory` (``convert`` into a model directory),
   :meth:`Framework.edit_leaves_out` (``edit`` of the directory). ``rescale-step``
   detects the directory itself (frameworks that :attr:`~Framework.rescales_itself` first) and
   calls :meth:`Framework.rescale`, or :meth:`Framework.rescale_plan` and writes the plan.
   ``repair`` of a directory asks every framework, without detecting first, for
   :meth:`Framework.rebuild_index` and :meth:`Framework.run_layout` (what it would change) and
   for :attr:`Framework.temp_files`; it writes the changes itself.

Detection reads names, sizes and the small JSON files only; member files are opened with
:func:`open_member` (the format registry), never through the door above this floor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import CkptError, CorruptCheckpointError, InputError, name_file
from ckpttool.formats.base import CHECKPOINT_SUFFIXES as _CHECKPOINT_SUFFIXES
from ckpttool.io.source import is_url, join, read_small

if TYPE_CHECKING:
    from ckpttool.formats.base import Checkpoint
    from ckpttool.io.progress import ProgressCallback
    from ckpttool.model.rescaling import DirectoryPlan, DirectoryRescaleReport, RescaleRequest

# Roles a member file can have.
WEIGHTS = "weights"  # a whole weights file, or one shard of them
INDEX = "index"  # a *.index.json naming each tensor's shard
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
RNG = "rng"
SAMPLER = "sampler"
TRAINER_STATE = "trainer_state"
TRAINING_STATE = "training_state"  # pickled counters, loops, callbacks (Lightning's meta.pt)
TRAINING_ARGS = "training_args"
CONFIG = "config"
CUSTOM = "custom"
OTHER = "other"  # tokenizer files, READMEs...: listed, not read
#: A data file of a directory format inside the layout (DCP's ``__<rank>_<n>.distcp``): read
#: through that format's index, never as a file of its own
FORMAT_DATA = "format_data"

#: The layout of a directory that holds several checkpoints (a Trainer ``output_dir``); other
#: frameworks' run directories have layouts of their own, all with ``FrameworkDirectory.collection``.
COLLECTION = "hf_trainer_output"

#: Where a folder of several model folders lists its named parts (``details[PARTS]``: dicts with
#: ``name``, ``folder``, ``type``, ``prefix``, ``section`` and ``tensors``; frameworks/parts.py).
PARTS = "parts"

#: Names of files that are usually checkpoints (the format floor's, where scan needs them too).
CHECKPOINT_SUFFIXES = _CHECKPOINT_SUFFIXES


def one_series(names: list[str]) -> bool:
    """Whether checkpoint file ``names`` (two or more) are one series: names that differ only by
    their numbers (``ckpt-100.pt``, ``ckpt-200.pt``), a run's checkpoints (``trend`` follows
    them) rather than the parts of one checkpoint."""
    return len(names) > 1 and len({re.sub(r"\d+", "#", name) for name in names}) == 1


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
    #: The member is the index file of a directory format (DCP's ``.metadata``): the directory
    #: it indexes is read whole, as that format reads it (section "": its top-level entries go
    #: to the top level of the merged tree)
    indexes_directory: bool = False


@dataclass
class FrameworkDirectory:
    """What a framework says a directory holds (its ``kind`` is what outputs call the
    checkpoint's ``layout``)."""

    kind: str  # "hf_model", "hf_trainer", "hf_trainer_output", "accelerate", "deepspeed"
    title: str  # "Hugging Face Trainer checkpoint"
    directory: str
    members: list[Member]
    missing: list[str] = field(default_factory=list)  # expected files that are not there
    problems: list[str] = field(default_factory=list)  # inconsistencies between members
    details: dict[str, object] = field(default_factory=dict)  # shown by `show` (step, ranks...)
    index: str | None = None  # the index file, when the weights are sharded
    complete: bool = True  # everything the framework writes for a resumable checkpoint is there
    #: A run directory holding several checkpoints (a Trainer ``output_dir``, torchtitan's
    #: ``checkpoint/`` of ``step-N/``): ``details["checkpoints"]`` lists them
    #: (:func:`describe_collection`), and commands other than ``show`` ask for one of them.
    collection: bool = False
    # JSON members already parsed (by name): detection reads an index or trainer_state.json,
    # and reading the directory uses what it found rather than reading the file again
    parsed_json: dict[str, object] = field(default_factory=dict, repr=False)
    # what the framework found while detecting (its own type), so that opening a view or a
    # rescale does not probe the directory again
    found: object = field(default=None, repr=False, compare=False)
    #: How a member that is no file of its own is opened (a member of a zip archive: its byte
    #: range read as a file), given its name, ``strict`` and ``refuse_dangerous``; None: each
    #: member is a file of the directory, opened by :func:`open_member`
    opener: Callable[[str, bool, bool], Checkpoint] | None = field(
        default=None, repr=False, compare=False
    )

    def read_json(self, name: str) -> object:
        """The JSON member ``name``, parsed once."""
        if name not in self.parsed_json:
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


def inside(directory: str, name: str) -> str:
    """``directory/name``, refusing a name that would leave the directory."""
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise InputError(f"{directory}: the index names a file outside the checkpoint: {name!r}")
    return join(directory, name)


def describe_collection(layout: object) -> str:
    """One line for a directory of several checkpoints: each with its step and completeness."""
    assert isinstance(layout, FrameworkDirectory)
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


def run_directory(
    path: str,
    kind: str,
    title: str,
    pattern: re.Pattern[str],
    detect: Callable[[str], FrameworkDirectory | None],
) -> FrameworkDirectory | None:
    """A local run directory holding checkpoint folders named by ``pattern`` (its group 1: the
    step or epoch; torchtitan's ``step-N/``, torchtune's ``epoch_N/``), as a collection: each
    listed by number with its completeness as ``detect`` finds it (a folder it does not know
    lacks every file); None when there is no such folder. A URL names one checkpoint."""
    if is_url(path) or not os.path.isdir(path):
        return None
    try:
        names = os.listdir(path)
    except OSError:
        return None
    found = []
    for name in names:
        match = pattern.match(name)
        folder = os.path.join(path, name)
        if match is None or not os.path.isdir(folder):
            continue
        layout = detect(folder)
        complete = layout is not None and layout.complete
        missing = list(layout.missing) if layout is not None else ["every file"]
        found.append((int(match.group(1)), name, complete, missing))
    if not found:
        return None
    found.sort()
    result = FrameworkDirectory(
        kind=kind, title=title, directory=path, members=[], complete=False, collection=True
    )
    result.details["checkpoints"] = [
        {"name": name, "step": number, "complete": complete, "missing": missing,
         "resumable": True}
        for number, name, complete, missing in found
    ]  # fmt: skip
    return result


def collection_run(layout: FrameworkDirectory | None, title: str) -> RunLayout | None:
    """A collection's checkpoints as a :class:`RunLayout` (``run_layout``: resume takes the
    newest by name, no pointer file), oldest first; None when ``layout`` is not a collection
    or lists none that resume would load."""
    if layout is None or not layout.collection:
        return None
    listed = layout.details.get("checkpoints", [])
    assert isinstance(listed, list)
    names = tuple(c["name"] for c in listed if c.get("resumable", True))
    return RunLayout(title=title, checkpoints=names) if names else None


def read_json(path: str) -> object:
    """A small JSON file, bounded in size; a broken one is a corrupt checkpoint."""
    try:
        data = read_small(path, MAX_JSON_BYTES)
    except ValueError as error:  # over the limit
        raise CorruptCheckpointError(f"{path}: {error}") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({error})") from None


#: A model directory's config (transformers, diffusers), and the keys in it transformers
#: reads the weights' dtype from (``dtype`` since 4.56; ``torch_dtype`` before).
MODEL_CONFIG = "config.json"
DTYPE_KEYS = ("torch_dtype", "dtype")


def config_with_dtype(config: Path, dtype: str, *, dequantized: bool = False) -> None:
    """Rewrite the model config ``config`` to say the dtype its weights were cast to (every
    dtype key it has; ``torch_dtype`` when it has none), so that ``from_pretrained`` loads them
    in it; without an FP8 ``quantization_config`` once its weights are ``dequantized``. The one
    place ``edit --dtype`` and ``convert --dtype`` of a model directory bring it in line."""
    data = json.loads(config.read_text())
    if not isinstance(data, dict):
        return
    for key in DTYPE_KEYS:
        if key in data:
            data[key] = dtype
    if not any(key in data for key in DTYPE_KEYS):
        data["torch_dtype"] = dtype
    quantization = data.get("quantization_config")
    if dequantized and isinstance(quantization, dict) and quantization.get("quant_method") == "fp8":
        del data["quantization_config"]
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def open_member(
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    refuse_dangerous: bool = True,
    track_spans: bool = False,
) -> Checkpoint:
    """One member file of a framework's directory (local or a URL), opened through the format
    registry (a framework opens files, never the door above it)."""
    from ckpttool.formats.registry import open_file
    from ckpttool.io.source import local_path, open_local, open_source

    name = os.fspath(path)
    if is_url(name):
        return open_file(name, open_source(name), strict, refuse_dangerous, track_spans)
    name = local_path(name)
    return open_file(name, open_local(name), strict, refuse_dangerous, track_spans)


def open_format_directory(
    directory: str, *, strict: bool = True, refuse_dangerous: bool = True
) -> Checkpoint:
    """A directory in a directory format (DCP) that a framework's layout contains, opened
    through the format registry as the door would open it on its own."""
    from ckpttool.formats.registry import directory_format_of, open_directory_format
    from ckpttool.io.source import local_path, open_local

    if is_url(directory):
        from ckpttool.formats.registry import directory_formats
        from ckpttool.io.source import open_source

        for candidate in directory_formats():
            try:
                index = open_source(join(directory, candidate.index_name))
            except InputError as error:
                if "no such file" not in str(error):
                    raise
                continue
            return open_directory_format(candidate, directory, index, strict, refuse_dangerous)
        raise InputError(f"{directory}: no directory format reads it (no .metadata?)")
    name = local_path(directory)
    fmt = directory_format_of(name)
    if fmt is None:
        raise InputError(f"{directory}: no directory format reads it (no .metadata?)")
    index = open_local(os.path.join(name, fmt.index_name))
    return open_directory_format(fmt, name, index, strict, refuse_dangerous)


def format_directory_files(directory: str, names: tuple[str, ...]) -> dict[str, int]:
    """The files of a directory that keeps a directory format's data (DCP's ``.metadata`` and
    ``__<rank>_<n>.distcp``) beside a framework's own ``names`` (Lightning's ``meta.pt``), by
    name, with sizes: what :func:`list_files` lists; under an HTTP URL, which cannot list, those
    of ``names`` and of the formats' index files that exist, and, when all of ``names`` do, the
    data files the index names (its directory read as the format reads it)."""
    files = list_files(directory)
    if files or not is_url(directory):
        return files
    from ckpttool.formats.registry import directory_formats
    from ckpttool.io.remote import member_sizes

    indexes = [fmt.index_name for fmt in directory_formats()]
    found = member_sizes(directory, [*names, *indexes])
    if all(name in found for name in names) and any(index in found for index in indexes):
        with open_format_directory(directory) as opened:
            listed = opened.details.get("files", {})
            if isinstance(listed, dict):
                found.update(
                    {n: size for n, size in listed.items() if isinstance(size, int) and size}
                )
    return dict(sorted(found.items()))


class OpenedMembers(list[Any]):
    """The member checkpoints a directory checkpoint holds open: closed together, and asked
    together whether one in an object store changed (its ``Parsed.close``/``unchanged``)."""

    def close(self) -> None:
        for ckpt in self:
            ckpt.close()

    def check_unchanged(self) -> None:
        for ckpt in self:
            ckpt.check_unchanged()

    @contextmanager
    def closed_on_error(self, directory: str) -> Iterator[None]:
        """Within this block, an error closes every member opened so far, and a
        :class:`CkptError` names ``directory`` (unless it does already)."""
        try:
            yield
        except BaseException as error:
            self.close()
            if isinstance(error, CkptError):
                name_file(error, directory)
            raise


#: torch.distributed.checkpoint's index (written after every rank's data) and data files, as
#: the frameworks that keep a DCP tree in their directory find them.
DCP_INDEX = ".metadata"
DCP_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def dcp_directory(
    kind: str,
    title: str,
    path: str,
    files: dict[str, int],
    own: dict[str, tuple[str, str | None]],
    why_index: str,
) -> FrameworkDirectory:
    """A framework directory that keeps a DCP tree: the index and each rank's data files as
    members (``details["ranks"]``: how many ranks wrote), the framework's ``own`` files
    (name -> role, section), the rest listed only. Without the index it is incomplete;
    ``why_index`` says what that means (after the index's name, in the missing list)."""
    members = []
    ranks = set()
    for name, size in files.items():
        data = DCP_DATA_FILE.match(name)
        if name == DCP_INDEX:
            members.append(Member(name, INDEX, "", size, indexes_directory=True))
        elif data:
            members.append(Member(name, FORMAT_DATA, None, size, rank=int(data.group(1))))
            ranks.add(int(data.group(1)))
        elif name in own:
            members.append(Member(name, *own[name], size))
        else:
            members.append(Member(name, OTHER, None, size))
    layout = FrameworkDirectory(kind=kind, title=title, directory=path, members=members)
    if DCP_INDEX not in files:
        layout.missing.append(f"{DCP_INDEX} ({why_index})")
    if ranks:
        layout.details["ranks"] = max(ranks) + 1
    layout.complete = not layout.missing
    return layout


def has_dcp_files(files: dict[str, int]) -> bool:
    """Whether ``files`` hold a DCP index or a DCP data file."""
    return DCP_INDEX in files or any(DCP_DATA_FILE.match(name) for name in files)


#: A framework's view of its directories: the model's weights as the framework consolidates
#: them (DeepSpeed ZeRO: the fp32 master weights); a checkpoint without such a view opens as usual.
WEIGHTS_VIEW = "weights"
#: ``view=`` for the view the layout declares as its default (:attr:`Framework.default_view`):
#: what every reader of a checkpoint's tensors opens (``convert``, ``diff``, ``trend``, ``lora``,
#: ``ckpttool.open`` and ``ckpttool.load_state_dict`` when the caller names no view), so that
#: the command line and the library read one path the same way.
DEFAULT_VIEW = "default"
#: ``view=`` for the files as stored, a directory's members merged into one tree (what ``show``,
#: ``verify``, ``scan``, ``edit`` and ``rescale-step`` read; ``open_checkpoint`` without a view):
#: no framework offers it as a view of its own.
FILES_VIEW = "files"


@dataclass(frozen=True)
class ViewFacts:
    """What a view says about itself in ``details["view"]`` (for the commands' reports)."""

    name: str  # the view (WEIGHTS_VIEW)
    layout: str  # the layout outputs report for it ("deepspeed")
    counters: dict[str, Any] | None = None  # training counters ``diff`` compares
    notes: tuple[str, ...] = ()  # for convert's report: what was consolidated from what


def view_facts(ckpt: Any) -> ViewFacts | None:
    """The facts of the view ``ckpt`` was opened as (None: the files as stored)."""
    facts = ckpt.details.get("view")
    return facts if isinstance(facts, ViewFacts) else None


def reported_layout(ckpt: Any, layout: str) -> str:
    """The layout ``diff`` and ``convert`` report for ``ckpt``: a view's own (a ZeRO directory
    read as its fp32 weights is the DeepSpeed checkpoint ``show`` names), else ``layout``."""
    facts = view_facts(ckpt)
    return facts.layout if facts is not None else layout


@dataclass(frozen=True)
class ModelDirectoryOutput:
    """What a framework's model directory holds, for ``convert SRC DST/`` (the command writes
    it: :mod:`ckpttool.commands.convert.model_dir`)."""

    directory: Path | str  # the source directory (a URL as a str)
    weights_name: str  # the one weights file ("model.safetensors")
    copied_files: tuple[str, ...]  # copied byte for byte from the source when it has them
    tied_output_names: tuple[str, ...]  # stored as aliases of the input embedding
    config_entries: tuple[str, ...]  # top-level entries the copied files already hold
    owns: Callable[[str], bool]  # a file name such a directory holds (--force replaces only those)
    # endings of the input embedding's name that the loader ties the output embedding to when
    # the directory does not store one of ``tied_output_names`` ("embed_tokens.weight")
    tied_input_endings: tuple[str, ...] = ()
    shardable: bool = True  # its loader reads shards and an index (a PEFT adapter: no)


@dataclass(frozen=True)
class IndexRepair:
    """A sharded model directory's weights index as its shards' headers say it should be
    (``repair``): what is wrong with it, and the index to write in its place."""

    index: str  # the index file's name in the directory ("model.safetensors.index.json")
    damage: tuple[str, ...]  # what is wrong with the index or the shards, one line each
    content: bytes | None  # the rebuilt index; None when the index is right as it is
    changes: str = ""  # one line: what the rebuilt index changes
    lost: tuple[str, ...] = ()  # tensors the old index names that no shard holds any more
    #: The damage lines the rewritten index does not mend (lost tensors: they stay listed).
    stays: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunLayout:
    """A run directory's checkpoints as the framework's resume chooses among them
    (``repair``)."""

    title: str  # "Hugging Face Trainer output directory"
    checkpoints: tuple[str, ...]  # names inside the run directory, oldest first
    #: The file naming the checkpoint resume loads (DeepSpeed's ``latest``; it holds the name
    #: and nothing else); None: resume takes the newest by name, and no file says so.
    pointer: str | None = None
    pointed: str | None = None  # what the pointer names now (None: no pointer, or unreadable)
    pointer_problem: str = ""  # why the pointer could not be read, when it is there
    #: The name an incomplete checkpoint is moved to so that resume never picks it (None: it
    #: stays: the pointer decides what resume loads).
    aside: Callable[[str], str] | None = None


#: A plain directory of checkpoint files: an incomplete one is renamed NAME.incomplete.
ASIDE_SUFFIX = ".incomplete"
FILES_TITLE = "directory of checkpoint files"
#: The step in a checkpoint file's name: its last number (``step_1000.pt``, ``epoch=3-step=90``).
STEP = re.compile(r"(\d+)(?!.*\d)")


def files_run(directory: str, names: list[str]) -> RunLayout:
    """The checkpoint files ``names`` of a plain ``directory`` as a run, oldest first (what
    ``repair`` judges one by one): by the step in their names when each has a different one,
    else by modification time."""
    steps = [STEP.search(Path(name).stem) for name in names]
    numbers = [int(m.group(1)) for m in steps if m is not None]
    if len(numbers) == len(names) and len(set(numbers)) == len(names):
        order = sorted(zip(numbers, names))
        ordered = tuple(name for _, name in order)
    else:
        mtime = {name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in names}
        ordered = tuple(sorted(names, key=lambda n: (mtime[n], n)))
    return RunLayout(FILES_TITLE, ordered, aside=lambda name: name + ASIDE_SUFFIX)


@dataclass(frozen=True)
class Placeholders:
    """Tensors of one file that stand for values the file does not hold: 0-element placeholders
    where the file records the real shape (a DeepSpeed ZeRO-3 rank's ``model_states.pt``). No
    command writes, returns or compares them as weights (:meth:`refusal`)."""

    shapes: dict[str, tuple[int, ...]]  # tensor key -> the real shape the file records
    what: str  # what the file is: "a DeepSpeed ZeRO-3 rank's model states"
    where: str  # where the values are, and what to read instead (one clause)

    def refusal(self, keys: list[str]) -> str:
        """The one-line error for a command asked to use ``keys`` (placeholders) as weights."""
        shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
        return (
            f"{self.what}: {len(keys)} tensor(s) hold 0 elements standing for the real ones "
            f"({shown}); {self.where}"
        )


class Framework:
    """One framework's directory checkpoints. Subclass it in the framework's folder, and list
    the instance in :mod:`ckpttool.frameworks.registry`. Every hook but :meth:`detect` has a
    default that means "nothing of that kind"."""

    #: The framework's name ("deepspeed").
    name: str = ""
    #: ``FrameworkDirectory.kind`` values :meth:`detect` returns (how a command finds the
    #: framework of an open checkpoint from ``details["layout"]``).
    layouts: tuple[str, ...] = ()
    #: Views :meth:`open_view` offers besides the files as stored (the merged tree).
    views: tuple[str, ...] = ()
    #: The view of its directories that holds the model's tensors, declared here once: one of
    #: :attr:`views`, opened for :data:`DEFAULT_VIEW` (``convert``, ``diff``, ``trend``,
    #: ``lora``, ``ckpttool.open``, ``ckpttool.load_state_dict``); None: the merged tree of its
    #: members is the model's tensors as they are (``tests/test_default_view.py`` holds every
    #: layout to it).
    default_view: str | None = None
    #: True when :meth:`rescale` writes the rescaled directory itself; such a framework is asked
    #: before the detection order (a DeepSpeed save inside a Trainer ``checkpoint-N/``).
    rescales_itself: bool = False
    #: Temp files the framework's own writes leave when interrupted, as (glob on the path
    #: relative to a checkpoint or run directory, what left it), for ``repair`` to list.
    temp_files: tuple[tuple[str, str], ...] = ()
    #: The ``--step-key`` values its :meth:`rescale_plan` accepts (a counter rescaled only when
    #: the user names it: Lightning's ``global_step``); any other is refused before planning.
    rescale_step_keys: tuple[str, ...] = ()

    def detect(self, path: str) -> FrameworkDirectory | None:
        """1. The layout of ``path`` (a directory, or an ``*.index.json`` file) when this
        framework wrote it, with members, missing files and problems; None otherwise. Reads
        names, sizes and small JSON files only."""
        raise NotImplementedError

    def open_directory(
        self, layout: FrameworkDirectory, *, strict: bool, refuse_dangerous: bool
    ) -> Checkpoint | None:
        """3. The directory as one Checkpoint, read by the framework itself, when merging its
        members' trees is not what it holds (a set of per-rank files: each tensor assembled
        from every rank's piece); None: the door merges the members
        (:func:`ckpttool.frameworks.tree.read_directory`)."""
        return None

    def open_view(self, layout: FrameworkDirectory, view: str) -> Checkpoint | None:
        """2. ``view`` (one of :attr:`views`) of the directory ``layout`` describes, as a
        Checkpoint whose ``details["view"]`` holds its :class:`ViewFacts`; None when this
        directory has no such view (DeepSpeed ZeRO-0: nothing partitioned), and the door opens
        the files as stored."""
        return None

    def check_tree(
        self,
        layout: FrameworkDirectory,
        root: dict[str, Any],
        details: dict[str, Any],
        shard_of: dict[str, str],
    ) -> list[str]:
        """3. After the members are merged into ``root`` (``shard_of``: tensor key -> the shard
        file it was found in): add what ``show`` prints to ``details`` and return the problems
        between the files (an index naming the wrong shard, ranks that disagree)."""
        return []

    def file_placeholders(self, root: Any, path: str) -> Placeholders | None:
        """The placeholders in one file of this framework read alone (``root``, its tree;
        ``path``, its name), asked by :func:`ckpttool.frameworks.registry.file_placeholders`
        when the file's top level holds this framework's mark; None: it holds none."""
        return None

    def show_lines(self, details: dict[str, Any]) -> list[str]:
        """4. Lines ``show`` prints under the header, from the checkpoint's ``details``."""
        return []

    def show_table(self, details: dict[str, Any]) -> list[list[Any]]:
        """4. Rows (name, shape, dtype...) ``show`` prints instead of the tree's tensors, when
        the framework knows the real parameters better than the stored tensors; [] otherwise."""
        return []

    def num_parameters(self, details: dict[str, Any]) -> int | None:
        """4. The model's real parameter count when the framework knows it better than the
        stored tensors tell (ZeRO-3 stores placeholders and flat partitions); None otherwise."""
        return None

    def verify_members(
        self, ckpt: Checkpoint, progress: ProgressCallback | None
    ) -> tuple[list[str], list[str]] | None:
        """4. (problems, what was checked) of the members of a layout whose members are no
        files of their own (a zip archive's), verified by the framework; None: ``verify``
        checks each member file as a file (the default)."""
        return None

    def verified_file_by_file(self, details: dict[str, Any]) -> bool:
        """4. Whether ``verify`` of this checkpoint (its ``details``) walks its folder as a plain
        directory, each checkpoint file a verdict of its own (a folder of parts: its files are
        checkpoints of their own), rather than giving it one verdict (the default)."""
        return False

    def verify_checks(self, details: dict[str, Any]) -> list[str]:
        """4. What ``verify`` checked of the directory beyond its members and completeness, as
        the lines its report lists (the rules :meth:`check_tree` applied)."""
        return []

    def model_directory(self, details: dict[str, Any]) -> ModelDirectoryOutput | None:
        """4. How ``convert`` writes this checkpoint as the framework's model directory (None:
        it writes none)."""
        return None

    def rescale_plan(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryPlan | None:
        """4. What ``rescale-step`` does to each file of the directory, without writing (the
        command writes the directory all-or-nothing); None: this layout is not rescaled."""
        return None

    def rescale(
        self, path: Path, layout: FrameworkDirectory, request: RescaleRequest
    ) -> DirectoryRescaleReport:
        """4. For :attr:`rescales_itself`: rescale and write the directory."""
        raise NotImplementedError

    def edit_leaves_out(
        self, layout: FrameworkDirectory, *, for_inference: bool
    ) -> tuple[str, ...]:
        """4. ``edit`` of the directory ``layout``: the members it leaves out (names relative
        to the directory; with ``for_inference``, what only resuming training reads). The
        command edits the weights members with the file operations, copies every other member
        byte for byte and rebuilds the index. Raises a :class:`~ckpttool.errors.CkptError`
        saying why when this framework's directory cannot be edited that way (the default)."""
        raise InputError(
            f"edit does not rewrite a {layout.title}; give one of its files, or convert it"
        )

    def rebuild_index(self, directory: str, *, keep_lost: bool = True) -> IndexRepair | None:
        """``repair``: the weights index of ``directory`` rebuilt from its shards' headers, when
        it holds this framework's sharded weights (with or without an index); None otherwise.
        ``keep_lost``: tensors the old index names and no shard holds stay named (repair: the
        index is their only record); False drops them (``edit``: dropped or renamed on
        purpose, the shards are the truth).
        Raises a :class:`~ckpttool.errors.CkptError` when the shards cannot be reconciled (one
        tensor stored twice with different bytes). Writes nothing."""
        return None

    def run_layout(self, directory: str) -> RunLayout | None:
        """``repair``: the checkpoints of the run directory ``directory`` (a Trainer
        ``output_dir``, a DeepSpeed save directory) in the order resume sees them, and its
        pointer; None when ``directory`` is no run directory of this framework. Writes
        nothing."""
        return None
