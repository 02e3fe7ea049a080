"""``edit`` of a framework's directory (a Hugging Face model directory, a Trainer
``checkpoint-N/``, an accelerate ``save_state`` folder), and :func:`edit`, the entry point for a
file or a directory. A framework directory: the members its framework leaves out for the edit
(``--for-inference``: the optimizer, scheduler, RNG states...) left out, every weights file
edited in its own format
(:func:`ckpttool.commands.edit.edit_file`), the index rebuilt from the written shards, the
other files (config, tokenizer...) copied byte for byte, ``config.json``'s dtype (and FP8
``quantization_config``) brought in line with a ``--dtype``; all written to a staged directory
that becomes the output whole, or nothing.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

from ckpttool.commands.edit import EditReport, edit_file
from ckpttool.commands.edit_format_directory import edit_format_directory, lead_staged
from ckpttool.errors import CkptError, InputError, OutputExistsError, name_file
from ckpttool.formats.registry import directory_formats
from ckpttool.frameworks.base import INDEX, MODEL_CONFIG, OPTIMIZER, WEIGHTS, config_with_dtype
from ckpttool.frameworks.registry import detect_before_format, detect_directory, framework_of
from ckpttool.io import units
from ckpttool.io.parallel import chosen, ordered_map, using
from ckpttool.model import edits


def edit(
    src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, **options: Any
) -> EditReport:
    """``edit``'s entry point: the checkpoint file ``src``
    (:func:`~ckpttool.commands.edit.edit_file`), a directory format's checkpoint
    (:func:`~ckpttool.commands.edit_format_directory.edit_format_directory`: DCP) or the
    Hugging Face model directory ``src`` (:func:`edit_directory`)."""
    if Path(src).is_dir():
        fmt = next((f for f in directory_formats() if f.recognises_directory(src)), None)
        # a framework's directory over the format (Lightning sharded, torchtitan, Megatron
        # torch_dist) is the framework's to edit or refuse: as the format's, its merged tree's
        # keys are no keys of the format's files (nothing cast, or a key "not a tensor")
        if fmt is not None and detect_before_format(str(src)) is None:
            # under torchrun: its data files shared by the ranks
            return edit_format_directory(src, dst, fmt, **options)
        if options.get("dry_run"):
            units.lead_only()
        return edit_directory(src, dst, **options)
    return edit_file(src, dst, **options)  # under torchrun: its casts shared by the ranks


def default_output(src: Path) -> Path:
    """``NAME.edited`` beside the directory ``src`` (``.``: the working directory's name)."""
    named = src if src.name else src.resolve()
    if not named.name:
        raise InputError(f"{src}: has no name to derive an output's from; name an output")
    return named.with_name(f"{named.name}.edited")


def edit_directory(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    in_place: bool = False,
    backup: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    **operations: Any,
) -> EditReport:
    """Edit the framework directory ``src`` (a Hugging Face model directory, a Trainer
    ``checkpoint-N/``, an accelerate ``save_state`` folder) into ``dst`` (default
    :func:`default_output`; ``in_place``: ``src`` itself, replaced whole). The framework says
    which members the edit leaves out (:meth:`~ckpttool.frameworks.base.Framework.edit_leaves_out`:
    ``--for-inference``'s preset for its layout); ``operations`` are
    :func:`~ckpttool.commands.edit.edit_file`'s, applied to each weights file on its own (a
    ``--map`` rule must find all its sources in one file)."""
    source = Path(src)
    output = source if in_place else Path(dst) if dst is not None else default_output(source)
    try:
        if backup:
            raise InputError("backup applies to files; a directory is replaced whole or kept")
        if in_place and dst is not None:
            raise InputError("give an output or in_place, not both")
        if operations.get("use_ema") is not None:
            raise InputError("--use-ema applies to a file that keeps an EMA beside its model")
        layout = detect_directory(str(source))
        framework = framework_of(layout.kind) if layout is not None else None
        if layout is None or framework is None:
            raise InputError(
                "edit rewrites a Hugging Face model directory, a Trainer checkpoint-N/, an "
                "accelerate save_state folder, a torch.distributed.checkpoint directory or "
                "one checkpoint file; not this directory"
            )
        leave_out = framework.edit_leaves_out(
            layout, for_inference=bool(operations.get("for_inference"))
        )
        if not in_place and output.exists() and not dry_run:
            if output.resolve() == source.resolve():
                raise InputError(f"the output {output} is the source: pass in_place to edit it")
            if not overwrite:
                raise OutputExistsError(f"{output} already exists (pass overwrite=True)")
        weights = [m.name for m in layout.members if m.role == WEIGHTS]
        index = next((m.name for m in layout.members if m.role == INDEX), None)
        if operations.get("cast_optimizer"):
            if operations.get("dtype") is None:
                raise InputError("--cast-optimizer goes with --dtype")
            # the optimizer's files cast as a file's optimizer part is: the same option, the
            # same tensors (its step counters never)
            casts = {k: operations.get(k) for k in _CAST_OPTIONS if k in operations}
            optimizers = [
                m.name for m in layout.members if m.role == OPTIMIZER and m.name not in leave_out
            ]
            weights += optimizers
            operations = {**operations, "only_cast": {name: casts for name in optimizers}}
        kept = _optimizer_state_kept(source, layout.members, leave_out, operations)
        reports: list[EditReport] = []
        if dry_run:
            with using(chosen() or 1):
                reports = ordered_map(
                    lambda name: edit_file(
                        source / name,
                        dry_run=True,
                        require_matches=False,
                        **_member_operations(operations, name),
                    ),
                    weights,
                )
            _refuse_unmatched_in_all(reports, weights, operations)
            return _combined(source, output, layout.kind, reports, leave_out, False, True, kept)
        # under torchrun, the weights files are shared by the ranks, each written into rank
        # 0's staging directory; rank 0 alone does the rest
        with lead_staged(output) as stage:
            sizes = [(source / name).stat().st_size for name in weights]
            edit_one = functools.partial(_edit_member, source, stage, operations)
            # --jobs: N weights files rewritten at once (each into its own staged name; memory
            # N times one file's edit, so 1 unless asked), the reports in the members' order
            with using(chosen() or 1):
                reports = units.shared_map(edit_one, weights, sizes)
            _refuse_unmatched_in_all(reports, weights, operations)
            units.lead_only()
            if not leave_out and not any(r.changed for r in reports):
                raise _Unchanged
            for path in sorted(source.rglob("*")):
                name = path.relative_to(source).as_posix()
                if path.is_dir() or name in weights or name in leave_out:
                    continue
                (stage / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, stage / name)
            _config_dtype(stage / MODEL_CONFIG, reports)
            if index is not None:
                rebuilt = framework.rebuild_index(str(stage), keep_lost=False)
                if rebuilt is not None and rebuilt.content is not None:
                    (stage / rebuilt.index).write_bytes(rebuilt.content)
    except _Unchanged:
        assert layout is not None
        return _combined(source, output, layout.kind, reports, leave_out, False, False, kept)
    except CkptError as error:
        raise name_file(error, str(source)) from None
    return _combined(source, output, layout.kind, reports, leave_out, True, False, kept)


#: The options of ``edit_file`` that an optimizer's file gets with ``--cast-optimizer``.
_CAST_OPTIONS = ("dtype", "keep_dtype", "allow_overflow", "cast_optimizer")


def _edit_member(source: Path, stage: Path, operations: dict[str, Any], name: str) -> EditReport:
    """One weights file (or, ``--cast-optimizer``, optimizer file: ``only_cast``) edited into
    ``stage`` (copied as it is when nothing in it changes)."""
    target = stage / name
    target.parent.mkdir(parents=True, exist_ok=True)
    report = edit_file(
        source / name,
        target,
        overwrite=True,
        require_matches=False,
        **_member_operations(operations, name),
    )
    if not report.written:
        shutil.copyfile(source / name, target)  # nothing changed in this file
    return report


def _optimizer_state_kept(
    source: Path, members: Any, leave_out: tuple[str, ...], operations: dict[str, Any]
) -> tuple[str, ...]:
    """With ``--dtype`` and no ``--cast-optimizer``: the floating tensors of the directory's
    optimizer files, which stay as saved (the file is copied), reported as a file's optimizer
    state is (``not_cast``): one option, one report, on a file and on a folder."""
    if operations.get("dtype") is None or operations.get("cast_optimizer"):
        return ()
    names = [m.name for m in members if m.role == OPTIMIZER and m.name not in leave_out]
    options = {k: operations[k] for k in ("dtype", "keep_dtype") if k in operations}
    return tuple(
        key for name in names for key in edit_file(source / name, dry_run=True, **options).not_cast
    )


def _member_operations(operations: dict[str, Any], name: str) -> dict[str, Any]:
    """The operations for the member file ``name``: an optimizer's file (``only_cast``) is
    cast only."""
    only_cast = operations.get("only_cast") or {}
    if name in only_cast:
        return dict(only_cast[name])
    return {k: v for k, v in operations.items() if k != "only_cast"}


def _refuse_unmatched_in_all(
    reports: list[EditReport], names: list[str], operations: dict[str, Any]
) -> None:
    """A pattern is checked against the whole directory: one that no weights file matched (an
    optimizer file that ``--cast-optimizer`` only casts is matched against no pattern)."""
    only_cast = operations.get("only_cast") or {}
    matched = [r for r, name in zip(reports, names) if name not in only_cast]
    if matched:
        everywhere = set.intersection(*(set(r.unmatched) for r in matched))
        edits.refuse_unmatched([u for u in matched[0].unmatched if u in everywhere])


class _Unchanged(Exception):
    """Nothing to change: the staged directory is dropped, the output not made."""


def _config_dtype(config: Path, reports: list[EditReport]) -> None:
    """``config.json`` saying the dtype the weights were cast to, without an FP8
    ``quantization_config`` once its weights are dequantized."""
    dtypes = {r.dtype for r in reports if r.cast and r.dtype}
    if not config.is_file() or not dtypes:
        return
    (dtype,) = dtypes
    scales = any(d.endswith(("_scale_inv", "_scale")) for r in reports for d in r.dropped)
    config_with_dtype(config, dtype, dequantized=scales)


def _combined(
    source: Path,
    output: Path,
    layout: str,
    reports: list[EditReport],
    files_dropped: tuple[str, ...],
    written: bool,
    dry_run: bool,
    not_cast: tuple[str, ...] = (),
) -> EditReport:
    def joined(field: str) -> tuple[Any, ...]:
        return tuple(item for r in reports for item in getattr(r, field))

    rules: dict[str, int] = {}
    for report in reports:
        for rule, count in report.rules:
            rules[rule] = rules.get(rule, 0) + count
    return EditReport(
        source=str(source),
        output=str(output),
        format="directory",
        layout=layout,
        dropped=joined("dropped"),
        files_dropped=files_dropped,
        renamed=joined("renamed"),
        rules=tuple(rules.items()),
        tensors_before=sum(r.tensors_before for r in reports),
        tensors_after=sum(r.tensors_after for r in reports),
        bytes_before=sum(r.bytes_before for r in reports),
        bytes_after=sum(r.bytes_after for r in reports),
        written=written,
        compacted=joined("compacted"),
        cast=joined("cast"),
        dtype=next((r.dtype for r in reports if r.dtype), None),
        not_cast=joined("not_cast") + not_cast,
        underflow=joined("underflow"),
        mapped=joined("mapped"),
        dry_run=dry_run,
    )
