"""ckpttool's CRC-32 (ISA-L's when installed, zlib's otherwise) gives zlib's results, whichever
implementation runs, on every length and continued from any value."""

from __future__ import annotations

import random
import sys
import zlib

import pytest

from ckpttool.io import crc


def _chunks() -> list[bytes]:
    rng = random.Random(7)
    sizes = [0, 1, 3, 15, 16, 17, 255, 4096, 65_537, 1 << 20]
    return [rng.randbytes(n) for n in sizes]


def test_isal_is_what_runs_where_it_is_installed() -> None:
    """The test extra installs it (a dependency): CI exercises the fast path."""
    name, _ = crc.implementation()
    assert name == "isal"


@pytest.mark.parametrize("installed", [True, False], ids=["isal", "zlib fallback"])
def test_every_implementation_gives_zlibs_crc(
    monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    if not installed:
        monkeypatch.setitem(sys.modules, "isal", None)  # import isal raises ImportError
    name, function = crc.implementation()
    assert name == ("isal" if installed else "zlib")
    monkeypatch.setattr(crc, "_impl", function)
    running = expected = 0
    for data in _chunks():
        assert crc.crc32(data) == zlib.crc32(data)
        assert crc.crc32(memoryview(data)) == zlib.crc32(data)
        running = crc.crc32(data, running)  # continued across chunks, as the writers do
        expected = zlib.crc32(data, expected)
        assert running == expected
    assert crc.crc32(bytearray(b"123456789")) == 0xCBF43926  # the CRC-32 check value
