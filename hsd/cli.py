"""``hsd``: the command line of hsdispatch. Each subcommand is a thin shell around one module."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common.run.config import ConfigError, ScheduleSection, describe
from common.run.drafter_family import DEFAULT_OBJECTIVE, families
from common.run.durable import STORAGE_FAILED_EXIT_CODE, StorageFailed, describe_storage_failure, is_storage_error
from hsd.bench import add_bench_parser
from hsd.keys import add_keys_parser
from hsd.shared import add_config_args, config_of, require_model, setup_logging


def cmd_dispatcher(args) -> int:
    setup_logging()
    from dispatcher.build import serve_dispatcher
    return serve_dispatcher(config_of(args))


def cmd_worker(args) -> int:
    """``hsd target`` / ``hsd drafter``: one worker process. A data error (a prepared dataset that
    cannot be read as it is) makes it unusable: ``hsd launch`` does not restart it for that."""
    from common.run.prepared import DataError
    from common.worker.runtime import WorkerUnusable
    setup_logging()
    try:
        return _run_worker(args)
    except DataError as exc:
        raise WorkerUnusable(str(exc)) from exc


def _run_worker(args) -> int:
    config = config_of(args)
    if args.node:
        config.nodes.name = args.node
    role = args.command
    sim = args.sim or getattr(config, role).sim
    name = args.name or f"{role}-{os.getpid()}"
    if role == "target":
        from target_worker.loop import TargetLoop
        if args.tp_rank is not None:
            from target_worker.tp_rank import run_rank
            return run_rank(config, args.tp_rank, args.tp_store)
        if not sim and config.target.tp_size > 1:
            return _run_target_group(config, name, args.argv)
        return TargetLoop.from_config(config, name, _sim_target(config) if sim else _hf_target(config)).run()
    from drafter_worker.factory import drafter_backend, sim_drafter
    from drafter_worker.loop import DrafterLoop
    if sim:
        # An independent sim drafter trains a model of its own, named after it: a restart resumes it.
        return DrafterLoop.from_config(config, name, sim_drafter(config, model_id=name)).run()
    grouped = config.drafter.grouped
    # Every rank of a data-parallel group trains the group's one model (rank 0 writes its checkpoints);
    # an independent drafter trains a model of its own, named after it: a restart resumes it.
    model_id = config.drafter.model if grouped else name
    backend = drafter_backend(config, model_id=model_id)
    loop = DrafterLoop.from_config(config, name, backend, grouped=grouped)
    try:
        return loop.run()
    finally:
        backend.close()


def _run_target_group(config, name: str, argv: list[str]) -> int:
    """Rank 0 of a tensor-parallel target group: it starts the other ranks (this command with
    ``--tp-rank r``), is the group's one worker to the dispatcher, and ends with the group."""
    import logging

    from common.run.tensor_parallel import check_tensor_parallel
    from target_worker.loop import TargetLoop
    from target_worker.tp_group import EXIT_GROUP_LOST, TargetGroupLost
    from target_worker.tp_rank import start_group
    _require_real_target(config)
    check_tensor_parallel(config.target.model, config.target.tp_size)  # before any rank starts
    group = start_group(config, [sys.executable, "-m", "hsd.cli", *argv])
    clean = False
    try:
        loop = TargetLoop.from_config(config, name, _hf_target(config, group=group), group=group)
        code = loop.run()
        clean = True
        return code
    except TargetGroupLost as exc:
        logging.getLogger("hsd.target").error("%s: %s; this incarnation of the group ends (exit %d)", name, exc,
                                              EXIT_GROUP_LOST)
        return EXIT_GROUP_LOST
    finally:
        group.close(clean=clean)


def _sim_target(config):
    from target_worker.sim import SimTarget
    return SimTarget(config.target)


def _require_real_target(config) -> None:
    if not config.target.model:
        raise ConfigError("target.model: a real target needs the model directory (or use --sim)")
    if not config.data.path:
        raise ConfigError("data.path: a real target reads its samples from a prepared dataset (or use --sim)")


def _hf_target(config, group=None):
    """The Hugging Face capture backend on ``target.model``, reading samples from ``data.path``
    (``group``: rank 0 of a tensor-parallel group, joined)."""
    _require_real_target(config)
    import torch

    from common.run.prepared import check_tokenizer
    from target_worker.hf_backend import HFTargetBackend, default_device
    from target_worker.offline import open_dataset
    dataset = open_dataset(config.data.path)
    if hasattr(dataset, "fingerprint"):  # a dataset tokenized by another tokenizer is refused, naming both
        check_tokenizer(dataset, config.target.model)
    # hsd launch gives each worker one GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 in the worker.
    pinned = config.target.gpus and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip().isdigit()
    device = torch.device("cuda", 0) if pinned else default_device(config.target)
    return HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                           device=group.device if group is not None else device, dataset=dataset, group=group)


def cmd_launch(args) -> int:
    setup_logging("launch")
    from ops.launch import Launcher
    return Launcher(config_of(args)).run()


def cmd_schedule(args) -> int:
    from ops.schedule_view import print_schedule
    return print_schedule(config_of(args), lengths_file=args.lengths, data_dir=args.data, epoch=args.epoch,
                          as_json=args.json)


def cmd_stats(args) -> int:
    from ops.stats_view import run_stats
    if args.overrides and not args.config:
        raise ConfigError(f"hsd stats: overrides ({' '.join(args.overrides)}) go with --config")
    return run_stats(endpoint=args.endpoint, run_dir=args.run_dir, as_json=args.json, watch_s=args.watch,
                     config_path=args.config, overrides=args.overrides, keys_dir=args.keys, client=args.client,
                     secret=args.secret, rows=args.rows)


def cmd_report(args) -> int:
    from ops.report import build_report, format_report
    report = build_report(args.run_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def cmd_plan(args) -> int:
    from ops.planner import run_plan
    return run_plan(config_path=args.config, overrides=args.overrides, num_gpus=args.gpus, from_run=args.from_run,
                    target_params=args.target_params, gpu_memory_gb=args.gpu_memory_gb, reserve_gb=args.reserve_gb,
                    as_json=args.json)


def cmd_cleanup(args) -> int:
    from common.wire.client import run_id_for
    from common.dataplane.shm_segment import sweep_dead_segments
    if args.all_dead == bool(args.run_dir):
        raise ConfigError("give either --run-dir DIR (that run's segments) or --all-dead (every dead run's)")
    run_id = None
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise ConfigError(f"run directory {run_dir} does not exist")
        run_id = run_id_for(run_dir)
    removed = sweep_dead_segments(run_id)
    print(f"removed {len(removed)} segment(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def cmd_config(args) -> int:
    if args.config or args.overrides:
        import yaml
        print(yaml.safe_dump(config_of(args).to_dict(), sort_keys=False), end="")
    else:
        print(describe())
    return 0


def cmd_capture(args) -> int:
    config = config_of(args)
    require_model(config, "capture")
    from target_worker import offline
    summary = offline.capture_to_file(config, offline.open_dataset(args.data), num_samples=args.samples,
                                      out=args.out, progress=not args.quiet)
    skipped = f", {len(summary['skipped'])} longer than the last bucket skipped" if summary["skipped"] else ""
    print(f"captured {summary['samples']} samples ({summary['tokens']} tokens, {summary['jobs']} jobs) of layers "
          f"{summary['contract']['layer_ids']} to {summary['out']}{skipped}")
    return 0


def cmd_eval(args) -> int:
    from drafter_worker.eval_cli import run_eval
    return run_eval(config_of(args), drafter=args.drafter, num_prompts=args.prompts, prompts_file=args.prompts_file,
                    max_new_tokens=args.max_new_tokens, device=args.device, as_json=args.json)


def cmd_export(args) -> int:
    from common.run.servable import export_servable, find_checkpoint
    checkpoint = find_checkpoint(args.run_dir, model=args.model, step=args.step)
    out = export_servable(checkpoint, args.out, force=args.force, mask_token=args.mask_token)
    print(f"model {checkpoint.model_id} at step {checkpoint.step} exported to {out}")
    return 0


def cmd_prepare(args) -> int:
    setup_logging()
    from target_worker.prepare import prepare_dataset, rows_summary
    manifest = prepare_dataset(args.input, args.tokenizer, args.out, max_length=args.max_length,
                               per_turn=args.per_turn)
    print(f"{args.out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens "
          f"({manifest['num_loss_tokens']} in the loss); {rows_summary(manifest['rows'])}")
    return 0


def cmd_make_tiny(args) -> int:
    setup_logging()
    from target_worker.tiny import TinySpec, make_tiny
    spec = TinySpec() if args.steps is None else TinySpec(steps=args.steps)
    report = make_tiny(args.out, seed=args.seed, spec=spec)
    print(f"{args.out}: greedy answer token match on {report['heldout_turns']} held-out turns: "
          f"trained {report['match_rate_trained']:.3f}, untrained {report['match_rate_untrained']:.3f} "
          f"({report['seconds']['total']}s to build)")
    return 0


def cmd_regenerate(args) -> int:
    setup_logging()
    from target_worker.regenerate import regenerate_file
    counts = regenerate_file(config_of(args), args.input, args.out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, sample=args.sample, temperature=args.temperature)
    print(f"{args.out}: {counts['written']} rows regenerated, {counts['skipped']} skipped")
    return 0


def cmd_demo(args) -> int:
    setup_logging("demo")
    from ops.demo import run_demo
    return run_demo(out=args.out, config_path=args.config, overrides=args.overrides, samples=args.samples,
                    eval_prompts=args.eval_prompts, max_new_tokens=args.max_new_tokens, tiny_steps=args.tiny_steps,
                    objective=args.objective)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsd", description="hsdispatch: online drafter training with a dispatcher")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="start the dispatcher and all configured workers on this node")
    add_config_args(p)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("demo", help="tiny target -> its own answers -> online drafter training -> tau before/after")
    add_config_args(p)
    p.add_argument("--out", default="runs/demo", help="demo directory: target, data, run (default runs/demo)")
    p.add_argument("--samples", type=int, default=200, help="training prompts whose answers the target regenerates")
    p.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts of the tau evaluation")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per evaluation prompt")
    p.add_argument("--tiny-steps", type=int, help="training steps of the tiny target (default: its full recipe)")
    p.add_argument("--objective", choices=[f.objective for f in families() if f.demo], default=DEFAULT_OBJECTIVE,
                   help="drafter to train (default dflash; eagle3 runs deploy/configs/demo-eagle3.yaml)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("dispatcher", help="run the dispatcher daemon")
    add_config_args(p)
    p.set_defaults(func=cmd_dispatcher)

    for role in ("target", "drafter"):
        p = sub.add_parser(role, help=f"run one {role} worker (one per GPU)")
        add_config_args(p)
        p.add_argument("--sim", action="store_true", help=f"simulated {role} (same as {role}.sim=true)")
        p.add_argument("--name", help="worker name shown in stats and logs")
        p.add_argument("--node", help="the node it runs on (same as nodes.name=...; default the hostname)")
        if role == "target":
            p.add_argument("--tp-rank", type=int, help=argparse.SUPPRESS)  # set by a group's rank 0 for the others
            p.add_argument("--tp-store", help=argparse.SUPPRESS)
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("schedule", help="print the epoch schedule and its fairness figures")
    add_config_args(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--lengths", help="text file with one sequence length per line")
    source.add_argument("--data", help="prepared dataset directory")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("stats", help="query a running dispatcher's stats socket")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint", help="stats endpoint, e.g. ipc:///path/stats.sock")
    where.add_argument("--run-dir", help="run directory of the dispatcher (default: runs/demo)")
    where.add_argument("--config", help="the run's config (on another node: its copy, with that node's key pair "
                                        "as an override, e.g. curve.client_secret_key=keys/node-b.key_secret)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides (with --config)")
    p.add_argument("--keys", metavar="DIR", help="with --endpoint: CURVE keys from the directory hsd keys --out wrote")
    p.add_argument("--client", metavar="NAME", help="with --keys: this node's key pair (default: the only one in DIR)")
    p.add_argument("--secret", default="", help="with --endpoint: the run's dispatcher.secret")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    p.add_argument("--rows", type=int, default=64, metavar="N",
                   help="worker rows in the table (default 64); with more workers, a summary a role and the N "
                        "that most need a look (silent, then most idle); 0 shows every worker")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("report", help="run report from the journal: exactly-once, fairness, utilization")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plan", help="split N GPUs between targets and drafters from measured or modeled rates")
    add_config_args(p)
    p.add_argument("--gpus", type=int, required=True, help="GPUs to split (targets + drafters)")
    p.add_argument("--target-params", type=float, metavar="N",
                   help="the target's parameters (e.g. 70e9): its tensor-parallel size from its bf16 weights "
                        "(default: target.tp_size)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU (default 80)")
    p.add_argument("--reserve-gb", type=float, default=16.0,
                   help="per GPU, beside the weights: activations of a job, captured states, CUDA context (default 16)")
    p.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                   help="measure each stage's rate in this run's journal instead of the config's sim cost model")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("cleanup", help="remove shared-memory segments left by a dead run")
    p.add_argument("--run-dir", help="the run whose dead dispatchers' segments to remove")
    p.add_argument("--all-dead", action="store_true",
                   help="remove every hsdispatch segment whose creating dispatcher is gone, whatever its run")
    p.set_defaults(func=cmd_cleanup)

    add_keys_parser(sub)

    p = sub.add_parser("config", help="show every config key with its default, or the resolved config")
    add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("capture", help="capture the target's layers for a dataset's first samples into a file")
    add_config_args(p, required=True)
    p.add_argument("--data", required=True, help="prepared dataset directory")
    p.add_argument("--samples", type=int, required=True, help="capture samples 0..N-1 (dataset order)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_capture)
    p = sub.add_parser("eval", help="speculative decoding with a trained drafter: acceptance length tau")
    add_config_args(p, required=True)
    p.add_argument("--drafter", required=True,
                   help="exported drafter directory (config.json + model.safetensors), or a checkpoint's step directory")
    p.add_argument("--prompts", type=int, default=16, help="number of held-out prompts")
    p.add_argument("--prompts-file", help="ShareGPT JSONL of prompts (default: <target.model>/heldout.jsonl)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="copy a trained model's servable directory out of a run, for a serving engine")
    p.add_argument("--run-dir", required=True, help="the run directory (run.dir)")
    p.add_argument("--model", help="model id (run.dir/models/<model>); default: the run's only model")
    p.add_argument("--step", type=int, help="checkpoint step; default: the latest")
    p.add_argument("--out", required=True, help="directory to write (config.json + model.safetensors)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--mask-token", help="DFlash: the text the serving tokenizer has for the trained mask id, where "
                                        "the target's tokenizer named none (written as dflash_config.mask_token)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("prepare", help="tokenize conversations (JSONL/Parquet) into a prepared dataset directory")
    p.add_argument("--input", required=True, help="JSONL or Parquet file, or a folder of shards")
    p.add_argument("--tokenizer", required=True, help="local tokenizer directory (the target's)")
    p.add_argument("--out", required=True, help="dataset directory to write")
    last_bucket = ScheduleSection().buckets[-1]  # a longer sample fits no bucket of the default schedule
    p.add_argument("--max-length", type=int, default=last_bucket,
                   help=f"longer samples are skipped (default {last_bucket}, the default schedule's last bucket)")
    p.add_argument("--per-turn", action="store_true",
                   help="one sample per assistant turn, as the target saw it then (every turn's reasoning in the "
                        "loss), instead of one per conversation")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("make-tiny", help="build a tiny trained Qwen3 target, its tokenizer and a synthetic dataset")
    p.add_argument("--out", required=True, help="directory of the tiny target (reused when finished)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="training steps (default: the full recipe)")
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("regenerate", help="rewrite every assistant turn with the target's own answer")
    add_config_args(p, required=True)
    p.add_argument("--input", required=True, help="ShareGPT / messages JSONL")
    p.add_argument("--out", required=True, help="JSONL to write")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="conversations generated together")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample)")
    p.set_defaults(func=cmd_regenerate)

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"hsd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StorageFailed as exc:
        print(f"hsd {args.command}: error: {exc}. Stopped (fail closed); free space, then run the same command "
              "again", file=sys.stderr)
        return STORAGE_FAILED_EXIT_CODE
    except OSError as exc:
        if not is_storage_error(exc):
            raise
        print(f"hsd {args.command}: error: {describe_storage_failure(exc.filename or '?', exc)}. Stopped (fail "
              "closed); free space, then run the same command again", file=sys.stderr)
        return STORAGE_FAILED_EXIT_CODE
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        runtime = _worker_runtime()
        if runtime is None or not isinstance(exc, runtime.WorkerUnusable):
            raise
        print(f"hsd {args.command}: error: {exc}", file=sys.stderr)
        return runtime.EXIT_UNUSABLE


def _worker_runtime():
    """The worker shell's module once a worker loaded it (only a worker raises WorkerUnusable), else None:
    the command line imports no messaging (pyzmq, msgspec) before a subcommand needs it, so that
    ``hsd bench gpu`` reaches its preflight on an image that lacks them."""
    return sys.modules.get("common.worker.runtime")


if __name__ == "__main__":
    sys.exit(main())
