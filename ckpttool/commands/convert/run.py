"""``convert``: weights to safetensors (or a plain ``.pth``) and back, verified by reading back.

The conversion streams: the output's layout is decided from the reader's records
(:mod:`ckpttool.commands.convert.plan`), its header is written first, then each tensor is read
(``pread`` of just its bytes), cast if asked, written and freed. Peak memory is a few times the
largest tensor, never the file. torch is not imported: NumPy casts (:mod:`ckpttool.model.cast`) and
the ``.pth`` pickle is generated (each output format's writer, found through
:mod:`ckpttool.formats.registry`). The exception: a ``.pth`` that keeps
sparse, quantized or nested tensors is built and saved by torch (:mod:`ckpttool.commands.convert.torch_kinds`).

Every output is written to temp files next to its target (:func:`ckpttool.io.atomic.atomic_group`);
before they replace anything, each is opened again through the reader and every tensor is
compared bit for bit with the source's bytes (a computed one, cast for instance, with the CRC-32
of the bytes written: it is computed once), and its size with the expected size. A mismatch
removes the temps and raises :class:`VerificationError` (exit code 1): a bad file never appears
under the target's name and an existing target is left as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.convert import model_dir, spread, torch_kinds
from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.convert.output import (
    FORMATS,
    OutFile,
    check_targets,
    names_directory,
    parse_size,
    plan_outputs,
    remove_created,
    writes_pth,
)
from ckpttool.commands.convert.plan import FIELD_PREFIX, Plan, Planned, build_plan
from ckpttool.commands.mapped import DerivedCheckpoint, with_derived
from ckpttool.commands.selection import Selection, refuse_incomplete, with_component
from ckpttool.errors import (
    CkptError,
    InputError,
    OverflowRefusedError,
    VerificationError,
)
from ckpttool.formats.registry import format_by_id
from ckpttool.frameworks.base import DEFAULT_VIEW, view_facts
from ckpttool.io.atomic import atomic_group
from ckpttool.io.blocks import FileRange, crc_range, equal_ranges
from ckpttool.io.crc import crc32
from ckpttool.io.parallel import AheadMap, jobs
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.read_batch import BLOCK
from ckpttool.io.source import is_url, local_path
from ckpttool.io.values import dense_record, read_array
from ckpttool.model.dtypes import underflow_note
from ckpttool.model.edits import EditLog, use_ema
from ckpttool.model.records import TensorRecord
from ckpttool.model.roles import layout_of

if TYPE_CHECKING:  # NumPy (its import) only when a tensor is cast: bench/README.md, item 3
    from ckpttool.model.cast import CastCounts

Produce = Callable[["Planned"], "bytes | bytearray | memoryview"]
Keep = Callable[["Planned"], Any]  # a kept (sparse, nested, quantized) tensor, as torch's


@dataclass
class ConvertReport:
    """What a conversion wrote (``outputs``: shards first, index last)."""

    source: Path | str | os.PathLike[str]  # a local path, or the URL read
    outputs: list[Path]
    format: str  # "safetensors" or "pth"
    layout: str
    section: str | None
    tensors: int  # tensors stored (aliases not counted)
    aliases: dict[str, str]  # alias -> stored name
    tensor_bytes: int
    file_bytes: int
    dtype: str  # "keep", "fp16", "bf16", "fp32"
    cast: dict[str, int]  # "float32->float16" -> number of tensors
    underflow: dict[str, int]  # tensor -> values that became 0
    overflow: dict[str, int]  # tensor -> values that became inf (only with allow_overflow)
    fields: dict[str, str]  # __metadata__ entries kept from non-tensor entries
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. names kept with wrapper prefixes
    verified: bool = False
    directory: Path | None = None  # the model directory written, for a Hugging Face source
    copied: list[str] = field(default_factory=list)  # its files copied (config.json's dtype set)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    to: str | None = None,
    dtype: str = "keep",
    section: str | None = None,
    strip: Sequence[str] = (),
    ignore_wrappers: bool = False,
    pattern: str | None = None,
    drop: Sequence[str] = (),
    rename: Sequence[str] = (),
    map_name: str | None = None,
    map_params: Mapping[str, int] | None = None,
    use_ema: str | None = None,
    keep_shared: bool = False,
    max_shard_size: str | int | None = None,
    allow_overflow: bool = False,
    densify: bool = False,
    dequantize: bool = False,
    skip_missing_values: bool = False,
    verify: bool = True,
    force: bool = False,
    progress: ProgressCallback | None = None,
    on_total: ProgressCallback | None = None,
) -> ConvertReport:
    """:func:`convert_with` for a library call: the option groups from keywords."""
    choice = Selection(
        section, tuple(strip), ignore_wrappers, pattern, tuple(drop), tuple(rename),
        map=map_name, map_params=tuple((map_params or {}).items()), use_ema=use_ema,
    )  # fmt: skip
    options = ConversionOptions(
        to=to, dtype=dtype, allow_overflow=allow_overflow, keep_shared=keep_shared,
        densify=densify, dequantize=dequantize, skip_missing_values=skip_missing_values,
        max_shard_size=max_shard_size, verify=verify,
    )  # fmt: skip
    return convert_with(src, dst, choice, options, force=force, progress=progress,
                        on_total=on_total)  # fmt: skip


def convert_with(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None,
    choice: Selection,
    options: ConversionOptions,
    *,
    force: bool = False,
    progress: ProgressCallback | None = None,
    on_total: ProgressCallback | None = None,
) -> ConvertReport:
    """Convert the weights in ``src`` (those ``choice`` selects) to safetensors (or
    ``options.to="pth"``); see the module doc.

    ``progress`` is called with the bytes each tensor adds (written, then verified);
    ``on_total`` once, before any is written, with the total it will add up to.
    ``options.skip_missing_values``: leave out the selected tensors the file holds no values of
    (DTensor shards of one rank, meta tensors), with a note; without it they are refused.

    Raises :class:`~ckpttool.errors.OutputExistsError` if an output exists and not ``force``,
    :class:`OverflowRefusedError` if a cast overflows and not ``options.allow_overflow``,
    :class:`VerificationError` (exit code 1) if the output does not read back identical.
    """
    to, verify = options.to, options.verify
    if to is not None and to not in FORMATS:
        raise InputError(f"--to must be one of {', '.join(FORMATS)}; got {to!r}")
    src_path = _local_name(src, dst)
    job = spread.Job(write_share, os.fspath(src), None if dst is None else os.fspath(dst),
                     choice, options, write_range_share)  # fmt: skip
    with _planned(job) as (ckpt, plan, files, output):
        if on_total is not None:
            on_total(plan.tensor_bytes * (2 if verify else 1))
        spreader = spread.chosen(job, files)

        def write(files: list[OutFile], sweep_in: Path | None = None) -> dict[str, CastCounts]:
            def local(files: list[OutFile]) -> dict[str, CastCounts]:
                return write_outputs(ckpt, plan, files, allow_overflow=options.allow_overflow,
                                     verify=verify, progress=progress or (lambda n: None))  # fmt: skip

            if spreader is None:
                return local(files)
            return spreader.write(
                files, local, progress or (lambda n: None), sweep_in=sweep_in,
                write_range=lambda out, bounds, path: write_range(ckpt, out, bounds, path, options),
            )  # fmt: skip

        if output is not None:
            assert dst is not None
            target = Path(dst)
            model_dir.check_target(output, target, force)
            leads = spreader is None or spreader.leads
            staged = model_dir.staged_directory(target) if leads else contextlib.nullcontext(target)
            with staged as staging:
                counts = write(model_dir.moved(files, staging), sweep_in=target)
                copied = model_dir.copy_files(output, staging)
                retyped = model_dir.config_dtype(plan, staging, copied)
            report = _build_report(src_path, plan, files, counts, dtype=options.dtype,
                                   verified=verify)  # fmt: skip
            _name_remote_source(report, src, verify)
            report.directory = target
            report.copied = copied
            if retyped is not None:
                report.notes.append(retyped)
            return report
        created = check_targets(src_path, files, force, make_directory=names_directory(dst))
        try:
            counts = write(files)
        except BaseException:  # Ctrl-C, SIGTERM, an error: no empty DIR/ left behind
            remove_created(created, files[0].target.parent)
            raise
    report = _build_report(src_path, plan, files, counts, dtype=options.dtype, verified=verify)
    _name_remote_source(report, src, verify)
    return report


@contextlib.contextmanager
def _planned(
    job: spread.Job,
) -> Iterator[tuple[Checkpoint, Plan, list[OutFile], model_dir.ModelDirectoryOutput | None]]:
    """The source opened and the conversion planned: the files to write (a model directory's
    named in DST, with ``output`` its framework's description; else ``output`` is None).
    Deterministic: every process that plans ``job`` gets the same files."""
    src, dst, choice, options = job.src, job.dst, job.choice, job.options
    to = options.to
    max_shard_size = options.max_shard_size
    shard_size = parse_size(max_shard_size) if max_shard_size is not None else None
    src_path = _local_name(src, dst)
    with open_checkpoint(src, view=DEFAULT_VIEW) as opened:
        refuse_incomplete(opened)  # a lost file's tensors would be missing from the output
        choice = with_component(opened, choice)
        ckpt, edited = _edited(opened, choice)
        plan = build_plan(ckpt, choice, options, keep_kinds=writes_pth(dst, to))
        facts = view_facts(ckpt)
        plan.notes[:0] = [*(facts.notes if facts is not None else ()), *edited]
        output = model_dir.model_directory(ckpt)
        if model_dir.wants_model_dir(output, dst):
            assert dst is not None and output is not None
            if to == "pth":
                raise InputError(
                    "a model directory is written as safetensors, as from_pretrained loads it; "
                    "drop --to pth or name a .pth DST"
                )
            if shard_size is not None and not output.shardable:
                raise InputError(
                    f"{src}: its loader reads one {output.weights_name}, not shards: drop "
                    "--max-shard-size"
                )
            plan = model_dir.for_transformers(plan, output)
            target = Path(dst)
            weights = target / output.weights_name if shard_size is None else f"{target}{os.sep}"
            yield ckpt, plan, plan_outputs(src_path, weights, None, shard_size, plan), output
            return
        yield ckpt, plan, plan_outputs(src_path, dst, to, shard_size, plan), None


def write_share(
    job: spread.Job, share: list[int], parts_dir: Path, token: str
) -> list[spread.Part]:
    """In a worker process (``--jobs N``): plan ``job`` again and write the data files
    ``share`` names as verified parts in ``parts_dir`` (:mod:`.spread`)."""
    options = job.options
    with _planned(job) as (ckpt, plan, files, _):
        data = [f for f in files if f.kind != "index"]

        def local(files: list[OutFile]) -> dict[str, CastCounts]:
            return write_outputs(ckpt, plan, files, allow_overflow=options.allow_overflow,
                                 verify=options.verify, progress=lambda n: None)  # fmt: skip

        return spread.write_share(share, data, parts_dir, token, local)


def write_range(
    ckpt: Checkpoint, out: OutFile, bounds: tuple[int, int], path: Path, options: ConversionOptions
) -> dict[str, CastCounts]:
    """``out.tensors[first:stop]`` written where they go in ``path`` (a safetensors file the
    lead made: header written, full size), fsynced, and read back tensor by tensor: each one's
    CRC-32 against that of the bytes written (as one process checks them, :class:`_Hashing`).
    Returns what each cast lost."""
    first, stop = bounds
    counts: dict[str, CastCounts] = {}
    digests: dict[str, bytes] = {}
    with open(path, "r+b") as handle:
        handle.seek(out.expected_size - sum(p.nbytes for p in out.tensors[first:]))
        for planned in out.tensors[first:stop]:
            data, cast = tensor_bytes(ckpt, planned)
            if cast is not None:
                counts[planned.name] = cast
                if cast.overflow and not options.allow_overflow:
                    raise OverflowRefusedError(_overflow_message(planned, cast))
            if options.verify:
                digests[planned.name] = _digest(data)
            handle.write(data)
            del data
        handle.flush()
        os.fsync(handle.fileno())
    if options.verify:
        with open_checkpoint(path) as written:
            found = {record.key: record for record in written.tensors()}
            for planned in out.tensors[first:stop]:
                got = _stored_bytes(written, found[planned.name])
                if got is None or _digest(got) != digests[planned.name]:
                    raise VerificationError(
                        f"the output did not read back identical to the source, so it was "
                        f"removed: {out.target.name}: {planned.name} does not read back "
                        "bit-for-bit equal"
                    )
    ckpt.check_unchanged()  # a remote source replaced mid-read must not be committed
    return counts


def write_range_share(
    job: spread.Job, share: list[tuple[int, int]], path: Path
) -> list[dict[str, CastCounts]]:
    """In a worker process (``--jobs N``): plan ``job`` again and write the tensor ranges
    ``share`` names into the one output file at ``path`` (:func:`write_range`)."""
    with _planned(job) as (ckpt, _, files, _):
        out = next(f for f in files if f.kind != "index")
        out.expected_size = spread.planned_size(out)
        return [write_range(ckpt, out, bounds, path, job.options) for bounds in share]


def _edited(ckpt: Checkpoint, choice: Selection) -> tuple[Checkpoint, list[str]]:
    """``ckpt`` as ``--use-ema`` and ``--map`` need it: with the EMA weights in place of the
    model's (``edit``'s rule), and able to read the tensors a map computes; notes on what
    ``--use-ema`` took."""
    notes = []
    if choice.use_ema is not None:
        log = EditLog()
        root = use_ema(ckpt.root, layout_of(ckpt), choice.use_ema or None, log)
        ckpt = with_derived(ckpt, root)
        note = f"--use-ema: the model's {len(log.ema_taken)} tensor(s) taken from {log.ema}"
        if log.ema_missing:
            note += (
                f"; {len(log.ema_missing)} it does not hold kept: {', '.join(log.ema_missing[:5])}"
            )
        notes.append(note)
    if choice.map is not None:
        ckpt = with_derived(ckpt)
    return ckpt, notes


def _name_remote_source(report: ConvertReport, src: str | os.PathLike[str], verify: bool) -> None:
    """A URL source is reported as given (not as a mangled path), with how it was verified."""
    if not is_url(src):
        return
    report.source = src
    if verify:
        report.notes.append(
            "verified against the CRC-32 of each tensor as fetched (the URL is not fetched twice)"
        )


def _local_name(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None) -> Path:
    """``src`` as a path, for naming outputs: a URL's file name, in the current directory (as
    a download would be). A URL destination is refused: the output is verified before it
    replaces anything, which only a local rename guarantees."""
    if dst is not None and is_url(dst):
        raise InputError(
            f"{dst}: convert writes to local paths only (an object store cannot take a file "
            "atomically after it was verified); convert to a local file, then upload it"
        )
    if not is_url(src):
        return Path(local_path(os.fspath(src)))
    from urllib.parse import urlsplit

    name = urlsplit(os.fspath(src)).path.rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise InputError(f"{src}: the URL names no file")
    return Path(name)


def write_outputs(
    ckpt: Checkpoint,
    plan: Plan,
    files: list[OutFile],
    *,
    allow_overflow: bool,
    verify: bool,
    progress: ProgressCallback,
    replaced: Mapping[str, Callable[[], bytes | bytearray | memoryview]] | None = None,
) -> dict[str, CastCounts]:
    """Write ``files`` through one atomic group, each tensor read, cast and written in turn;
    when ``verify``, read them back before they replace anything. Returns what each cast
    tensor lost (overflow, underflow), by name. ``replaced``: tensors whose bytes are not the
    source's but what the given function computes (``lora merge``), each called once, when
    its tensor is written, and verified against the CRC-32 of what it returned."""
    counts: dict[str, CastCounts] = {}
    replaced = replaced or {}
    # A remote source is not fetched a second time to verify: the CRC-32 of each tensor's bytes
    # is taken as they are written, and the output is read back against it. (SHA-256 was
    # measured: on two cores it made a URL's convert slower than a download and a local one.)
    remote_source = is_url(ckpt.name)
    # the order produce is called in (each file's tensors, files in turn): the next one is
    # fetched while this one is written, when the source is remote
    sequence = [p for f in files if f.kind != "index" for p in f.tensors if not p.kept]
    # Tensors whose bytes are computed (cast, decoded from a format's blocks, made dense, made
    # by a --map rule...) are verified the same way: computing them again would only show the
    # computation is deterministic, for a second pass of its CPU time (bench/gguf.py).
    hashed = remote_source or bool(replaced) or any(_computed(ckpt, p) for p in sequence)
    hashing = _Hashing() if verify and hashed else None
    # a remote file of a format that gives regions: fetched in windows, each byte once; other
    # remote files: every record located first, each tensor fetched while the one before is
    # written
    in_windows = remote_source and ckpt.plan_reads([p.record for p in sequence])
    one_by_one = remote_source and not in_windows
    following = dict(zip((p.name for p in sequence), sequence[1:])) if one_by_one else {}
    if one_by_one:
        ckpt.resolve_spans([p.record.storage for p in sequence if p.record.storage is not None])

    def produce(planned: Planned) -> bytes | bytearray | memoryview:
        compute = replaced.get(planned.name)
        if compute is not None:
            data = compute()
            if hashing is not None:
                hashing.add(planned.name, data)
            progress(planned.nbytes)
            return data
        data, cast = ahead.take(planned) if ahead is not None else tensor_bytes(ckpt, planned)
        upcoming = following.get(planned.name)
        if upcoming is not None:
            ckpt.prefetch(upcoming.record)
        if hashing is not None and (remote_source or _computed(ckpt, planned)):
            hashing.add(planned.name, data)
        if cast is not None:
            counts[planned.name] = cast
            if cast.overflow and not allow_overflow:
                raise OverflowRefusedError(_overflow_message(planned, cast))
        progress(planned.nbytes)
        return data

    def copy(planned: Planned) -> FileRange | None:
        """A large tensor written as its bytes are in a local source: left in the source file
        for the writer to copy in the kernel (no read into memory and write out again)."""
        record = planned.record
        if remote_source or planned.name in replaced or record.parts or record.quant is not None:
            return None
        if record.nbytes <= BLOCK or not _as_is(planned, record):
            return None
        found = ckpt.file_range(record)
        if found is None or found.length != planned.nbytes:
            return None
        progress(planned.nbytes)
        return found

    def keep(planned: Planned) -> Any:
        tensor = torch_kinds.rebuild(ckpt, planned.record)
        progress(planned.nbytes)
        return tensor

    def check(temps: list[Path]) -> None:
        if verify:
            digests = hashing.digests() if hashing is not None else None
            verify_outputs(ckpt, list(zip(temps, files)), progress, digests)
        ckpt.check_unchanged()  # a remote source replaced mid-read must not be committed

    # --jobs: a directory's tensors read (and cast) ahead on jobs - 1 threads, at most jobs
    # tensors held, while this one is written
    ahead = _read_ahead(ckpt, [p for p in sequence if p.name not in replaced])
    # a local source's small tensors are read in blocks of adjacent records (a remote one's
    # are fetched ahead one by one, above; a directory's read ahead as they are)
    blocks = (
        []
        if remote_source or ahead is not None
        else _read_as_is([p for p in sequence if p.name not in replaced])
    )
    try:
        with (
            atomic_group([f.target for f in files], check=check) as handles,
            ckpt.expect_reads(blocks),  # left before the check reads the source again
        ):
            for handle, out_file in zip(handles, files):
                _write(handle, out_file, plan.names, produce, keep, copy)
    except OSError as error:  # permissions, a full disk: one line, not a traceback
        raise InputError(f"conversion failed, nothing was written: {error}") from error
    finally:
        if ahead is not None:
            ahead.close()
        if hashing is not None:
            hashing.close()
    return counts


class _Hashing:
    """The CRC-32 of each tensor written, computed on a thread of its own (zlib releases the
    GIL) while the next tensor is fetched and this one written; at most two tensors wait, so
    memory stays bounded by what the conversion holds anyway."""

    def __init__(self) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-crc32")
        self._pending: list[tuple[str, Future[bytes]]] = []
        self._done: dict[str, bytes] = {}

    def add(self, name: str, data: bytes | bytearray | memoryview) -> None:
        while len(self._pending) >= 2:
            first, future = self._pending.pop(0)
            self._done[first] = future.result()
        self._pending.append((name, self._pool.submit(_digest, data)))

    def digests(self) -> dict[str, bytes]:
        for name, future in self._pending:
            self._done[name] = future.result()
        self._pending.clear()
        return self._done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _build_report(
    src_path: Path,
    plan: Plan,
    files: list[OutFile],
    counts: dict[str, CastCounts],
    *,
    dtype: str,
    verified: bool,
) -> ConvertReport:
    """What was written, from the plan, the files as they are now and the casts' losses."""
    cast_summary: dict[str, int] = {}
    for planned in plan.stored:
        if planned.dtype != planned.record.dtype:
            key = f"{planned.record.dtype}->{planned.dtype}"
            cast_summary[key] = cast_summary.get(key, 0) + 1
    output_format = "pth" if files[0].kind == "pth" else "safetensors"
    underflow = {name: c.underflow for name, c in counts.items() if c.underflow}
    return ConvertReport(
        source=src_path,
        outputs=[f.target for f in files],
        format=output_format,
        layout=plan.layout,
        section=plan.section,
        tensors=len(plan.stored),
        aliases=dict(plan.aliases),
        tensor_bytes=plan.tensor_bytes,
        file_bytes=sum(f.target.stat().st_size for f in files),
        dtype=dtype,
        cast=cast_summary,
        underflow=underflow,
        overflow={name: c.overflow for name, c in counts.items() if c.overflow},
        fields={k: v for k, v in files[0].metadata.items() if k in plan.fields},
        notes=_notes(plan, output_format, underflow),
        warnings=list(plan.warnings),
        verified=verified,
    )


def _notes(plan: Plan, output_format: str, underflow: dict[str, int]) -> list[str]:
    """What the user should know: entries left out, fields a .pth cannot hold, underflow."""
    notes = list(plan.notes)
    if plan.left_out:
        notes.append(f"not converted (not weights): {', '.join(plan.left_out)}")
    if output_format == "pth" and (plan.fields or plan.carried):
        entries: dict[str, int] = {}
        for key in [*plan.carried, *plan.fields]:
            entry = (
                key.removeprefix(FIELD_PREFIX).split(".")[0]
                if key.startswith(FIELD_PREFIX)
                else key
            )
            entries[entry] = entries.get(entry, 0) + 1
        names = [f"{e} ({n} values)" if n > 1 else e for e, n in entries.items()]
        notes.append(f"a .pth state dict holds tensors only; not written: {', '.join(names)}")
    if underflow:
        notes.append(underflow_note(plan.stored[0].dtype, underflow))
    return notes


def _read_ahead(ckpt: Checkpoint, sequence: list[Planned]) -> AheadMap[Planned, Any] | None:
    """With --jobs N > 1, a directory whose members may be read at once: its tensors read
    ahead (N - 1 threads, N tensors held at most); else None (read as they are written)."""
    count = jobs()
    if count < 2 or not ckpt.concurrent_reads or len(sequence) < 2:
        return None
    return AheadMap(lambda planned: tensor_bytes(ckpt, planned), sequence, count - 1, count)


def _computed(ckpt: Checkpoint, planned: Planned) -> bool:
    """Whether the bytes written for ``planned`` are computed rather than its source's bytes
    as they are in the file: cast, byte-swapped or made contiguous, made dense (sparse), decoded
    or dequantized (``QuantInfo``: GGUF's blocks, torch's quantized tensors), or computed by a
    ``--map`` rule. Such a tensor is hashed as it is written and its read-back compared with
    the hash, not computed a second time."""
    record = planned.record
    storage = record.storage
    return (
        bool(record.parts)
        or record.quant is not None
        or not _as_is(planned, record)
        or (isinstance(ckpt, DerivedCheckpoint) and storage is not None
            and storage.key in ckpt.derived)
    )  # fmt: skip


def _as_is(planned: Planned, record: TensorRecord) -> bool:
    """Whether ``planned`` is stored as the bytes ``record`` (its dense record) has in the file."""
    return (
        planned.dtype == record.dtype
        and record.inline_data is None
        and record.is_contiguous
        and (record.storage is None or record.storage.byteorder == "little")
    )


def _read_as_is(sequence: list[Planned]) -> list[TensorRecord]:
    """The records :func:`tensor_bytes` reads as they are, small ones, in ``sequence``'s order:
    what is worth reading in blocks (:class:`~ckpttool.io.read_batch.InOrder`)."""
    return [
        p.record
        for p in sequence
        if not p.record.parts
        and p.record.quant is None
        and 0 < p.record.nbytes <= BLOCK
        and _as_is(p, p.record)
    ]


def tensor_bytes(
    ckpt: Checkpoint, planned: Planned
) -> tuple[bytes | bytearray | memoryview, CastCounts | None]:
    """The contiguous little-endian bytes ``planned`` is stored as, and what a cast lost.
    A sparse tensor is stored dense, a quantized one dequantized (``dense_record``)."""
    record = dense_record(ckpt, planned.record)
    if _as_is(planned, record):  # the common case: the bytes as they are in the file
        if record.numel == 0:
            return b"", None
        data, first = ckpt.read_bytes(record)
        return memoryview(data)[first * record.itemsize :], None
    import numpy as np

    from ckpttool.model.cast import cast_array, stored_dtype

    values = np.ascontiguousarray(read_array(ckpt, record))
    if values.dtype.byteorder == ">":
        values = values.astype(values.dtype.newbyteorder("<"))
    counts = None
    if planned.dtype != record.dtype:
        values, counts = cast_array(values.view(stored_dtype(record.dtype)), record.dtype,
                                    planned.dtype)  # fmt: skip
    return values.reshape(-1).view(np.uint8).data, counts


# --- writing and reading back ---------------------------------------------------------------

#: The format (its vocabulary id, :mod:`ckpttool.formats.registry`) that writes each output kind.
WRITERS = {"safetensors": "safetensors", "pth": "torch-zip"}


def _write(
    handle: BinaryIO,
    out: OutFile,
    names: list[str],
    produce: Produce,
    keep: Keep,
    copy: Callable[[Planned], FileRange | None],
) -> None:
    if out.kind == "index":
        handle.write(out.content)
        out.expected_size = len(out.content)
    elif any(p.kept for p in out.tensors):
        _write_with_torch(handle, out, names, produce, keep)
    else:  # plain tensors, by the output format's writer
        writer = format_by_id(WRITERS[out.kind])

        def data(planned: Planned) -> bytes | bytearray | memoryview | FileRange:
            found = copy(planned) if writer.copies_ranges else None
            return produce(planned) if found is None else found

        out.expected_size = writer.write(
            handle,
            [p.out for p in out.tensors],
            (data(p) for p in out.tensors),
            names,
            out.aliases,
            out.metadata,
        )


def _write_with_torch(
    handle: BinaryIO, out: OutFile, names: list[str], produce: Produce, keep: Keep
) -> None:
    """A .pth holding sparse, nested or quantized tensors: built by torch and written by
    ``torch.save`` (:mod:`ckpttool.commands.convert.torch_kinds`); plain tensors go in as their (cast) bytes."""
    tensors = {
        p.name: keep(p) if p.kept else torch_kinds.plain_tensor(produce(p), p.dtype, p.record.shape)
        for p in out.tensors
    }
    state = {name: tensors[out.aliases.get(name, name)] for name in names}
    torch_kinds.save(handle, state)
    out.expected_size = handle.tell()


def _digest(data: bytes | bytearray | memoryview) -> bytes:
    return crc32(data).to_bytes(4, "little")


def verify_outputs(
    ckpt: Checkpoint,
    written: list[tuple[Path, OutFile]],
    progress: ProgressCallback,
    digests: dict[str, bytes] | None = None,
) -> None:
    """Read every written file back through the reader; raise if anything differs. With
    ``digests`` (tensor name -> CRC-32 of the bytes written), the tensors they name are
    compared with them instead of being read from the source (and computed) again."""
    problems: list[str] = []
    for temp, out in written:
        size = temp.stat().st_size
        if size != out.expected_size:
            problems.append(f"{out.target.name} has {size:,} bytes, {out.expected_size:,} expected")
        elif out.kind == "index":
            if temp.read_bytes() != out.content:
                problems.append(f"{out.target.name} does not hold the index written")
        else:
            problems += _verify_file(ckpt, temp, out, progress, digests)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise VerificationError(
            f"the output did not read back identical to the source, so it was removed: "
            f"{problems[0]}{more}"
        )


def _verify_file(
    ckpt: Checkpoint,
    temp: Path,
    out: OutFile,
    progress: ProgressCallback,
    digests: dict[str, bytes] | None = None,
) -> list[str]:
    name = out.target.name
    try:
        written = open_checkpoint(temp)
    except CkptError as error:
        return [f"{name} cannot be read back ({error})"]
    with written:
        found = {record.key: record for record in written.tensors()}
        expected = [p.name for p in out.tensors]
        if out.kind == "pth":
            expected += list(out.aliases)
        if sorted(found) != sorted(expected):
            return [f"{name} holds tensors {_diff_names(found, expected)}"]
        if out.kind == "safetensors" and written.metadata != out.metadata:
            return [f"{name}'s __metadata__ differs from what was written"]
        return _compare_file(ckpt, written, out, found, progress, digests)


def _compare_file(
    ckpt: Checkpoint,
    written: Checkpoint,
    out: OutFile,
    found: dict[str, TensorRecord],
    progress: ProgressCallback,
    digests: dict[str, bytes] | None,
) -> list[str]:
    """Each tensor of ``out`` as ``written`` holds it, against the source (or ``digests``: the
    bytes read back are hashed on a thread of its own while the next tensor is read)."""
    # both sides' small tensors read in blocks, in the order compared (a remote source is
    # compared with the digests instead)
    plain = [
        p
        for p in out.tensors
        if (r := found[p.name]).dtype == p.dtype
        and r.shape == p.record.shape
        and not p.kept
        and not torch_kinds.is_kept_kind(r)
        and r.is_contiguous
    ]
    written_reads = [found[p.name] for p in plain if 0 < p.nbytes <= BLOCK]
    source_reads = _read_as_is([p for p in plain if not digests or p.name not in digests])
    with written.expect_reads(written_reads), ckpt.expect_reads(source_reads):
        return _compare_tensors(ckpt, written, out, found, progress, digests)


def _compare_tensors(
    ckpt: Checkpoint,
    written: Checkpoint,
    out: OutFile,
    found: dict[str, TensorRecord],
    progress: ProgressCallback,
    digests: dict[str, bytes] | None,
) -> list[str]:
    problems: list[str] = []
    read_back = _Hashing() if digests is not None else None
    try:
        for planned in out.tensors:
            record = found[planned.name]
            if (record.dtype, record.shape) != (planned.dtype, planned.record.shape):
                problems.append(f"{planned.name} reads back as {record.dtype}{list(record.shape)}")
                continue
            if planned.kept or torch_kinds.is_kept_kind(record):
                want_tensor = torch_kinds.rebuild(ckpt, planned.record)
                if not torch_kinds.same_tensor(want_tensor, torch_kinds.rebuild(written, record)):
                    problems.append(f"{planned.name} does not read back as the same tensor")
                progress(planned.nbytes)
                continue
            hashed = digests is not None and planned.name in digests
            same = None if hashed else _equal_in_files(ckpt, written, planned, record)
            if same is not None:
                if not same:
                    problems.append(f"{planned.name} does not read back bit-for-bit equal")
                progress(planned.nbytes)
                continue
            got = _stored_bytes(written, record)
            if got is not None and read_back is not None and hashed:
                read_back.add(planned.name, got)  # compared below
            elif got is None or not _same_bytes(tensor_bytes(ckpt, planned)[0], got):
                problems.append(f"{planned.name} does not read back bit-for-bit equal")
            progress(planned.nbytes)
        if read_back is not None and digests is not None:
            problems += [
                f"{tensor} does not read back bit-for-bit equal"
                for tensor, digest in read_back.digests().items()
                if digest != digests[tensor]
            ]
    finally:
        if read_back is not None:
            read_back.close()
    for alias, stored in out.aliases.items():
        if out.kind == "pth" and not _same_view(found[alias], found[stored]):
            problems.append(f"{alias} does not share {stored}'s storage")
    return [f"{out.target.name}: {problem}" for problem in problems]


def _equal_in_files(
    ckpt: Checkpoint, written: Checkpoint, planned: Planned, record: TensorRecord
) -> bool | None:
    """Whether a large tensor written as its source's bytes (``record``, as ``written`` holds
    it) reads back equal, compared range against range in blocks (:mod:`ckpttool.io.blocks`:
    reused buffers, no NumPy, the source's bytes as they are in its file). None when it is not
    one range on either side: the caller compares it as a whole."""
    source = planned.record
    if planned.nbytes <= BLOCK or source.parts or source.quant is not None:
        return None
    if not _as_is(planned, source) or not record.is_contiguous:
        return None
    span, written_span = ckpt.file_span(source), written.file_span(record)
    if span is None or written_span is None or not span[1] == written_span[1] == planned.nbytes:
        return None
    # the source's whole storage, whose CRC-32 its format keeps (a torch zip record): the
    # written bytes' CRC-32 against it, without reading the source again; any other outcome
    # is settled by comparing the bytes
    assert source.storage is not None
    stored = ckpt.stored_crc(source.storage)
    if (
        stored is not None
        and ckpt.storage_span(source.storage) == span
        and crc_range(written.read_file_into, written_span[0], planned.nbytes) == stored
    ):
        return True
    return equal_ranges(
        ckpt.read_file_into, span[0], written.read_file_into, written_span[0], planned.nbytes
    )


def _stored_bytes(written: Checkpoint, record: TensorRecord) -> memoryview | None:
    """A written tensor's bytes; None if it is not stored contiguously (it always should be)."""
    if not record.is_contiguous:
        return None
    if record.numel == 0:
        return memoryview(b"")
    data, first = written.read_bytes(record)
    start = first * record.itemsize
    return memoryview(data)[start : start + record.nbytes]


def _same_bytes(want: bytes | bytearray | memoryview, got: memoryview) -> bool:
    if len(want) != len(got):
        return False
    want_view, got_view = memoryview(want), memoryview(got)
    step = 1 << 20  # compared in copies of 1 MiB: memory bounded, and no NumPy import
    return all(
        want_view[at : at + step].tobytes() == got_view[at : at + step].tobytes()
        for at in range(0, got_view.nbytes, step)
    )


def _same_view(a: TensorRecord, b: TensorRecord) -> bool:
    return a.same_storage(b) and (a.storage_offset, a.shape, a.stride) == (
        b.storage_offset, b.shape, b.stride
    )  # fmt: skip


def _diff_names(found: dict[str, TensorRecord], expected: list[str]) -> str:
    extra = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found))
    return f"{extra[:3]} not written and lacks {missing[:3]}"


def _overflow_message(planned: Planned, counts: CastCounts) -> str:
    return (
        f"{planned.name}: {counts.overflow:,} value(s) would overflow to inf in {planned.dtype} "
        f"(max |x| = {counts.max_abs:.6g}); nothing was written. Keep the dtype, choose bf16, "
        "or pass --allow-overflow to write them as inf"
    )
