"""The dispatcher pins glibc's mmap threshold, so freed arrays of a few MB leave its memory."""

import platform
import subprocess
import sys

import pytest

from dispatcher.allocator import pin_mmap_threshold

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_pinning_the_threshold_returns_freed_arrays_to_the_os():
    assert pin_mmap_threshold()
    # In a fresh process: free a 32 MB block (which raises an unpinned threshold to 32 MB), then
    # allocate and free 4 MB blocks around a live one; pinned, each goes back to the OS when freed.
    code = """
import sys
import numpy as np
from dispatcher.allocator import pin_mmap_threshold
if sys.argv[1] == "pin":
    pin_mmap_threshold()
def anon_kb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
big = np.ones(32 << 20, dtype=np.uint8); del big
base = anon_kb()
keep = []
for _ in range(16):
    a = np.ones(4 << 20, dtype=np.uint8)
    keep.append(np.ones(64, dtype=np.uint8))
    b = np.ones(4 << 20, dtype=np.uint8)
    del a
    keep.append(b)
    keep.pop()
print(anon_kb() - base)
"""
    grown = {mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                                      check=True).stdout) for mode in ("pin", "default")}
    assert grown["pin"] < grown["default"], grown
