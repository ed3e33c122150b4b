"""What a process this project starts does before it runs: it dies with the process that started it.

On Linux a child can ask the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``):
:func:`die_with_parent` as a ``subprocess`` ``preexec_fn`` makes that SIGKILL, so a killed launcher
takes its run with it and a SIGKILLed dispatcher its schedule builder. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A child's ``preexec_fn``: it is SIGKILLed when the process that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: children outlive a killed parent, as with any plain spawn
