"""``hsd bench ...``: the benchmark subcommands. Each is a thin shell around one module of
``benchmarks/``, imported only when it runs."""

from __future__ import annotations

import sys

from common.run.config import ConfigError
from hsd.shared import add_config_args, config_of, require_model


def cmd_bench(args) -> int:
    if args.remote:
        if args.rounds != 1:
            print("error: --rounds applies to the shm path; --remote measures NIXL reads once", file=sys.stderr)
            return 2
        from benchmarks.remote_transport import run_remote_bench
        return run_remote_bench(slot_mb=args.slot_mb if args.slot_mb is not None else 16.0, seconds=args.seconds,
                                as_json=args.json)
    from benchmarks.transport import run_transport_bench
    if args.slot_mb is None:
        args.slot_mb = 64.0
    return run_transport_bench(slot_mb=args.slot_mb, as_json=args.json, seconds=args.seconds, rounds=args.rounds)


def cmd_bench_dispatcher(args) -> int:
    from benchmarks.dispatcher_load import DispatcherLoadOptions, run_dispatcher_load
    options = DispatcherLoadOptions(jobs=args.jobs, epochs=args.epochs, targets=args.targets, drafters=args.drafters,
                                    slots=args.slots, dir=args.dir)
    return run_dispatcher_load(options, as_json=args.json)


def cmd_bench_scale(args) -> int:
    from benchmarks.scale import ScaleOptions, run_scale_bench
    from benchmarks.scale_model import GpuModel, parse_loads, parse_workers
    try:
        model = GpuModel(tokens_per_s=args.tokens_per_s, job_tokens=args.job_tokens,
                         drafter_batches_per_s=args.drafter_rate)
        workers = parse_workers(args.workers)
        loads = parse_loads(args.load)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not (args.seconds > 0 and args.warmup >= 0 and args.clients >= 1):
        raise ConfigError("--seconds must be positive, --warmup not negative and --clients at least 1")
    if args.heartbeat_s is not None and not args.heartbeat_s > 0:
        raise ConfigError("--heartbeat-s must be positive")
    if not args.drafter_fraction > 0:
        raise ConfigError("--drafter-fraction must be positive")
    options = ScaleOptions(workers=tuple(workers), seconds=args.seconds, warmup_s=args.warmup, clients=args.clients,
                           model=model, heartbeat_s=args.heartbeat_s, work_dir=args.dir, seed=args.seed,
                           same_host=args.same_host, loads=tuple(loads), floor=not args.no_floor,
                           drafter_fraction=args.drafter_fraction)
    return run_scale_bench(options, as_json=args.json)


def cmd_bench_pipeline(args) -> int:
    from benchmarks.pipeline import run_pipeline_bench
    try:
        return run_pipeline_bench(topology=args.topology, samples=args.samples, epochs=args.epochs, seed=args.seed,
                                  as_json=args.json, plot=args.plot, overrides=args.overrides,
                                  runs_dir=args.runs_dir)
    except RuntimeError as exc:  # a policy's run failed: its log tail says why
        print(f"hsd bench pipeline: error: {exc}", file=sys.stderr)
        return 1


def cmd_bench_chaos(args) -> int:
    from benchmarks.chaos import run_chaos_bench
    return run_chaos_bench(minutes=args.minutes, seed=args.seed, real=args.real, as_json=args.json,
                           work_dir=args.dir, inputs_dir=args.inputs, keep=args.keep)


def cmd_bench_corruption(args) -> int:
    if args.trials < 1:
        raise ConfigError("--trials must be positive")
    from benchmarks.corruption import run_corruption_bench
    return run_corruption_bench(trials=args.trials, seed=args.seed, work_dir=args.dir, as_json=args.json,
                                keep=args.keep)


def cmd_bench_balance(args) -> int:
    from benchmarks.step_balance import SETUPS, run_balance_bench
    return run_balance_bench(setups=tuple(args.setup or SETUPS), ranks=args.ranks, epochs=args.epochs, accum_steps=args.accum_steps, seed=args.seed,
                             inputs_dir=args.inputs,
                             work_dir=args.dir, as_json=args.json)


def cmd_bench_target(args) -> int:
    config = config_of(args)
    require_model(config, "bench target")
    if args.tp_sizes:
        from benchmarks.tp_target import run_tp_bench
        return run_tp_bench(config, args.tp_sizes, as_json=args.json, warmup=args.warmup, reps=args.reps,
                            num_samples=args.samples, median=args.median, sigma=args.sigma, seed=args.seed)
    from benchmarks.target_capture import run_target_bench
    return run_target_bench(config, as_json=args.json, warmup=args.warmup, reps=args.reps, num_samples=args.samples,
                            median=args.median, sigma=args.sigma, seed=args.seed)


def cmd_bench_gradsync(args) -> int:
    from benchmarks.gradient_sync import run_gradient_sync_bench
    if args.layers < 1 or args.reps < 1 or min(args.hidden) < 1:
        raise ConfigError("--hidden, --layers and --reps must be positive")
    return run_gradient_sync_bench(hidden=args.hidden, layers=args.layers, reps=args.reps, as_json=args.json)


def cmd_bench_gpu(args) -> int:
    """The preflight first, with the standard library alone: whatever the image lacks, it is written."""
    from benchmarks.gpu_preflight import preflight, write_alone
    facts = preflight()
    try:
        from benchmarks.gpu import run_gpu_bench
    except ImportError as exc:
        written = write_alone(facts, args.out, args.bundle)
        print(f"hsd bench gpu: error: the check cannot be imported here ({type(exc).__name__}: {exc}); "
              f"missing: {', '.join(facts['missing']) or 'nothing hsd lists'}; the preflight: "
              f"{', '.join(map(str, written)) or 'give --out DIR to keep it'}", file=sys.stderr)
        return 1
    only = [name for part in args.only for name in part.split(",") if name] if args.only else None
    return run_gpu_bench(as_json=args.json, budget_s=args.budget_s, only=only, out=args.out, bundle=args.bundle,
                         facts=facts)


def cmd_bench_dflash(args) -> int:
    from benchmarks.dflash_step import run_dflash_bench
    return run_dflash_bench(hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                            kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab,
                            num_target_layers=args.target_layers, num_capture=args.capture_layers,
                            num_draft_layers=args.draft_layers, block_size=args.block_size, seq_lens=args.seq_lens,
                            anchors=args.anchors, batch_tokens=args.batch_tokens, reps=args.reps,
                            device=args.device, as_json=args.json)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("transport", help="hidden-state handoff bandwidth and control-plane latency")
    b.add_argument("--slot-mb", type=float, help="hidden-state MiB per slot (default 64, 16 with --remote)")
    b.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    b.add_argument("--rounds", type=int, default=1,
                   help="rounds of memcpy, memcpy beside another copy and shm, alternated; medians reported")
    b.add_argument("--remote", action="store_true",
                   help="slot reads across nodes through NIXL beside a ZeroMQ copy (needs hsdispatch[multinode])")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("target", help="slot fill and capture tokens/s on a lognormal length mix, per batching, "
                                        "vs a plain Hugging Face forward")
    add_config_args(b, required=True)
    b.add_argument("--warmup", type=int, default=1, help="untimed passes per bucket")
    b.add_argument("--reps", type=int, default=3, help="jobs timed per bucket (drawn from the schedule)")
    b.add_argument("--samples", type=int, default=20_000, help="samples of the length mix")
    b.add_argument("--median", type=float, default=400.0, help="median sample length (lognormal)")
    b.add_argument("--sigma", type=float, default=0.9, help="sigma of the log length (the tail's weight)")
    b.add_argument("--seed", type=int, default=0, help="seed of the lengths, tokens and timed jobs")
    b.add_argument("--tp-sizes", type=int, nargs="+", metavar="K",
                   help="instead: capture tokens/s per GPU of the target at each tensor-parallel size (e.g. 1 2)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_target)
    b = bench.add_parser("dflash", help="DFlash micro-batch cost by sequence length and anchor count")
    for flag, default in (("hidden", 64), ("intermediate", 128), ("heads", 4), ("kv-heads", 2), ("head-dim", 16),
                          ("vocab", 512), ("target-layers", 8), ("capture-layers", 3), ("draft-layers", 1),
                          ("block-size", 16), ("batch-tokens", 1024), ("reps", 3)):
        b.add_argument(f"--{flag}", type=int, default=default)
    b.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256, 512])
    b.add_argument("--anchors", type=int, nargs="+", default=[16, 64])
    b.add_argument("--device", default="cpu")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_dflash)
    b = bench.add_parser("gradsync", help="a data-parallel step's gradient sum: one collective per tensor vs buckets")
    b.add_argument("--hidden", type=int, nargs="+", default=[128, 512, 1024])
    b.add_argument("--layers", type=int, default=5)
    b.add_argument("--reps", type=int, default=10)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_gradsync)
    b = bench.add_parser("gpu", help="every GPU path in one run: IPC and pinned copies, capture, DFlash step, launch")
    b.add_argument("--budget-s", type=float, default=450.0, help="time budget of the whole check (seconds)")
    b.add_argument("--only", nargs="+", metavar="SECTION", help="run only these sections (see hsd bench gpu's "
                   "module docstring: cuda_ipc_tests auto_choice nccl_init ipc_handoff ... nccl_group)")
    b.add_argument("--out", metavar="DIR", help="write each section's JSON here as soon as it ends (NN-name.json), "
                                                 "a failed section's logs beside it")
    b.add_argument("--bundle", metavar="DIR", help="after every section also rewrite DIR/bench-gpu.json (all "
                                                    "sections so far) and DIR/bench-gpu.tar.gz (the --out files)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_gpu)
    b = bench.add_parser("dispatcher", help="the dispatcher core under simulated load: latency, restart, memory")
    b.add_argument("--jobs", type=int, default=1_000_000, help="jobs per epoch")
    b.add_argument("--epochs", type=int, default=3)
    b.add_argument("--targets", type=int, default=4)
    b.add_argument("--drafters", type=int, default=3)
    b.add_argument("--slots", type=int, default=24)
    b.add_argument("--dir", default="", help="where to create the temporary run directory")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_dispatcher)
    b = bench.add_parser("scale", help="one real dispatcher process against up to 1,000+ simulated workers over "
                                       "ZeroMQ: CPU per item, request latency, GPUs one core serves")
    b.add_argument("--workers", default="16,64,256,1024", help="the sweep: workers (targets + drafters) per step")
    b.add_argument("--seconds", type=float, default=5.0, help="measured window of each step")
    b.add_argument("--warmup", type=float, default=2.0, help="seconds after every worker registered, unmeasured")
    b.add_argument("--clients", type=int, default=2, help="client processes the workers are spread over")
    b.add_argument("--tokens-per-s", type=float, default=27_000.0, help="prefill tokens/s of one target GPU")
    b.add_argument("--job-tokens", type=int, default=16_384, help="tokens of a job (schedule.tokens_per_batch)")
    b.add_argument("--drafter-rate", type=float, default=5.0, help="micro-batches (jobs) a drafter GPU trains a second")
    b.add_argument("--heartbeat-s", type=float, help="dispatcher.heartbeat_s (default: the config's, 0.5)")
    b.add_argument("--load", default="1", help="multiples of the GPU model's rates, a step each: a worker then "
                   "sends the requests of that many (its jobs and heartbeats come that much more often), so "
                   "the traffic of thousands of GPUs fits in the connections the clients hold")
    b.add_argument("--same-host", action="store_true", help="workers register from this host (the dispatcher then "
                   "checks each one's process every sweep) rather than from hosts of their own")
    b.add_argument("--drafter-fraction", type=float, default=1.0, help="drafters as a fraction of what keeps up "
                   "with the targets (below 1: a drafter-bound run, the pool full, every target waiting for a slot)")
    b.add_argument("--no-floor", action="store_true", help="skip the socket floor after each step (a bare ZeroMQ "
                   "echo answering the step's connections at its request rate)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dir", default="", help="where to create the temporary run directories")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_scale)
    b = bench.add_parser("pipeline", help="fair dispatcher vs per-target queues vs random pool, on sim workers")
    b.add_argument("--topology", default="5x3", help="TARGETSxDRAFTERS")
    b.add_argument("--epochs", type=int, default=1)
    b.add_argument("--samples", type=int, default=1500, help="synthetic samples of the epoch")
    b.add_argument("--seed", type=int, default=0, help="run seed: the samples and every schedule follow from it")
    b.add_argument("--json", action="store_true")
    b.add_argument("--plot", metavar="FILE.png", help="write the bucket mix and utilization plots (needs matplotlib)")
    b.add_argument("--runs-dir", help="keep the three run directories here (default: a temporary one, removed)")
    b.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every policy")
    b.set_defaults(func=cmd_bench_pipeline)
    b = bench.add_parser("chaos", help="a multi-epoch run under seeded SIGKILLs of every role, attaches and detaches")
    b.add_argument("--minutes", type=float, default=3.0, help="length of the chaos window")
    b.add_argument("--seed", type=int, default=0, help="seed of the run and of the fault plan")
    b.add_argument("--real", action="store_true", help="the demo's tiny target and a group of 2 DFlash drafters")
    b.add_argument("--inputs", default="runs/demo", help="--real: where the tiny target and data are (made once)")
    b.add_argument("--dir", help="work directory (kept); default a temporary one, removed")
    b.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_chaos)
    b = bench.add_parser("corruption", help="one flipped byte in a run's journal, snapshot or checkpoint, then a "
                                            "relaunch: exactly once, or refused naming the file")
    b.add_argument("--trials", type=int, default=20, help="trials, each a copy of the stopped base run")
    b.add_argument("--seed", type=int, default=0, help="seed of the files and offsets damaged")
    b.add_argument("--dir", help="work directory; default a temporary one, removed unless a trial failed")
    b.add_argument("--keep", action="store_true", help="keep every trial's run directory")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_corruption)
    b = bench.add_parser("balance", help="all-reduce wait of a DFlash group, count- vs cost-balanced steps")
    b.add_argument("--setup", action="append", choices=("modeled", "dflash"),
                   help="modeled (sim targets, linear ranks with a modeled DFlash cost) or dflash (the demo's "
                        "tiny target and DFlash ranks); repeatable; default both")
    b.add_argument("--ranks", type=int, default=2, help="drafter ranks of the group (default 2)")
    b.add_argument("--epochs", type=int, default=3, help="epochs of each run (default 3)")
    b.add_argument("--accum-steps", type=int, default=4, help="drafter.accum_steps: a step is this x --ranks jobs")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--inputs", default="runs/demo", help="where the demo's tiny target and data are (made once)")
    b.add_argument("--dir", help="work directory (kept); default a temporary one, removed")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_balance)
