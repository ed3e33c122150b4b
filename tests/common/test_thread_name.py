"""A thread named for the kernel is told apart from its process in /proc (profiles, CPU by thread)."""

from __future__ import annotations

import threading

from common.thread_name import name_os_thread


def test_a_named_thread_shows_its_name_to_the_kernel():
    seen = []

    def run():
        name_os_thread("hsd-test-thread-long-name")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == ["hsd-test-thread"]  # the kernel keeps 15 bytes
