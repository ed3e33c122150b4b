"""The data plane: slot layouts and views, the shm arena, CUDA IPC, NIXL, host staging and the transports built on them."""
