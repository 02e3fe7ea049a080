"""The C allocator told to reuse the memory of freed tensor-sized buffers (glibc only).

glibc's ``malloc`` hands out a block of 32 MiB or more as a fresh ``mmap`` and unmaps it when
it is freed, so every tensor read, cast or written through a new buffer page-faults all of its
pages in again: on ``convert --dtype bf16`` of a directory of 32 MiB tensors, system time was
most of the run (bench/README.md, issue 43). Raising the mmap threshold keeps such blocks in
the heap, where the next one of a like size reuses the same pages; raising the trim threshold
keeps the heap from being returned to the kernel after each. Peak memory is unchanged (it is
the same tensors at once); the process only keeps it until it exits, which a CLI command does
soon after. So it is set by the CLI, never by the library in a user's process.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap: tensors up to 256 MiB
TRIM_THRESHOLD = 1 << 30  # free bytes at the heap's top kept for the next buffers


def reuse_freed_memory() -> bool:
    """Set the thresholds; False where the C library has no ``mallopt`` (musl, macOS...)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
