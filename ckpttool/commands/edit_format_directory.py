"""``edit`` of a directory format's checkpoint (one checkpoint in several files, recognised by
an index file: torch.distributed.checkpoint's ``.metadata``): the tree read through the door,
edited (:mod:`ckpttool.model.edits`), written back in the same format by the format's
:meth:`~ckpttool.formats.base.FileFormat.rewrite_directory` into a staged directory, read back
and compared tensor by tensor with what the edit asked for, and only then put in place.

The operations that keep each tensor's elements (``--for-inference``, ``--drop``, ``--keep``,
``--rename``) and the elementwise ``--dtype`` apply; ``--use-ema``, ``--map`` and ``--compact``
are refused (a stored piece of a tensor is only that piece's bytes: nothing to compact).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.edit import EditReport
from ckpttool.errors import CkptError, InputError, OutputExistsError, ReadBackError, name_file
from ckpttool.formats.base import FileFormat
from ckpttool.io import units
from ckpttool.io.atomic import staged_directory
from ckpttool.io.parallel import chosen, using
from ckpttool.model import edits
from ckpttool.model.cast import CASTABLE, TARGETS, cast_array
from ckpttool.model.records import ChunkedStorageRecord, TensorRecord, walk
from ckpttool.model.roles import detect_layout

#: Operations that move or rebuild tensors, which a directory format's rewrite does not do.
_REFUSED = {"use_ema": "--use-ema", "map_name": "--map", "compact": "--compact"}


def edit_format_directory(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None,
    fmt: FileFormat,
    *,
    drop: list[str] | tuple[str, ...] = (),
    keep: list[str] | tuple[str, ...] = (),
    rename: list[str] | tuple[str, ...] = (),
    for_inference: bool = False,
    dtype: str | None = None,
    keep_dtype: list[str] | tuple[str, ...] = (),
    allow_overflow: bool = False,
    cast_optimizer: bool = False,
    in_place: bool = False,
    backup: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    **others: Any,
) -> EditReport:
    """Edit the checkpoint directory ``src`` of the directory format ``fmt`` into ``dst``
    (default ``NAME.edited`` beside it; ``in_place``: ``src`` itself, replaced whole)."""
    source = Path(src)
    output = (
        source
        if in_place
        else Path(dst)
        if dst is not None
        else source.resolve().with_name(f"{source.resolve().name}.edited")
        if not source.name  # ".": the working directory's name
        else source.with_name(f"{source.name}.edited")
    )
    try:
        if backup:
            raise InputError("backup applies to files; a directory is replaced whole or kept")
        if in_place and dst is not None:
            raise InputError("give an output or in_place, not both")
        for name, flag in _REFUSED.items():
            if others.get(name) not in (None, False, {}, ()):
                raise InputError(
                    f"{flag} does not apply to a {fmt.directory_title} directory (edit keeps "
                    "each stored piece of a tensor as it is, or casts it)"
                )
        if not in_place and output.exists() and not dry_run:
            if output.resolve() == source.resolve():
                raise InputError(f"the output {output} is the source: pass in_place to edit it")
            if not overwrite:
                raise OutputExistsError(f"{output} already exists (pass overwrite=True)")
        with open_checkpoint(source) as ckpt:
            layout = detect_layout(ckpt.root, ckpt.format)
            log = edits.EditLog()
            before = _tensors(ckpt.root)
            root = ckpt.root
            if for_inference:
                root = edits.drop(root, edits.inference_drops(root, layout), log)
            root = edits.drop(root, list(drop), log)
            root = edits.keep(root, list(keep), log)
            root = edits.rename(root, list(rename), log)
            edits.refuse_unmatched(log.unmatched)
            after = _tensors(root)
            if cast_optimizer and dtype is None:
                raise InputError("--cast-optimizer goes with --dtype")
            castable = edits.cast_scope(root, optimizer=cast_optimizer)
            underflow: dict[str, int] = {}
            casts = _casts(after, dtype, list(keep_dtype), allow_overflow, log, castable, underflow)
            changed = bool(log.dropped or log.renamed or log.cast)
            write = changed and not dry_run
            ranks = units.sharing()
            if ranks is not None and not write:
                units.lead_only()
            if write:
                # under torchrun the data files are shared by the ranks (--jobs: by threads),
                # each written into rank 0's staging directory; rank 0 alone does the rest
                with lead_staged(output) as stage:
                    with using(chosen() or 1):
                        fmt.rewrite_directory(source, root, stage, casts)
                    units.lead_only()
                    # the read-back casts every piece again, on rank 0: its counts are whole
                    underflow.clear()
                    _read_back(ckpt, stage, root, after, casts)
    except CkptError as error:
        raise name_file(error, str(source)) from None
    target = TARGETS.get(dtype, dtype) if dtype else None
    return EditReport(
        source=str(source),
        output=str(output),
        format=ckpt.format,
        layout=layout,
        dropped=tuple(log.dropped),
        renamed=tuple(log.renamed),
        rules=tuple(zip(rename, log.rule_counts)),
        cast=tuple(log.cast),
        dtype=target if log.cast else None,
        not_cast=tuple(log.not_cast),
        underflow=tuple((key, underflow[key]) for key in log.cast if underflow.get(key)),
        dry_run=dry_run,
        tensors_before=len(before),
        tensors_after=len(after),
        bytes_before=sum(r.nbytes for r in before.values()),
        bytes_after=sum(
            r.numel * _itemsize(casts[k][0]) if k in casts else r.nbytes for k, r in after.items()
        ),
        written=write,
    )


@contextlib.contextmanager
def lead_staged(output: Path) -> Iterator[Path]:
    """A staged replacement of the directory ``output``, made by rank 0 under torchrun (or by
    the one process), and its path on every rank: each rank writes its share into it; when the
    block ends, rank 0 alone puts it in place (or drops it, on an error)."""
    ranks = units.sharing()
    staged = (
        staged_directory(output, replace_existing=True, parent=output.parent)
        if ranks is None or ranks.leads
        else contextlib.nullcontext(None)
    )
    with staged as lead_stage:
        yield Path(units.from_lead(str(lead_stage)))


def _itemsize(dtype: str) -> int:
    from ckpttool.model.records import ITEMSIZE

    return ITEMSIZE[dtype]


def _tensors(root: Any) -> dict[str, TensorRecord]:
    """The tree's stored tensors by key (not those inside a value)."""
    return {
        key: record
        for key, record in walk(root)
        if isinstance(record, TensorRecord) and isinstance(record.storage, ChunkedStorageRecord)
    }


def _values(root: Any) -> dict[str, Any]:
    """The tree's leaves that are not stored tensors, by key."""
    return {
        key: leaf
        for key, leaf in walk(root)
        if not (isinstance(leaf, TensorRecord) and isinstance(leaf.storage, ChunkedStorageRecord))
    }


def _casts(
    tensors: dict[str, TensorRecord],
    dtype: str | None,
    keep: list[str],
    allow_overflow: bool,
    log: edits.EditLog,
    castable: Callable[[str], bool],
    underflow: dict[str, int],
) -> dict[str, tuple[str, Callable[[Any], bytes]]]:
    """The tensors ``--dtype`` casts (floating, not already ``dtype``, matching no ``keep``
    pattern, ``castable``: not an optimizer's state or a counter,
    :func:`~ckpttool.model.edits.cast_scope`), each with the function that casts a piece of
    it and adds the piece's values that became 0 to ``underflow``."""
    if dtype is None:
        return {}
    target = TARGETS.get(dtype, dtype)
    if target not in CASTABLE:
        raise InputError(f"--dtype {dtype}: expected one of {', '.join(TARGETS)}")
    casts = {}
    lock = threading.Lock()  # --jobs: pieces cast on several threads
    for key, record in tensors.items():
        if (
            record.dtype not in CASTABLE
            or record.dtype == target
            or any(fnmatchcase(key, pattern) for pattern in keep)
        ):
            continue
        if not castable(key):
            log.not_cast.append(key)
            continue
        casts[key] = (target, _caster(key, record.dtype, target, allow_overflow, underflow, lock))
        log.cast.append(key)
    return casts


def _caster(
    key: str,
    source: str,
    target: str,
    allow_overflow: bool,
    underflow: dict[str, int],
    lock: threading.Lock,
) -> Callable[[Any], bytes]:
    def cast(values: Any) -> bytes:
        import numpy as np

        out, counts = cast_array(np.ascontiguousarray(values), source, target)
        if counts.underflow:
            with lock:
                underflow[key] = underflow.get(key, 0) + counts.underflow
        if counts.overflow and not allow_overflow:
            raise InputError(
                f"--dtype: {counts.overflow:,} finite value(s) of {key!r} (largest "
                f"{counts.max_abs:g}) do not fit in {target}: pass --allow-overflow to write "
                "them as inf, or --keep-dtype to leave that tensor alone"
            )
        return out.tobytes()

    return cast


#: Values compared on read-back (others, such as pickled objects, are checked by being read).
_PLAIN = (int, float, str, bytes, bool, type(None))


def _read_back(
    ckpt: Any,
    stage: Path,
    root: Any,
    expected: dict[str, TensorRecord],
    casts: dict[str, tuple[str, Callable[[Any], bytes]]],
) -> None:
    """Open the written directory as any reader would and compare every tensor with its
    source's values (cast as asked, from the whole source tensor), and every plain value: a
    difference, a missing or an extra entry raises :class:`~ckpttool.errors.ReadBackError`
    (the staged directory is then dropped)."""
    import numpy as np

    from ckpttool.model.cast import stored_dtype

    with open_checkpoint(stage) as written:
        values = _values(root)
        found_values = _values(written.root)
        if set(values) != set(found_values) or any(
            isinstance(value, _PLAIN) and found_values[key] != value
            for key, value in values.items()
        ):
            raise ReadBackError(
                "the written directory's values differ from the edit's: nothing was replaced"
            )
        found = _tensors(written.root)
        if set(found) != set(expected):
            missing = sorted(set(expected) - set(found))[:3]
            extra = sorted(set(found) - set(expected))[:3]
            raise ReadBackError(
                f"the written directory holds other tensors than the edit made (missing "
                f"{missing}, extra {extra}): nothing was replaced"
            )
        for key, record in expected.items():
            data, _ = ckpt.read_bytes(record)
            if key in casts:
                target, cast = casts[key]
                data = cast(np.frombuffer(data, dtype=stored_dtype(record.dtype)))
            else:
                target = record.dtype
            got = found[key]
            if (got.dtype, tuple(got.shape)) != (target, tuple(record.shape)):
                raise ReadBackError(
                    f"{key}: written as {got.dtype}{list(got.shape)}, expected "
                    f"{target}{list(record.shape)}: nothing was replaced"
                )
            if bytes(written.read_bytes(got)[0]) != bytes(data):
                raise ReadBackError(f"{key}: its bytes read back differ: nothing was replaced")
