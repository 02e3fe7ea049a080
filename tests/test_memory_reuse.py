"""``convert`` tells glibc to keep freed tensor-sized buffers in the heap: the next buffer of a
like size reuses their pages instead of faulting fresh ones in (bench/README.md, issue 43)."""

from __future__ import annotations

import json
import subprocess
import sys

from ckpttool.io.memory import MMAP_THRESHOLD

PROBE = """
import json, resource, sys
from ckpttool.io.memory import reuse_freed_memory
set_up = reuse_freed_memory() if sys.argv[1] == "reuse" else None
buffer = bytearray(33 << 20)  # the first one faults its pages in either way
del buffer
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buffer = bytearray(33 << 20)  # zero-filled: every page touched
    del buffer
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"set_up": set_up, "faults": after - before}))
"""
PAGES = 20 * (33 << 20) // 4096  # the faults of 20 fresh 33 MiB buffers


def _faults(mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_freed_buffers_are_reused_without_page_faults() -> None:
    reused = _faults("reuse")
    assert reused["set_up"] is True
    assert isinstance(reused["faults"], int) and reused["faults"] < PAGES // 10


def test_without_it_each_buffer_faults_its_pages() -> None:
    """The positive control: glibc's default maps and unmaps each block of 32 MiB or more."""
    default = _faults("default")
    assert isinstance(default["faults"], int) and default["faults"] > PAGES // 2
    assert MMAP_THRESHOLD > 33 << 20  # the probe's buffers are under the raised threshold
