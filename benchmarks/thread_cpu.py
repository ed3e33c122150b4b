"""Each thread's time on a CPU, read from the kernel's schedstat (nanoseconds): how ``hsd bench scale``
times the dispatcher and its socket floor by thread (ZeroMQ's I/O thread, the journal's, the loop)."""

from __future__ import annotations

import os


def cpu_ns_by_thread_name(pid: int) -> dict[str, int]:
    """Each thread's time on a CPU in nanoseconds, summed by the thread's name (``comm``): ``loop``
    (the main thread: the socket loop), the journal's sync thread (``hsd-journal``), ZeroMQ's I/O
    threads (``ZMQbg/IO/0``), ``python`` (any other Python thread: it keeps the process's name)."""
    names: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/comm") as f:
            process_name = f.read().strip()
    except OSError:
        return names
    for tid, ns in thread_cpu_ns(pid).items():
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        name = "loop" if tid == pid else "python" if comm == process_name else comm
        names[name] = names.get(name, 0) + ns
    return names


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each live thread's time on a CPU in nanoseconds (``/proc/PID/task/TID/schedstat``); empty where
    the kernel does not keep it."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                times[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return times
