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
from ckpttool.formats.torch_zip.verify import check_archive
from ckpttool.io.parallel import serialized
from ckpttool.io.progress import ProgressCallback
from ckpttool.io.source import join, list_names, open_source
from ckpttool.io.units import shared_map
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
    items = [(what, span) for what, span in meta.items() if present(span, sizes)]
    count = len(items)
    by_file: dict[str, list[int]] = {}  # data file -> its items' numbers, in the metadata's order
    for number, (_, span) in enumerate(items):
        by_file.setdefault(span.file, []).append(number)
    shared_progress = serialized(progress)

    def check_file(numbers: list[int]) -> list[tuple[list[str], set[str]]]:
        """One data file's items, on its own handles (a worker's, with --jobs)."""
        own = DcpFiles(directory, sizes)
        found = []
        try:
            for number in numbers:
                what, span = items[number]
                seen: set[str] = set()
                found.append(
                    (_check_item(own, span, what, seen, shared_progress, chunks.get(span)), seen)
                )
        finally:
            own.close()
        return found

    results: list[tuple[list[str], set[str]]] = [([], set())] * count
    # --jobs: data files checked at once (reading and CRC-32 release the GIL); in item order
    # under torchrun, shared by the ranks (by items: a data file's size is not at hand here)
    files = list(by_file.values())
    for numbers, found in zip(files, shared_map(check_file, files, [len(n) for n in files])):
        for number, result in zip(numbers, found):
            results[number] = result
    for item_problems, seen in results:
        problems += item_problems
        dangerous |= seen
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
