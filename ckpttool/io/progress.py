"""A byte-count progress bar on stderr, shown only on a terminal and only for slow work.

Library functions take an optional ``progress`` callback (a :data:`ProgressCallback`, such as
``Progress.advance``) so that they never print; the CLI creates the bar. Nothing is drawn
until ``delay`` seconds have passed, so quick commands stay quiet, and machine output on stdout
is never touched.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO, TypeAlias

from ckpttool.model.text import human_size

#: What library functions take as ``progress``: called with the bytes each step has just read
#: or written. ``Progress.advance`` is one; the library never draws anything itself.
ProgressCallback: TypeAlias = Callable[[int], None]


class Progress:
    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        delay: float = 0.5,
        enabled: bool | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.start = time.monotonic()
        self.delay = delay
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.last_draw = 0.0
        self.drawn = False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if not self.enabled or now - self.start < self.delay or now - self.last_draw < 0.1:
            return
        self.last_draw = now
        fraction = min(self.done / self.total, 1.0)
        bar = "#" * int(fraction * 30)
        rate = self.done / max(now - self.start, 1e-9)
        self.stream.write(
            f"\r{self.label} [{bar:<30}] {fraction:6.1%} "
            f"{human_size(self.done)}/{human_size(self.total)} {human_size(rate)}/s"
        )
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
