"""tests/support/timeouts.py: every wait's bound, scaled by one environment variable."""

from __future__ import annotations

import os
import sys

import pytest

from tests.support import timeouts


def test_the_scale_multiplies_every_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timeouts.SCALE_VARIABLE, raising=False)
    assert timeouts.scaled(240) == 240
    monkeypatch.setenv(timeouts.SCALE_VARIABLE, "2.5")
    assert timeouts.scaled(240) == 600


@pytest.mark.parametrize("value", ["zero", "0", "-1"])
def test_a_scale_that_is_not_a_positive_number_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(timeouts.SCALE_VARIABLE, value)
    with pytest.raises(ValueError, match=timeouts.SCALE_VARIABLE):
        timeouts.scaled(1)


def test_a_subprocess_that_hangs_fails_the_test_with_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child reading a pipe the test keeps open and never writes to: it hangs whatever the
    machine's speed."""
    monkeypatch.setenv(timeouts.SCALE_VARIABLE, "0.5")
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(pytest.fail.Exception) as failure:
            timeouts.run(
                [sys.executable, "-c", "import sys; sys.stdin.read()"], 2, stdin=read_end,
                capture_output=True,
            )  # fmt: skip
    finally:
        os.close(read_end)
        os.close(write_end)
    message = str(failure.value)
    assert "did not finish within 1 s" in message
    assert f"set {timeouts.SCALE_VARIABLE}, now 0.5, to wait longer" in message
