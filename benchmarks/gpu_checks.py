"""The correctness sections of ``hsd bench gpu``: what a first GPU host must show works, each cheap.

- ``cuda_ipc_tests``: the CUDA tests of ``tests/common`` (from a checkout), under pytest;
- ``pin_refusal``: a ``cudaHostRegister`` the runtime refuses, and the kernel launched after it;
- ``auto_choice``: ``pool.transport=auto`` here, for CPU and for GPU workers, and a short launch of
  CPU (sim) workers under ``auto`` on this GPU host (the run that crash-looped before);
- ``nccl_init``: a 1-rank NCCL group built with ``device_id`` (eagerly) and destroyed, three times;
- ``eagle3_step``: EAGLE-3 optimizer steps through the backend on the GPU: tok/s, peak memory;
- ``resume``: DFlash and EAGLE-3 backends checkpointed after two steps and resumed in fresh
  backends: the next steps' losses against an uninterrupted run, the fused AdamW state on the
  GPU, and whether the CUDA RNG state came back;
- ``flex_recompiles``: graphs dynamo compiles for DFlash micro-batches of changing shapes.

Every section's inputs are built here (:func:`benchmarks.gpu_launch.write_launch_inputs`'s small
random Qwen3 and token data): nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_sections import CheckContext, Skip
from common.run.drafter_family import families, family_of

REPO = Path(__file__).resolve().parent.parent
CUDA_TESTS = ("tests/common/test_cuda_ipc.py", "tests/common/test_cuda_ipc_cache.py", "tests/common/test_shm_pinning.py")


def cuda_ipc_tests(ctx: CheckContext) -> dict[str, Any]:
    """pytest on the CUDA IPC and pinning tests; their counts, and the log kept when one fails."""
    missing = [t for t in CUDA_TESTS if not (REPO / t).is_file()]
    if missing:
        raise Skip(f"{', '.join(missing)} not here: run hsd bench gpu from a checkout")
    log_path = ctx.tmp / "cuda-ipc-tests.log"
    with open(log_path, "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               f"--basetemp={ctx.tmp / 'pytest'}", *CUDA_TESTS], cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, timeout=max(30.0, min(180.0, ctx.left_s())))
    text = log_path.read_text(errors="replace")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1])}
    figures = {"exit_code": proc.returncode, **counts}
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited {proc.returncode}: {text.splitlines()[-1]} (log: {log_path})")
    return figures


def pin_refusal(ctx: CheckContext) -> dict[str, Any]:
    """The shm pool pinned, then pinned again (the runtime refuses a range registered twice): the
    pool's own path clears that error, so the next kernel runs; a raw refusal left pending is what
    the next kernel's launch check would report instead."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    import secrets
    from benchmarks.transport import bench_layout
    from common.dataplane.shm_arena import SlotArena

    def kernel_error() -> str | None:
        try:
            (torch.ones(1024, device=ctx.device) + 1).sum().item()
            return None
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
    with SlotArena.create(f"gpuchk{secrets.token_hex(3)}", bench_layout(4.0), 2, pin_device=ctx.device) as arena:
        mapping = arena._mapping
        figures: dict[str, Any] = {"pinned": arena.pinned, "runtime_found": mapping.runtime is not None
                                   and mapping.runtime.clear_last_error() is not None}
        if not arena.pinned:
            raise RuntimeError("the pool could not be pinned in the first place")
        mapping.pin(ctx.device)  # refused, and cleared
        figures["kernel_error_after_pool_refusal"] = kernel_error()
        err = mapping.runtime.host_register(mapping.pinned_ptr, mapping.base.numel(), ctx.device)
        figures["raw_refusal"] = mapping.runtime.error_string(err) if err else None
        figures["kernel_error_after_raw_refusal"] = kernel_error()  # torch reads the pending error here
        mapping.runtime.clear_last_error()
        figures["kernel_error_after_clearing"] = kernel_error()
    figures["ok"] = figures["kernel_error_after_pool_refusal"] is None and figures["kernel_error_after_clearing"] is None
    return figures


def auto_choice(ctx: CheckContext) -> dict[str, Any]:
    """The transport auto picks here for CPU and GPU workers; then CPU workers launched under auto."""
    from benchmarks.gpu_launch import launch_run
    if not ctx.cuda:
        raise Skip("no CUDA")
    from common.dataplane.transport_info import choose_transport, probe_cuda_host
    host = probe_cuda_host()
    figures: dict[str, Any] = {"num_devices": host.num_devices if host else 0}
    if host is not None:
        figures["peer_access"] = [[a == b or bool(host.can_access_peer(a, b)) for b in range(host.num_devices)]
                                  for a in range(host.num_devices)]
    cpu = choose_transport("auto", True, cuda=host)
    gpu = choose_transport("auto", True, cuda=host, target_gpus=[0], drafter_gpus=[host.num_devices - 1 if host else 0])
    figures.update(cpu_workers=f"{cpu[0]}: {cpu[1]}", gpu_workers=f"{gpu[0]}: {gpu[1]}")
    run_dir = ctx.tmp / "auto-cpu-workers"
    overrides = [f"run.dir={run_dir}", "target.sim=true", "drafter.sim=true", "pool.transport=auto", "run.epochs=1",
                 "data.synthetic_samples=64", "schedule.buckets=[128,512]",
                 "schedule.tokens_per_batch=512", "pool.slots=4", "pool.min_ready=1", "drafter.accum_steps=2",
                 "target.max_restarts=0", "drafter.max_restarts=0"]
    run = launch_run(run_dir, overrides, timeout_s=max(20.0, min(90.0, ctx.left_s())))
    log = (run_dir / "logs" / "dispatcher.log").read_text(errors="replace")
    chosen = re.search(r"pool.transport=auto chose (\S+): (.*)", log)
    figures["cpu_launch"] = {**run, "chose": f"{chosen[1]}: {chosen[2]}" if chosen else None}
    figures["ok"] = (cpu[0] == "shm" and run["exactly_once"] and bool(chosen) and chosen[1] == "shm"
                     and (gpu[0] == "cuda_ipc" or host is None))
    return figures


NCCL_SCRIPT = """
import json, time, torch, torch.distributed as dist
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
rounds = []
for i in range(3):
    t0 = time.perf_counter()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    t1 = time.perf_counter()
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    ok = bool(x[0].item() == 1.0)
    dist.destroy_process_group()
    t3 = time.perf_counter()
    rounds.append({"init_s": round(t1 - t0, 3), "all_reduce_s": round(t2 - t1, 4), "destroy_s": round(t3 - t2, 3), "sum_ok": ok})
print(json.dumps({"nccl_version": str(torch.cuda.nccl.version()), "rounds": rounds}))
"""


def nccl_init(ctx: CheckContext) -> dict[str, Any]:
    """A 1-rank NCCL group: init (device_id: the communicator is built at once), an all-reduce, destroy; x3."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    log_path = ctx.tmp / "nccl-init.log"
    try:
        proc = subprocess.run([sys.executable, "-c", NCCL_SCRIPT], capture_output=True, text=True,
                              timeout=max(20.0, min(120.0, ctx.left_s())))
    except subprocess.TimeoutExpired as exc:
        log_path.write_text(f"{exc.stdout or ''}\n{exc.stderr or ''}")
        raise RuntimeError(f"NCCL init/destroy did not finish within {exc.timeout:.0f}s (a hang)") from None
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["ok"] = len(figures["rounds"]) == 3 and all(r["sum_ok"] for r in figures["rounds"])
    return figures


# -- the drafter backends on the GPU ---------------------------------------------------------
def _backend_config(ctx: CheckContext, objective: str, run_dir: Path):
    from benchmarks.gpu_launch import write_launch_inputs
    from common.run.config import load_config
    target_dir, data_dir = write_launch_inputs(ctx.tmp / "launch-inputs", num_samples=ctx.shapes.launch_samples,
                                               hidden=ctx.shapes.launch_hidden)
    common = [f"run.dir={run_dir}", f"target.model={target_dir}", f"data.path={data_dir}", "drafter.checkpoint_keep=2",
              *(["target.gpus=[0]", "drafter.gpus=[0]"] if ctx.cuda else [])]  # bf16 states on a GPU, as a run has
    return load_config(None, [*common, f"drafter.objective={objective}", *family_of(objective).check_overrides])


def _backend(ctx: CheckContext, config):
    from drafter_worker.factory import trainer_backend
    return trainer_backend(config, "drafter-0", device=ctx.device, schedule_jobs=64)


def _batches(ctx: CheckContext, config, count: int, *, batch: int = 4, seq_len: int = 64) -> list:
    """Random micro-batches of the backend's contract, on the device (as the transport hands them over)."""
    from common.run.capture_contract import contract_from_config
    from common.dataplane.slots import SlotBatch, SlotHeader
    from common.wire import messages
    contract = contract_from_config(config)
    width, dtype = contract.row_width, getattr(torch, contract.dtype)
    g = torch.Generator().manual_seed(1)
    out = []
    for job_id in range(count):
        hs = torch.randn(batch, seq_len, width, generator=g).to(dtype)
        ids = torch.randint(4, 300, (batch, seq_len), generator=g, dtype=torch.int32)
        mask = torch.ones(batch, seq_len, dtype=torch.uint8)
        mask[:, :4] = 0
        lens = torch.full((batch,), seq_len, dtype=torch.int32)
        header = SlotHeader(generation=1, job_id=job_id, bucket=0, batch_size=batch, seq_len=seq_len,
                            num_tokens=batch * seq_len)
        job = messages.Job(job_id=job_id, epoch=0, bucket=0, seq_len=seq_len, samples=list(range(batch)),
                           lengths=[seq_len] * batch, num_tokens=batch * seq_len, slot=0, generation=1)
        out.append((job, SlotBatch(*(t.to(ctx.device) for t in (hs, ids, mask, lens)), header)))
    return out


def _train(backend, jobs, steps: range, accum: int = 2) -> list[float]:
    losses = []
    for step in steps:
        window = jobs[accum * step:accum * step + accum]
        for job, batch in window:
            backend.micro_batch(job, batch)
        losses.append(float(backend.apply_step([job.job_id for job, _ in window])["loss"]))
    return losses


def eagle3_step(ctx: CheckContext) -> dict[str, Any]:
    """EAGLE-3 optimizer steps (2 micro-batches of 4 x 64 tokens, 3 TTT steps) through its backend."""
    config = _backend_config(ctx, "eagle3", ctx.tmp / "eagle3-step")
    backend = _backend(ctx, config)
    jobs = _batches(ctx, config, 12)
    started = time.perf_counter()
    first = _train(backend, jobs, range(1))
    warmup_s = time.perf_counter() - started
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    started = time.perf_counter()
    losses = _train(backend, jobs, range(1, 6))
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
    step_s = (time.perf_counter() - started) / 5
    tokens = 2 * 4 * 64
    figures: dict[str, Any] = {"device": str(backend.device), "warmup_s": round(warmup_s, 2),
                               "step_ms": round(step_s * 1e3, 1), "tok_s": round(tokens / step_s),
                               "loss_first": round(first[0], 4), "loss_last": round(losses[-1], 4),
                               "finite": all(map(lambda v: v == v and abs(v) != float("inf"), first + losses))}
    if ctx.cuda:
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 3)
    return figures


def _resume_one(ctx: CheckContext, objective: str) -> dict[str, Any]:
    config = _backend_config(ctx, objective, ctx.tmp / f"resume-{objective}")
    jobs = _batches(ctx, config, 8)
    reference = _train(_backend(ctx, config), jobs, range(4))
    first = _backend(ctx, config)
    _train(first, jobs, range(2))
    first.save_checkpoint(config.run_dir)
    cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.cuda else None
    optimizer = first.trainer.optimizer
    del first
    if ctx.cuda:
        torch.cuda.manual_seed(12345)  # a restarted process starts from another CUDA RNG state
    resumed = _backend(ctx, config)
    step = resumed.load_latest(config.run_dir)
    figures: dict[str, Any] = {"resumed_step": step}
    if cuda_rng is not None:
        figures["cuda_rng_restored"] = bool(torch.equal(torch.cuda.get_rng_state(ctx.device), cuda_rng))
    state = next(iter(resumed.trainer.optimizer.state.values()), {})
    figures["adamw_fused"] = bool(resumed.trainer.optimizer.param_groups[0].get("fused"))
    figures["adamw_state_devices"] = sorted({str(v.device) for v in state.values() if torch.is_tensor(v)})
    figures["adamw_fused_before"] = bool(optimizer.param_groups[0].get("fused"))
    after = _train(resumed, jobs, range(2, 4))
    figures["loss_diff_vs_uninterrupted"] = max(abs(a - b) for a, b in zip(after, reference[2:]))
    figures["exact"] = after == reference[2:]
    return figures


def resume(ctx: CheckContext) -> dict[str, Any]:
    """Both backends: two steps, a checkpoint, a fresh backend resumes it, two more steps vs straight through."""
    figures = {family.objective: _resume_one(ctx, family.objective) for family in families() if family.check_overrides}
    figures["ok"] = all(f["resumed_step"] == 2 and f["loss_diff_vs_uninterrupted"] < 1e-2
                        for f in figures.values() if isinstance(f, dict))
    return figures


def flex_recompiles(ctx: CheckContext) -> dict[str, Any]:
    """Dynamo's compiles for DFlash micro-batches whose shapes change from one to the next."""
    if not ctx.cuda:
        raise Skip("no CUDA (flex attention compiles on a GPU only)")
    from torch._dynamo.utils import counters
    config = _backend_config(ctx, "dflash", ctx.tmp / "flex-recompiles")
    backend = _backend(ctx, config)
    counters.clear()
    shapes = [(4, 64), (2, 128), (4, 96), (1, 256), (4, 64), (2, 128), (3, 80), (1, 256)]
    seconds, graphs = [], []
    for number, (batch, seq_len) in enumerate(shapes):
        (job, micro), = _batches(ctx, config, 1, batch=batch, seq_len=seq_len)
        job.job_id = number
        started = time.perf_counter()
        backend.micro_batch(job, micro)
        torch.cuda.synchronize(ctx.device)
        seconds.append(round(time.perf_counter() - started, 3))
        graphs.append(int(counters["stats"].get("unique_graphs", 0)))
    backend.drop_step()
    return {"attention": backend.trainer.model.attention, "shapes": [f"{b}x{s}" for b, s in shapes],
            "graphs_after_each": graphs, "graphs_total": graphs[-1], "recompiles_after_first": graphs[-1] - graphs[0],
            "seconds_each": seconds, "frames": dict(counters["frames"])}
