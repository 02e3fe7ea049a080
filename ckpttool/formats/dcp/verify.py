"""``verify`` for a torch.distributed.checkpoint directory: every item of every data file.

Opening the directory (non-strict) already reports missing data files, files shorter or longer
than the items the metadata places in them, and chunks that do not tile their tensor. This
reads every item: the zip structure and CRC-32 of each record of its small archive, and for a
tensor chunk its dtype, shape and extent against the metadata; the pickles are walked (nothing
runs) and dangerous globals in them reported. Data files nothing refers to are noted.
"""

from __future__ import annotations

from ckpttool.errors import CkptError
from ckpttool.formats.base import Checkpoint
from ckpttool.formats.dcp.directory import METADATA, DcpFiles, load_metadata, present, tensor_record
from ckpttool.formats.dcp.metadata import StorageSpan, TensorEntry, span_of
from ckpttool.formats.registry import open_source
from ckpttool.formats.torch_zip.verify import check_archive
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.source import join, list_names
from ckpttool.model.records import ChunkRecord, StorageRecord
from ckpttool.pickle.policy import Verdict, never_load_problem


def check_dcp(
    ckpt: Checkpoint, progress: ProgressCallback | None = None
) -> tuple[list[str], list[str]]:
    """(problems, what was checked) for the DCP directory ``ckpt`` was opened from."""
    directory = ckpt.name  # a local directory or a URL
    meta = ckpt.index
    if meta is None:  # not opened by the DCP reader: parse its .metadata here
        with open_source(join(directory, METADATA)) as handle:
            _, meta = load_metadata(handle, refuse_dangerous=False)
    sizes = {name: size for name, size in ckpt.details["files"].items() if size is not None}
    files = DcpFiles(directory, sizes)
    problems: list[str] = []
    dangerous: set[str] = set()
    # each tensor chunk's archive is checked against the metadata when its item is read
    chunks: dict[StorageSpan, tuple[ChunkRecord, StorageRecord]] = {}
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}
    for entry in meta.entries:
        if isinstance(entry, TensorEntry):
            storage = tensor_record(entry, strides).storage
            assert storage is not None
            chunks.update((span_of(chunk), (chunk, storage)) for chunk in entry.chunks)
    count = 0
    try:
        for what, span in meta.items():
            if present(span, sizes):
                count += 1
                problems += _check_item(files, span, what, dangerous, progress, chunks.get(span))
    finally:
        files.close()
    if dangerous:
        problems.append(never_load_problem("the data files' pickles call", dangerous))
    checked = [
        f"data files: each present and as long as its items ({len(meta.files)} "
        f"file{'s' * (len(meta.files) != 1)})",
        f"{count} item{'s' * (count != 1)}: zip directory, CRC-32 of every record, "
        "chunk dtype/shape/extent",
    ]
    spare = [n for n in list_names(directory) if n.endswith(".distcp") and n not in meta.files]
    if spare:
        checked.append(f"note: data files the metadata does not refer to: {', '.join(spare)}")
    return problems, checked


def _check_item(
    files: DcpFiles,
    span: StorageSpan,
    what: str,
    dangerous: set[str],
    progress: ProgressCallback | None,
    chunk: tuple[ChunkRecord, StorageRecord] | None,
) -> list[str]:
    """One item (``what`` it holds, at ``span``): its archive's records and CRCs, its pickle
    walked once (dangerous globals collected), and, for a tensor chunk, its tensor against the
    metadata."""
    if files.pread(span.file, span.offset, min(4, span.length)) != b"PK\x03\x04":
        return []  # a value saved as raw bytes (a BytesIO): no structure to check
    try:
        directory = files.zip_directory(span)
        problems = check_archive(files.fd(span.file), directory, span.offset, progress)
        # a chunk's tree is only read here: its walk may be shared (a value's is its own)
        parsed = files.archive(
            span, refuse_dangerous=False, shared=chunk is not None, directory=directory
        )
    except CkptError as error:
        return [f"{what} in {span}: {error}"]
    if parsed.pickle is not None:
        dangerous.update(
            f"{m}.{n}" for m, n, v in parsed.pickle.globals_seen if v is Verdict.DANGEROUS
        )
    found = [f"{what} in {span}: {problem}" for problem in problems]
    if chunk is not None and not found:
        try:
            files.chunk_tensor(*chunk, parsed=parsed)
        except CkptError as error:
            found.append(str(error))
    return found
