"""A thread's name as the kernel shows it (``/proc/PID/task/TID/comm``, ``top -H``, ``py-spy``).

Python before 3.14 leaves every thread it starts with the process's name, so a profile or a CPU
breakdown by thread (``hsd bench scale``'s ``thread_cpu_us_per_item``) cannot tell them apart:
:func:`name_os_thread` gives the calling thread a name of its own (Linux; elsewhere it does nothing).
"""

from __future__ import annotations

import ctypes

_PR_SET_NAME = 15
_MAX_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL


def name_os_thread(name: str) -> None:
    """Name the calling thread for the kernel (cut to 15 bytes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:_MAX_NAME_BYTES])
    except (OSError, AttributeError):
        pass  # not Linux
