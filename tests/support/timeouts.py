"""How long the tests wait for a subprocess, a thread or a server before calling it a hang.

Every such bound in tests/ comes from :func:`scaled`: a timeout bounds a hang, it never
measures speed, so each base value is generous for a quiet machine, and the environment variable
``CKPTTOOL_TEST_TIMEOUT_SCALE`` multiplies all of them at once for a slow or busy one
(``CKPTTOOL_TEST_TIMEOUT_SCALE=4 python -m pytest``). A wait that runs out says how long it
waited and how to give it more (:func:`expired`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import Any

SCALE_VARIABLE = "CKPTTOOL_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """The factor ``CKPTTOOL_TEST_TIMEOUT_SCALE`` sets (default 1; it must be positive)."""
    text = os.environ.get(SCALE_VARIABLE, "").strip()
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        raise ValueError(f"{SCALE_VARIABLE}={text!r}: not a number") from None
    if not scale > 0:
        raise ValueError(f"{SCALE_VARIABLE}={text!r}: must be positive")
    return scale


def scaled(seconds: float) -> float:
    """``seconds`` times the scale: the bound to pass as ``timeout=``."""
    return seconds * timeout_scale()


def expired(what: str, seconds: float) -> str:
    """The message of a wait that ran out: what, how long, and how to allow more."""
    return (
        f"{what} did not finish within {seconds:.0f} s (a hang, or a very slow machine: set "
        f"{SCALE_VARIABLE}, now {timeout_scale():g}, to wait longer)"
    )


def run(
    argv: Sequence[str | os.PathLike[str]], seconds: float, **kwargs: Any
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(argv, timeout=scaled(seconds), **kwargs)``; one that runs out fails
    the test with :func:`expired`'s message and the end of what it printed."""
    import pytest

    bound = scaled(seconds)
    try:
        return subprocess.run(argv, timeout=bound, **kwargs)
    except subprocess.TimeoutExpired as error:
        output = error.stderr or error.output or b""
        tail = output.decode(errors="replace") if isinstance(output, bytes) else output
        pytest.fail(expired(" ".join(map(str, argv)), bound) + "\n" + tail[-4000:])
