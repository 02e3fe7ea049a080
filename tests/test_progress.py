"""The progress bar: drawn only on a terminal, and importing no renderer."""

from __future__ import annotations

import io
import subprocess
import sys

from ckpttool.io.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_is_drawn_on_a_terminal() -> None:
    stream = _Terminal()
    with Progress(2048, "verify", stream=stream, delay=0) as bar:
        bar.advance(1024)
    assert stream.getvalue().startswith("\rverify [")
    assert "50.0%" in stream.getvalue()
    assert stream.getvalue().endswith("\n")


def test_no_bar_when_stderr_is_not_a_terminal() -> None:
    stream = io.StringIO()  # a pipe or a file: isatty() is False
    with Progress(2048, "verify", stream=stream, delay=0) as bar:
        bar.advance(1024)
        bar.advance(1024)
    assert stream.getvalue() == ""


def test_progress_imports_no_renderer() -> None:
    code = (
        "import sys, ckpttool.io.progress; "
        "print([m for m in sys.modules if m.startswith('ckpttool.render')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
