"""Large temporaries reused instead of faulted in again: glibc's ``malloc`` told to keep them.

Comparing values chunk by chunk makes a dozen NumPy temporaries of a few MB per chunk, freed
before the next chunk makes as many. By default glibc gives that memory back to the kernel
(a block past its mmap threshold is unmapped, the top of a heap past its trim threshold is
trimmed) and the next chunk takes it again, one zero-filled page fault per 4 KiB: ``diff`` of
two 1.25 GB files whose every tensor differs spent half its time in the kernel, 2.3 million
page faults (bench/README.md), and the faults of threads of one process queue on its memory
map's lock, so ``--jobs`` gained little. Blocks under :data:`MMAP_THRESHOLD` are taken from the
heaps instead, and up to :data:`TRIM_THRESHOLD` bytes freed at a heap's top are kept for the
next chunk: the peak memory is the same, the page faults are gone.

Linux with glibc only (elsewhere nothing is changed), once per process, and not where the user
set either threshold in the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``).
"""

from __future__ import annotations

import functools
import os

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the threshold it raises as blocks are freed
TRIM_THRESHOLD = 128 << 20  # free bytes a heap keeps at its top (glibc's default: 128 KiB)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Tell glibc's ``malloc`` to keep freed blocks of up to :data:`MMAP_THRESHOLD` for reuse
    (see the module's docstring); whether it was done."""
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # (musl, macOS: no such name, or None)
            return False
    except (ValueError, OSError, AttributeError):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]
