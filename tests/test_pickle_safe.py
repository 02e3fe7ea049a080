"""The opcode interpreter: every opcode has exactly one implementation, and both paths agree.

``SafeUnpickler.load`` interprets the opcodes ``torch.save`` writes most inline and the rest
through ``DISPATCH``; an opcode in neither would be refused as unknown, one in both would have
a second, unused implementation. Plain data pickled with every protocol must read back equal to
what ``pickle.loads`` builds, through whichever path each opcode takes.
"""

from __future__ import annotations

import pickle
import pickletools
from collections import OrderedDict

import pytest

from ckpttool.errors import CorruptCheckpointError, ResourceLimitError
from ckpttool.pickle.interpreter import (
    DISPATCH,
    INLINE_OPCODES,
    MAX_NODES,
    TruncatedPickleError,
    load_pickle,
)

PLAIN = {
    "ints": [0, 1, 255, 256, 65535, 65536, -1, -(2**31), 2**31 - 1, 2**40, -(2**70)],
    "floats": [0.5, -1e300, float("inf")],
    "text": ["", "a", "é" * 300, "x" * 1000],
    "bytes": [b"", b"\x00" * 300],
    "nested": ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [[], {}, set(), frozenset({1})]),
    "flags": [True, False, None],
    "shared": None,  # set below: one list referred to twice (memo PUT/GET)
    "ordered": OrderedDict(a=1),
}
_shared = [1, 2]
PLAIN["shared"] = [_shared, _shared]


def test_every_opcode_has_exactly_one_implementation() -> None:
    codes = {op.code.encode("latin-1")[0] for op in pickletools.opcodes}
    assert INLINE_OPCODES.isdisjoint(DISPATCH)
    assert codes - INLINE_OPCODES - set(DISPATCH) == set()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_reads_back_as_pickle_builds_it(protocol: int) -> None:
    data = pickle.dumps(PLAIN, protocol=protocol)
    root = load_pickle(data).root
    expected = pickle.loads(data)
    expected["ordered"] = dict(expected["ordered"])  # emulated as a plain dict
    assert root == expected


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_every_truncation_is_a_corrupt_checkpoint_error(protocol: int) -> None:
    """Cut anywhere, inline or dispatched opcode: one of ckpttool's errors, never another."""
    data = pickle.dumps(PLAIN, protocol=protocol)
    for end in range(0, len(data)):
        with pytest.raises(CorruptCheckpointError):
            load_pickle(data[:end])
    if protocol < 4:  # no FRAME, whose length would be the first thing found short
        with pytest.raises(TruncatedPickleError):
            load_pickle(data[:-1])  # STOP missing


def _put(index: int) -> bytes:
    return b"r" + index.to_bytes(4, "little")  # LONG_BINPUT


def _get(index: int) -> bytes:
    return b"j" + index.to_bytes(4, "little")  # LONG_BINGET


# Memo entries out of order, overwritten, past the dense part, read back by every kind of GET;
# each is a list of what the reader must return, the same as pickle.loads on the same bytes.
MEMO_PICKLES = {
    # PUT 2 before 0 and 1 (sparse), then 0, 1 and 2 again: the dense part grows onto 2 and
    # the later value wins
    "sparse-then-dense": b"\x80\x02(K\x0a" + _put(2) + b"0K\x00" + _put(0) + b"0K\x01" + _put(1)
    + b"0K\x0c" + _put(2) + b"0" + _get(0) + _get(1) + _get(2) + b"l.",
    # overwriting a dense entry, and a huge index next to it
    "overwrite-and-huge": b"\x80\x02(K\x01" + _put(0) + b"0K\x02" + _put(0) + b"0K\x03"
    + _put(0x7FFFFFFF) + b"0" + _get(0) + _get(0x7FFFFFFF) + b"h\x00l.",
    # MEMOIZE numbers its entry by the count of distinct indices so far (sparse ones included)
    "memoize-counts-sparse": b"\x80\x04(K\x07" + _put(5) + b"0K\x08\x94K\x09\x94" + _get(1)
    + _get(2) + _get(5) + b"l.",
    # the dense part grows over a sparse entry (1), then MEMOIZE: 2 distinct indices, so it is 2
    "grown-over-then-memoize": b"\x80\x04(K\x01" + _put(1) + b"0K\x00" + _put(0) + b"0K\x0b"
    + _put(1) + b"0K\x02\x94" + _get(2) + _get(1) + b"l.",
    # the same through the text PUT and GET, which are not inlined
    "grown-over-then-memoize-text": b"(I1\np1\n0I0\np0\n0I11\np1\n0I2\n\x94g2\ng1\nl.",
    # text PUT/GET (protocol 0), the sparse index first
    "text-sparse-first": b"(I7\np3\n0I8\np0\n0I9\np1\n0g3\ng0\ng1\nl.",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MEMO_PICKLES))
def test_memo_reads_back_as_pickle_does(name: str) -> None:
    data = MEMO_PICKLES[name]
    # the pure-Python unpickler: its memo is a dict, as ours is past its list (the C one
    # allocates an array as long as the largest index: LONG_BINPUT 0x7fffffff is a MemoryError)
    assert load_pickle(data).root == pickle._loads(data)  # type: ignore[attr-defined]


def test_memo_get_of_an_index_never_put_is_refused() -> None:
    for data in (b"\x80\x02K\x01" + _put(3) + b"0" + _get(0) + b".", b"\x80\x02h\x00."):
        with pytest.raises(CorruptCheckpointError, match="never PUT"):
            load_pickle(data)


def test_small_flat_tuples_shared_many_times_still_hit_the_expanded_size_limit() -> None:
    """A tuple of short strings is returned as it is and not tallied as reused (like a shape),
    but its weight still counts: 1.5 million references to one weigh 25 million nodes."""
    pair = tuple(f"s{i}" for i in range(16))
    data = pickle.dumps([pair] * 1_500_000, protocol=4)
    assert MAX_NODES < 17 * 1_500_000 and len(data) < 8 << 20
    with pytest.raises(ResourceLimitError, match="expands to over"):
        load_pickle(data)
