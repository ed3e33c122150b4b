"""A stand-in for :class:`common.dataplane.shm_arena.CudaHostRuntime` on a machine without a GPU: it records
the pinning calls made and their sizes (never a claim that pinning works on a GPU)."""

from __future__ import annotations


class FakeRuntime:
    """common.dataplane.shm_arena.CudaHostRuntime's calls, recorded."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.cleared = 0

    def host_register(self, ptr, nbytes, device):
        self.registered.append((ptr, nbytes))
        return 1 if self.refuse else 0

    def host_unregister(self, ptr, device):
        self.unregistered.append(ptr)
        return 0

    def clear_last_error(self):
        self.cleared += 1
        return 1

    def error_string(self, err):
        return f"invalid value (error {err})"


class FakeCudaMemory:
    """common.worker.gpu_health.CudaMemory's figures, set by the test (no CUDA needed); records the devices asked."""

    def __init__(self, allocated: int, reserved: int, peak: int):
        self.figures = {"allocated": allocated, "reserved": reserved, "peak": peak}
        self.devices: list = []

    def _read(self, what, device):
        self.devices.append(device)
        return self.figures[what]

    def allocated(self, device):
        return self._read("allocated", device)

    def reserved(self, device):
        return self._read("reserved", device)

    def peak(self, device):
        return self._read("peak", device)
