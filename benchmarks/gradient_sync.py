"""``hsd bench gradsync``: a data-parallel step's gradient sum, one collective per tensor vs buckets.

Two ranks (spawned processes, gloo over a FileStore, one thread each) hold gradients shaped like a
DFlash drafter's (Qwen3-style layers: fusion projection, attention and MLP matrices, norms) and sum
them over the group, alternately one ``all_reduce`` per tensor (what a plain loop does) and through
:func:`drafter_worker.process_group.all_reduce_flat` (small tensors packed into buckets). It prints
the mean time of each per shape, from rank 0, and how far the two ways' sums of the same seeded
gradients are apart and from the exact sum.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drafter_worker.process_group import all_reduce_flat

WORLD = 2


def drafter_shapes(hidden: int, layers: int, num_capture: int = 3) -> list[tuple[int, ...]]:
    inter = 3 * hidden
    layer = [(hidden, hidden)] * 4 + [(inter, hidden), (inter, hidden), (hidden, inter)] + [(hidden,)] * 4
    return [(hidden, num_capture * hidden), (hidden,)] + layer * layers


def _seeded(shapes: list[tuple[int, ...]], rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=generator) for s in shapes]


def _sum_errors(rank: int, shapes: list[tuple[int, ...]]) -> dict[str, float]:
    """Both ways sum the same seeded gradients: how far apart their results are, and how far the
    worse of them is from the sum computed here from every rank's seed (0.0 and 0.0: exact)."""
    mine = _seeded(shapes, rank)
    exact = [sum(parts) for parts in zip(*(_seeded(shapes, r) for r in range(WORLD)))]
    per_tensor, bucketed = [g.clone() for g in mine], [g.clone() for g in mine]
    for g in per_tensor:
        dist.all_reduce(g)
    all_reduce_flat(bucketed, dist.all_reduce)
    return {"ways_differ_by": max((a - b).abs().max().item() for a, b in zip(per_tensor, bucketed)),
            "sum_error": max(max((a - e).abs().max().item(), (b - e).abs().max().item())
                             for a, b, e in zip(per_tensor, bucketed, exact))}


def _rank(rank: int, store: str, shapes: list[tuple[int, ...]], reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        errors = _sum_errors(rank, shapes)
        grads = [torch.randn(s) for s in shapes]
        times = {"per_tensor": 0.0, "bucketed": 0.0}
        for _ in range(reps):  # interleaved, so both see the same machine
            for mode in times:
                dist.barrier()
                started = time.perf_counter()
                if mode == "bucketed":
                    all_reduce_flat(grads, dist.all_reduce)
                else:
                    for g in grads:
                        dist.all_reduce(g)
                times[mode] += time.perf_counter() - started
        if rank == 0:
            with open(out, "w") as f:
                json.dump({**{mode: round(total / reps * 1000, 2) for mode, total in times.items()}, **errors}, f)
    finally:
        dist.destroy_process_group()


def run_gradient_sync_bench(*, hidden: list[int], layers: int, reps: int, as_json: bool) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="hsd-bench-gradsync-") as tmp:
        for h in hidden:
            shapes = drafter_shapes(h, layers)
            out = os.path.join(tmp, f"h{h}.json")
            mp.spawn(_rank, args=(os.path.join(tmp, f"store-{h}"), shapes, reps, out), nprocs=WORLD)
            with open(out) as f:
                ms = json.load(f)
            rows.append({"hidden": h, "layers": layers, "tensors": len(shapes),
                         "values_m": round(sum(torch.Size(s).numel() for s in shapes) / 1e6, 2),
                         "per_tensor_ms": ms["per_tensor"], "bucketed_ms": ms["bucketed"],
                         "speedup": round(ms["per_tensor"] / ms["bucketed"], 2),
                         "ways_differ_by": ms["ways_differ_by"], "sum_error": ms["sum_error"]})
    if as_json:
        print(json.dumps({"world_size": WORLD, "backend": "gloo", "rows": rows}))
        return 0
    print(f"gradient sum over {WORLD} gloo ranks, mean of {reps}:")
    for r in rows:
        print(f"  hidden {r['hidden']:>5}, {r['layers']} layers, {r['tensors']} tensors, {r['values_m']:>6} M values: "
              f"per tensor {r['per_tensor_ms']:8.1f} ms   bucketed {r['bucketed_ms']:8.1f} ms   x{r['speedup']}   "
              f"sums apart {r['ways_differ_by']:.1e}, off the exact sum {r['sum_error']:.1e}")
    return 0
