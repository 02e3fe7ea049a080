"""DeepSpeed ZeRO checkpoints: a save directory (with ``latest``) or one tag directory.

File names are DeepSpeed's own (``deepspeed/runtime/engine.py`` ``_get_ckpt_name``,
``_get_zero_ckpt_name``; ``deepspeed/checkpoint/constants.py``). ``engine.save_checkpoint(dir)``
writes, in ``dir/<tag>/`` (tag ``global_step<N>`` by default):

- ZeRO 0-2: ``mp_rank_{mp:02d}_model_states.pt``, written by data-parallel rank 0 only: the
  module's full weights (``module``), ``param_shapes``, ``frozen_param_shapes``,
  ``shared_params``, ``buffer_names``, the counters (``global_steps``, ``global_samples``,
  ``skipped_steps``), ``lr_scheduler``, ``dp_world_size``, ``mp_world_size``, ``ds_config``.
  Under ZeRO-0 the optimizer's state is inside it (``optimizer``).
- ZeRO-3: ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``, one per data-parallel rank;
  ``module`` holds a 0-element placeholder for every partitioned parameter (the real shapes are
  in ``param_shapes``).
- ZeRO 1-3: ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``, one per data-parallel
  rank (``bf16_`` when bf16 is enabled): the rank's flat fp32 partition
  (``single_partition_of_fp32_groups`` for ZeRO-1/2, ``fp32_flat_groups`` for ZeRO-3), the
  base optimizer's state for it, ``zero_stage``, ``partition_count``, ``group_paddings``.

Then rank 0 writes ``dir/latest`` (the tag's name), after every rank saved, and copies
``zero_to_fp32.py`` next to it. The pickles name DeepSpeed classes that are plain data records
(``LossScaler``, ``ZeroStageEnum``, ``fragment_address``); the reader keeps them as named
records and never imports DeepSpeed (:func:`record_value` reads them as plain values).

:func:`zero_files` finds the files of one tag; :func:`detect` gives the directory layout every
command reads (local, or a URL of a store that lists: names come from :mod:`ckpttool.io.source`); :mod:`ckpttool.frameworks.deepspeed.checks` turns the merged tree into what
``show`` prints and the consistency problems ``verify`` reports.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import CkptError, InputError
from ckpttool.frameworks.base import OTHER, FrameworkDirectory, Member, RunLayout, list_files
from ckpttool.io.source import (
    can_list,
    is_dir,
    is_url,
    join,
    list_dirs,
    list_names,
    member_sizes,
    read_head,
)
from ckpttool.model.records import OpaqueObject

DEEPSPEED = "deepspeed"
TITLE = "DeepSpeed checkpoint"
LATEST = "latest"
#: Roles of a DeepSpeed directory's files.
MODEL_STATES = "model_states"
OPTIM_STATES = "optimizer_states"
LATEST_ROLE = "latest"
SCRIPT = "script"
#: ``zero_pp_rank_{dp}_mp_rank_{mp}_model_states.pt`` (ZeRO-3) or ``mp_rank_{mp}_model_states.pt``
MODEL_STATES_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
#: ``{bf16_,fp16_,}zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt``
OPTIM_STATES_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: What DeepSpeed copies next to ``latest``: its consolidation scripts.
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
#: ``latest`` holds a tag name: a few bytes; more is not a DeepSpeed ``latest``.
MAX_LATEST_BYTES = 4096
#: Classes DeepSpeed pickles that are plain data records (read without importing DeepSpeed).
LOSS_SCALERS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"
DATA_RECORDS = frozenset({*LOSS_SCALERS, ZERO_STAGE_ENUM, FRAGMENT_ADDRESS})
DTYPE_PREFIXES = {"bf16_": "bf16", "fp16_": "fp16"}


@dataclass(frozen=True)
class ZeroFiles:
    """The files of one DeepSpeed tag directory, by (model-parallel rank, data-parallel rank)."""

    save_dir: str | None  # the directory holding ``latest``, if any
    tag: str  # "global_step4"
    tag_dir: str
    #: (mp, dp) -> path; ZeRO 0-2 write only dp 0's ``mp_rank_XX_model_states.pt``
    model_states: dict[tuple[int, int], str]
    #: (mp, dp) -> path of ``{bf16_,fp16_,}zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt``
    optim_states: dict[tuple[int, int], str]
    latest: str | None = None  # what ``latest`` names (None: no ``latest`` file)
    tags: tuple[str, ...] = ()  # the tag directories of the save directory, oldest first
    partitioned_model_states: bool = False  # ZeRO-3's per-rank model-states names
    optim_prefix: str = ""  # "", "bf16_" or "fp16_"
    sizes: dict[str, int] = field(default_factory=dict)  # path -> bytes
    other: tuple[str, ...] = ()  # other files of the tag directory (listed, not read)

    @property
    def dtype_hint(self) -> str | None:
        """ "bf16"/"fp16" from the optimizer files' prefix; None without one (fp32, or ZeRO-0)."""
        return DTYPE_PREFIXES.get(self.optim_prefix)


def _is_tag_dir(path: str) -> bool:
    try:
        names = list_names(path) if is_url(path) else os.listdir(path)
    except OSError:
        return False
    except CkptError as error:  # a URL: a missing prefix is no tag; a network fault is reported
        if "no such file" in str(error):
            return False
        raise
    return any(MODEL_STATES_FILE.match(n) or OPTIM_STATES_FILE.match(n) for n in names)


def _step_order(tag: str) -> tuple[int, int, str]:
    digits = re.findall(r"\d+", tag)
    return (0, int(digits[-1]), tag) if digits else (1, 0, tag)


def _tags(save_dir: str) -> list[str]:
    """The tag directories of a save directory, oldest first (by the step in their names)."""
    try:
        names = list_dirs(save_dir)
    except OSError as error:
        raise InputError(f"{save_dir}: cannot list ({error.strerror})") from None
    found = [name for name in names if _is_tag_dir(join(save_dir, name))]
    return sorted(found, key=_step_order)


def _has_file(directory: str, name: str) -> bool:
    """Whether ``directory/name`` is a file (a URL's: whether its store lists it)."""
    return bool(member_sizes(directory, [name]))


def _split(path: str) -> tuple[str, str]:
    """``(parent, name)`` of a directory, local (made absolute) or a URL (a final ``/`` dropped)."""
    if is_url(path):
        parent, _, name = path.rstrip("/").rpartition("/")
        return parent, name
    absolute = os.path.abspath(path)
    return os.path.dirname(absolute), os.path.basename(absolute)


def _same_dir(a: str, b: str) -> bool:
    if is_url(a):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def read_latest(save_dir: str) -> str:
    """The tag ``save_dir/latest`` names, checked to be one directory name inside it."""
    path = join(save_dir, LATEST)
    try:
        data = read_head(path, MAX_LATEST_BYTES + 1)
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    if len(data) > MAX_LATEST_BYTES:
        raise InputError(f"{path}: {len(data)}+ bytes, not a DeepSpeed 'latest' file (a tag name)")
    tag = data.decode("utf-8", errors="replace").strip()
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\x00" in tag:
        raise InputError(f"{path}: names {tag!r}, not a tag directory inside {save_dir}")
    return tag


@dataclass
class _Scan:
    """A save or tag directory as found on disk, with what is wrong with it (not raised)."""

    files: ZeroFiles | None
    problems: list[str]
    missing: list[str]


def _scan(path: str) -> _Scan | None:
    """None when ``path`` is no DeepSpeed directory; else its files and its problems. A URL's
    store must list (the tags and the ranks' files are found in its listing): over HTTP,
    None, and the reader says why."""
    if not can_list(path) or not is_dir(path):
        return None
    if _is_tag_dir(path):
        parent, tag = _split(path)
        save_dir = parent if _has_file(parent, LATEST) else None
        return _Scan(_tag_files(path, tag, save_dir), [], [])
    has_latest = _has_file(path, LATEST)
    tags = _tags(path)
    if not has_latest and not tags:
        return None
    problems: list[str] = []
    missing: list[str] = []
    latest: str | None = None
    chosen: str | None = None
    if has_latest:
        latest = read_latest(path)
        if latest in tags:
            chosen = latest
        else:
            where = join(path, latest)
            what = "is not a tag directory" if is_dir(where) else "does not exist"
            problems.append(
                f"{LATEST}: names tag {latest!r}, which {what} "
                f"(tags here: {', '.join(tags) or 'none'})"
            )
    else:
        missing.append(LATEST)
    if chosen is None and tags:
        chosen = tags[-1]  # the newest by step: what a user most likely means
    if chosen is None:
        return _Scan(None, problems, missing)
    files = _tag_files(join(path, chosen), chosen, path, latest=latest, tags=tuple(tags))
    return _Scan(files, problems, missing)


def _tag_files(
    tag_dir: str,
    tag: str,
    save_dir: str | None,
    *,
    latest: str | None = None,
    tags: tuple[str, ...] = (),
) -> ZeroFiles:
    model: dict[tuple[int, int], str] = {}
    optim: dict[tuple[int, int], str] = {}
    prefixes: set[str] = set()
    partitioned = False
    other: list[str] = []
    files = list_files(tag_dir)
    for name in files:
        path = join(tag_dir, name)
        if match := MODEL_STATES_FILE.match(name):
            dp = int(match.group(1)) if match.group(1) is not None else 0
            partitioned = partitioned or match.group(1) is not None
            model[(int(match.group(2)), dp)] = path
        elif match := OPTIM_STATES_FILE.match(name):
            prefixes.add(match.group(1) or "")
            optim[(int(match.group(3)), int(match.group(2)))] = path
        else:
            other.append(name)
    if save_dir is not None and latest is None and _has_file(save_dir, LATEST):
        try:
            latest = read_latest(save_dir)
        except InputError:
            latest = None
    return ZeroFiles(
        save_dir=save_dir,
        tag=tag,
        tag_dir=tag_dir,
        model_states=dict(sorted(model.items())),
        optim_states=dict(sorted(optim.items())),
        latest=latest,
        tags=tags,
        partitioned_model_states=partitioned,
        optim_prefix=sorted(prefixes)[0] if len(prefixes) == 1 else "",
        sizes={join(tag_dir, name): size for name, size in files.items()},
        other=tuple(other),
    )


def zero_files(path: str | os.PathLike[str], found: object = None) -> ZeroFiles:
    """The files of the DeepSpeed checkpoint at ``path``: a save directory (the tag its
    ``latest`` names) or one tag directory. Raises :class:`~ckpttool.errors.InputError` with a
    message naming what to do when ``path`` is neither, ``latest`` is missing or names no tag,
    or the tag has no model-states file. ``found``: what :func:`detect` found (``layout.found``),
    so that the directory is not listed again."""
    path = os.fspath(path)
    scan = found if isinstance(found, _Scan) else _scan(path)
    if scan is None:
        raise InputError(
            f"{path}: not a DeepSpeed checkpoint (no 'latest' file, no global_step*/ directory, "
            "no *_model_states.pt / *_optim_states.pt files)"
        )
    if scan.problems:
        raise InputError(f"{path}: {scan.problems[0]}")
    files = scan.files
    if files is None or LATEST in scan.missing:
        tags = files.tags if files is not None else ()
        raise InputError(
            f"{path}: no 'latest' file (DeepSpeed writes it last, after every rank saved: the "
            f"save may not have finished); name a tag directory, e.g. "
            f"{join(path, tags[-1]) if tags else '<save_dir>/global_stepN'}"
        )
    if not files.model_states:
        raise InputError(
            f"{files.tag_dir}: no *_model_states.pt file (an incomplete save?); "
            "ckpttool verify lists what is missing"
        )
    return files


def run_layout(path: str) -> RunLayout | None:
    """A local save directory (``latest`` and/or tag directories; not one tag directory) as
    ``repair`` sees it: the tags oldest first, and what ``latest`` names. ``load_checkpoint``
    with ``tag=None`` loads the tag ``latest`` names and nothing else, so nothing is moved
    aside: ``latest`` is what repair rewrites."""
    if is_url(path) or not os.path.isdir(path) or _is_tag_dir(path):
        return None
    has_latest = os.path.isfile(join(path, LATEST))
    tags = _tags(path)
    if not has_latest and not tags:
        return None
    pointed: str | None = None
    problem = ""
    if has_latest:
        try:
            pointed = read_latest(path)
        except InputError as error:
            problem = str(error).removeprefix(f"{join(path, LATEST)}: ")
    return RunLayout(
        title=f"{TITLE} save directory",
        checkpoints=tuple(tags),
        pointer=LATEST,
        pointed=pointed,
        pointer_problem=problem,
    )


# ------------------------------------------------------------------------------- the layout


def detect(path: str) -> FrameworkDirectory | None:
    """A DeepSpeed save directory or tag directory as a :class:`FrameworkDirectory`, or None."""
    scan = _scan(path)
    if scan is None:
        return None
    layout = FrameworkDirectory(kind=DEEPSPEED, title=TITLE, directory=path, members=[], found=scan)
    layout.problems += scan.problems
    layout.missing += scan.missing
    files = scan.files
    in_save_dir = files is not None and not _same_dir(path, files.tag_dir)
    if in_save_dir:  # ``latest`` and DeepSpeed's scripts, beside the tags
        for name, size in list_files(path).items():
            role = LATEST_ROLE if name == LATEST else SCRIPT if name in SCRIPTS else OTHER
            layout.members.append(Member(name, role, None, size))
    if files is None:
        layout.complete = False
        return layout
    prefix = f"{files.tag}/" if in_save_dir else ""
    mp_ranks = sorted({mp for mp, _ in [*files.model_states, *files.optim_states]})
    many_mp = mp_ranks not in ([], [0])
    for (mp, dp), file in files.model_states.items():
        part = f"{MODEL_STATES}_mp{mp:02d}" if many_mp and mp else MODEL_STATES
        section = f"{part}.rank{dp}" if files.partitioned_model_states else part
        layout.members.append(_member(file, prefix, MODEL_STATES, section, files, dp))
    for (mp, dp), file in files.optim_states.items():
        part = f"{OPTIM_STATES}_mp{mp:02d}" if many_mp and mp else OPTIM_STATES
        layout.members.append(_member(file, prefix, OPTIM_STATES, f"{part}.rank{dp}", files, dp))
    layout.members += [
        Member(prefix + name, OTHER, None, files.sizes[join(files.tag_dir, name)])
        for name in files.other
    ]
    if not files.model_states:
        layout.missing.append(f"{prefix}*_model_states.pt")
    empty = [
        m.name for m in layout.members if m.role in (MODEL_STATES, OPTIM_STATES) and not m.size
    ]
    layout.problems += [
        f"{name}: incomplete: the file is empty (0 bytes; an interrupted save?)" for name in empty
    ]
    layout.details["tag"] = files.tag
    if files.tags:
        layout.details["tags"] = list(files.tags)
    if files.latest is not None:
        layout.details["latest"] = files.latest
    layout.complete = not layout.missing and not layout.problems
    return layout


def _member(file: str, prefix: str, role: str, section: str, files: ZeroFiles, dp: int) -> Member:
    size = files.sizes.get(file, 0)
    # an empty file is listed, not read: the reader would stop at it; the problem names it
    return Member(prefix + os.path.basename(file), role, section if size else None, size, rank=dp)


def record_value(value: Any) -> Any:
    """A DeepSpeed data record as plain data: ``ZeroStageEnum(2)`` -> 2, a ``LossScaler`` ->
    the dict of its attributes, a ``fragment_address`` -> ``{"numel", "start"}``; anything
    else unchanged (lists and dicts converted inside)."""
    if isinstance(value, OpaqueObject):
        if value.cls == ZERO_STAGE_ENUM and isinstance(value.args, tuple) and value.args:
            return value.args[0]
        if value.cls in DATA_RECORDS and isinstance(value.state, dict):
            return {str(k): record_value(v) for k, v in value.state.items()}
        return value
    if isinstance(value, dict):
        return {k: record_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [record_value(v) for v in value]
    return value
