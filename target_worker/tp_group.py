"""A tensor-parallel target group: ``target.tp_size`` processes, one per GPU, that are one target.

Rank 0 is the ``hsd target`` process: it alone registers with the dispatcher, takes jobs, writes
slots and reports them. It hosts the group's ``TCPStore`` on 127.0.0.1 (a group lives on one
node) and starts ranks 1..k-1 itself, as children that die with it, with the same command plus
``--tp-rank r --tp-store HOST:PORT``. Every rank joins one ``torch.distributed`` group (gloo on
the CPU; ``cpu:gloo,cuda:nccl`` on GPUs) and loads the target through Hugging Face's tensor-parallel
loading (:func:`target_worker.capture.load_target_model`), which reads each rank's shard only.

Per job, rank 0 publishes the padded token batch in the store under the job's sequence number
(:meth:`TargetGroup.share`): a broadcast that the other ranks, idle between jobs, wait on without
holding a collective open (so a rank 0 waiting for the dispatcher never trips a collective
timeout). Every rank then runs the forward, whose collectives are the plan's all-reduces; rank 0
writes its copy of the captured layers (whole on every rank under the plans
:mod:`common.run.tensor_parallel` accepts).

**One incarnation at a time.** A rank that dies makes the others' next collective fail (gloo sees
the closed socket); one that hangs makes it time out after ``target.tp_timeout_s`` (a watchdog
ends a rank whose forward outlives that by a margin, as NCCL's collectives do not return by
themselves). Rank 0 then reports the job in flight failed — the dispatcher gives it back once and
never publishes the half-written slot — stops its other ranks and exits with
:data:`EXIT_GROUP_LOST`; ``hsd launch`` restarts the group as a whole. A rank other than 0 whose
collective or store fails simply exits: its group is over, and rank 0 (or its death) says so.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import struct
import subprocess
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch
import torch.distributed as dist

from common import faults
from common.child_process import die_with_parent
from common.wire import messages

log = logging.getLogger("hsd.target")

EXIT_GROUP_LOST = 6  # rank 0's exit code when a rank of its group died or hung: restart the whole group
LOAD_TIMEOUT_S = 3600.0  # collectives while the shards load (ranks read their files at their own pace)
STOP_GRACE_S = 10.0  # how long rank 0 waits for its other ranks to leave before it kills them
WATCHDOG_MARGIN_S = 10.0  # past the collective timeout: a forward still running then is stuck for good
POLL_FIRST_S, POLL_MAX_S = 0.0005, 0.02  # a waiting rank looks for the next batch this often (backing off)
STOP_KEY = "hsd/tp/stop"
_HEAD = struct.Struct("<qqq")  # job id, sequences, sequence length
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0"}  # no SIGABRT from the watchdog: our own one bounds every wait


class TargetGroupLost(RuntimeError):
    """A rank of this target group died or hung: the group's incarnation is over."""


@dataclass
class SharedBatch:
    """One job's tokens as every rank of the group runs them."""

    job_id: int
    input_ids: torch.Tensor       # [num_seqs, seq_len] int64
    attention_mask: torch.Tensor  # [num_seqs, seq_len] int64


def _job_key(sequence: int) -> str:
    return f"hsd/tp/job/{sequence}"


def encode_batch(job_id: int, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bytes:
    num_seqs, seq_len = input_ids.shape
    return (_HEAD.pack(job_id, num_seqs, seq_len) + input_ids.numpy().astype(np.int64).tobytes()
            + attention_mask.numpy().astype(np.uint8).tobytes())


def decode_batch(payload: bytes) -> SharedBatch:
    job_id, num_seqs, seq_len = _HEAD.unpack_from(payload)
    tokens = num_seqs * seq_len
    ids = np.frombuffer(payload, dtype=np.int64, count=tokens, offset=_HEAD.size).reshape(num_seqs, seq_len)
    mask = np.frombuffer(payload, dtype=np.uint8, count=tokens, offset=_HEAD.size + 8 * tokens)
    return SharedBatch(job_id, torch.from_numpy(ids.copy()),
                       torch.from_numpy(mask.astype(np.int64)).view(num_seqs, seq_len))


def rank_device(rank: int, gpus: list[int]) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` when ``hsd launch`` pinned the group's GPUs
    (CUDA_VISIBLE_DEVICES lists them), else ``target.gpus[rank]``, else the CPU."""
    if not gpus:
        return torch.device("cpu")
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return torch.device("cuda", rank if visible else gpus[rank])


def _gloo_on_loopback() -> None:
    """Gloo picks its interface from the hostname unless told: the group's own loopback, like its store."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


class TargetGroup:
    """This process's membership of its target group (rank 0 also owns the store and the other ranks)."""

    def __init__(self, *, rank: int, size: int, store: dist.TCPStore, device: torch.device, timeout_s: float,
                 run_dir: str, children: list[subprocess.Popen] | None = None, gpus: list[int] | None = None):
        self.rank, self.size, self.store, self.device = rank, size, store, device
        self.gpus = list(gpus or [])  # target.gpus: each rank's, where CUDA_VISIBLE_DEVICES does not say
        self.timeout_s = timeout_s
        self.run_dir = run_dir
        self.children = children or []
        self.sequence = 0  # the last batch shared (rank 0) or run (the others)
        self.jobs_run = 0
        self._watchdog: threading.Timer | None = None
        self._closed = False

    # -- forming ------------------------------------------------------------------------------------
    @classmethod
    def start(cls, *, size: int, rank_command: list[str], device: torch.device, timeout_s: float,
              run_dir: str, gpus: list[int] | None = None) -> TargetGroup:
        """Rank 0: host the store, start ranks 1..size-1 (``rank_command`` plus ``--tp-rank r
        --tp-store HOST:PORT``), and join the group with them."""
        if device.type == "cpu" and torch.cuda.is_available():
            from common.run.config import ConfigError
            raise ConfigError("target.gpus is empty on a host with CUDA: Hugging Face's tensor-parallel loading "
                              "shards over the host's accelerator, so a target group runs on GPUs here; list "
                              "target.tp_size GPUs a group in target.gpus")
        store = dist.TCPStore("127.0.0.1", 0, world_size=size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S))
        address = f"127.0.0.1:{store.port}"
        children = [subprocess.Popen([*rank_command, "--tp-rank", str(r), "--tp-store", address],
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
                    for r in range(1, size)]
        log.info("target group of %d ranks: store %s, ranks 1..%d are pids %s", size, address, size - 1,
                 [c.pid for c in children])
        group = cls(rank=0, size=size, store=store, device=device, timeout_s=timeout_s, run_dir=run_dir,
                    children=children, gpus=gpus)
        try:
            group._join()
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def join(cls, *, rank: int, size: int, store_address: str, device: torch.device, timeout_s: float,
             run_dir: str) -> TargetGroup:
        """A rank other than 0: connect to rank 0's store and join the group."""
        host, _, port = store_address.rpartition(":")
        store = dist.TCPStore(host, int(port), world_size=size, is_master=False,
                              timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S))
        group = cls(rank=rank, size=size, store=store, device=device, timeout_s=timeout_s, run_dir=run_dir)
        group._join()
        return group

    def _join(self) -> None:
        _gloo_on_loopback()
        on_gpu = self.device.type == "cuda"
        # Hugging Face's tensor-parallel loading binds each rank to the device LOCAL_RANK names.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.size),
                          LOCAL_RANK=str(self.device.index if on_gpu else self.rank))
        if on_gpu:
            for key, value in NCCL_ENV.items():
                os.environ[key] = value
            torch.cuda.set_device(self.device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", store=self.store, rank=self.rank,
                                world_size=self.size, timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S),
                                device_id=self.device if on_gpu else None)

    def loaded(self) -> None:
        """The shards are loaded: from now on a collective waits at most ``timeout_s``."""
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout_s))
        self.store.set_timeout(datetime.timedelta(seconds=self.timeout_s))

    # -- jobs ---------------------------------------------------------------------------------------
    def share(self, job_id: int, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Rank 0: publish the next job's tokens to the group (after checking that every rank lives)."""
        self.check_ranks()
        self.sequence += 1
        try:
            self.store.set(_job_key(self.sequence), encode_batch(job_id, input_ids.cpu(), attention_mask.cpu()))
        except (RuntimeError, dist.DistError) as exc:
            raise TargetGroupLost(f"cannot publish job {job_id} to the group's store: {exc}") from exc

    def forwarded(self) -> None:
        """Rank 0, after a forward: every rank has read the batch (they ran its collectives): drop it."""
        self.store.delete_key(_job_key(self.sequence))

    def ranks(self) -> list[messages.TargetRank]:
        """Rank 0: every rank of the group, as the dispatcher shows them."""
        pids = [os.getpid()] + [c.pid for c in self.children]
        return [messages.TargetRank(rank=r, pid=pid, gpu=self._gpu_of(r)) for r, pid in enumerate(pids)]

    def _gpu_of(self, rank: int) -> int | None:
        """Rank ``rank``'s GPU as the host numbers it (the way :func:`rank_device` chose it)."""
        if self.device.type != "cuda":
            return None
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible:
            return int(visible[rank]) if rank < len(visible) and visible[rank].isdigit() else None
        return self.gpus[rank] if rank < len(self.gpus) else None

    def check_ranks(self) -> None:
        for rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is not None:
                raise TargetGroupLost(f"rank {rank} of the target group (pid {child.pid}) exited with code {code}")

    def next_batch(self) -> SharedBatch | None:
        """A rank other than 0: wait for rank 0's next batch (None: the group is stopping)."""
        key = _job_key(self.sequence + 1)
        pause = POLL_FIRST_S
        while True:
            if self.store.check([key]):
                self.sequence += 1
                return decode_batch(self.store.get(key))
            if self.store.check([STOP_KEY]):
                return None
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)

    def arm(self, job_id: int) -> None:
        """Before a forward: a watchdog ends this process should the forward never return (a rank
        hangs and the collective backend does not give up by itself)."""
        timer = threading.Timer(self.timeout_s + WATCHDOG_MARGIN_S, self._stuck, args=(job_id,))
        timer.daemon = True
        timer.start()
        self._watchdog = timer

    def inside_forward(self) -> None:
        """A test's forced fault (``target_rank_fault``) fires here, in this rank's forward."""
        faults.target_rank_fault(self.rank, self.jobs_run + 1, run_dir=self.run_dir)

    def disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.jobs_run += 1

    def _stuck(self, job_id: int) -> None:
        log.error("rank %d of the target group: the forward of job %d has not returned %.0fs past "
                  "target.tp_timeout_s: ending this incarnation", self.rank, job_id, WATCHDOG_MARGIN_S)
        self._stop_children()
        logging.shutdown()
        os._exit(EXIT_GROUP_LOST if self.rank == 0 else 1)

    # -- leaving ------------------------------------------------------------------------------------
    def _stop_children(self) -> None:
        live = [c for c in self.children if c.poll() is None]
        for child in live:  # a stopped rank (SIGSTOP) acts on SIGTERM only once continued
            for signum in (signal.SIGTERM, signal.SIGCONT):
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for child in live:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d of the target group did not stop: killing it", child.pid)
                child.kill()
                child.wait()

    def close(self, *, clean: bool = True) -> None:
        """Leave the group. Rank 0: tell the other ranks to leave (``clean``: they finished; else the
        group is lost and they are stopped at once), wait for them, then stop serving the store."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and self.children:
            if clean:
                try:
                    self.store.set(STOP_KEY, b"1")
                    deadline = time.monotonic() + STOP_GRACE_S
                    for child in self.children:
                        child.wait(timeout=max(0.1, deadline - time.monotonic()))
                except (RuntimeError, dist.DistError, subprocess.TimeoutExpired):
                    pass
            self._stop_children()
        if dist.is_initialized():
            if clean:
                dist.destroy_process_group()
            else:  # a dead peer never joins a destroy: abort the communicators instead
                dist.distributed_c10d._abort_process_group()
