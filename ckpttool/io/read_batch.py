"""Reading the bytes of many small tensors with few reads: adjacent records, one ``pread``.

A checkpoint of 100,000 small tensors costs one read per tensor through
:meth:`~ckpttool.checkpoint.Checkpoint.read_bytes`; the system calls and the Python around them
were most of ``diff``'s and ``convert``'s time. :func:`read_many` gives, for each record in
turn, exactly what ``read_bytes`` gives, but reads runs of records that lie close together in
the file (in the order asked, each starting at or after the previous one's end) as one block of
at most :data:`BLOCK` bytes, so memory stays bounded whatever the tensor count.

Anything that is not one plain range of one file (inline bytes, meta tensors, packed dtypes,
DCP's assembled storages, a record past its storage, a block the file ends inside) is read by
``read_bytes`` itself when its turn comes, so errors are the same, raised at the same record.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ckpttool.model.records import RecordReader, TensorRecord

BLOCK = 1 << 20  # bytes per grouped read: the memory a batch may hold
LOOKAHEAD = 256  # records whose spans are looked up before their bytes are read
# ... and at most this many of their bytes: a remote file's plan keeps what it fetched ahead
# within a bound (ckpttool.io.remote.PLAN_KEPT), and a record's span is found in its local
# header, read before its data
LOOKAHEAD_BYTES = 8 << 20
GAP = 4096  # bytes between two records that are still read in one block (zip headers, padding)


def read_many(
    ckpt: RecordReader, records: Iterable[TensorRecord], block: int = BLOCK
) -> Iterator[tuple[bytes | bytearray, int]]:
    """``ckpt.read_bytes(record)`` for each record, in order, reading adjacent ones together.

    Lazy: a block is read when its first record is asked for, and a record that fails is read
    (and raises) only when its turn comes.
    """
    if isinstance(records, list):
        ckpt.plan_reads(records)  # a remote file: few large requests, each byte once
    pending: list[tuple[TensorRecord, tuple[int, int] | None]] = []
    ahead = 0
    for record in records:
        span = ckpt.file_span(record)
        pending.append((record, span))
        ahead += span[1] if span is not None else 0
        if len(pending) == LOOKAHEAD or ahead >= LOOKAHEAD_BYTES:
            yield from _groups(ckpt, pending, block)
            pending, ahead = [], 0
    yield from _groups(ckpt, pending, block)


def _groups(
    ckpt: RecordReader, pending: list[tuple[TensorRecord, tuple[int, int] | None]], block: int
) -> Iterator[tuple[bytes | bytearray, int]]:
    """The records of ``pending`` in order, each run of adjacent ones read as one block."""
    done = 0
    while done < len(pending):
        record, span = pending[done]
        if span is None or span[1] > block:
            done += 1
            yield ckpt.read_bytes(record)
            continue
        start, end = span[0], span[0] + span[1]
        last = done + 1
        while last < len(pending):
            nxt = pending[last][1]
            if nxt is None or nxt[0] < end or nxt[0] - end > GAP or nxt[0] + nxt[1] - start > block:
                break
            end = nxt[0] + nxt[1]
            last += 1
        group = pending[done:last]
        done = last
        if len(group) == 1:
            yield ckpt.read_bytes(record)
            continue
        data = ckpt.read_file(start, end - start)
        if len(data) != end - start:  # the file ends inside: each record raises its own error
            for member, _ in group:
                yield ckpt.read_bytes(member)
            continue
        for _, member_span in group:
            assert member_span is not None
            at = member_span[0] - start
            yield data[at : at + member_span[1]], 0


class InOrder:
    """The reads of records that will be asked for in a known order (``expected``), made in
    blocks by :func:`read_many`; :meth:`~ckpttool.checkpoint.Checkpoint.expect_reads` asks it first
    and reads any other record, or one asked for out of turn, on its own."""

    def __init__(self, ckpt: RecordReader, expected: list[TensorRecord]) -> None:
        self._expected = iter(expected)
        self._next = next(self._expected, None)
        self._reads = read_many(ckpt, expected)

    def take(self, record: TensorRecord) -> tuple[bytes | bytearray, int] | None:
        """``record``'s bytes if it is the next one expected, else None."""
        if record is not self._next:
            return None
        self._next = next(self._expected, None)
        return next(self._reads)
