"""Keep the dispatcher's resident memory that of its live state: pin glibc's mmap threshold.

glibc's malloc serves a large allocation from a mapping of its own, returned to the OS when freed,
but it raises that threshold to the size of each such block freed (up to 32 MB). After the first
snapshot frees its copy of an epoch's arrays, arrays of a few MB come from the heap, where a block
freed between live ones stays resident: at a million jobs an epoch the dispatcher's memory grew by
23 MB at the second epoch and stayed there. Pinning the threshold (which also turns the raising
off) keeps every array above it in a mapping of its own.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("hsd.dispatcher")

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin the mmap threshold of this process's malloc; False where the C library has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, nbytes))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; memory may grow with the allocator's threshold")
    return done
