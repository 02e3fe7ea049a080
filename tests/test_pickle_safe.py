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

from ckpttool.errors import CorruptCheckpointError
from ckpttool.pickle.interpreter import DISPATCH, INLINE_OPCODES, TruncatedPickleError, load_pickle

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
