"""dispatcher/registry.py: the live sessions and their indexes (by name, by model, by node)."""

from __future__ import annotations

import random
from collections import Counter

from common.wire.messages import ModelClaim
from core_harness import make_core


def test_the_registry_finds_a_names_sessions_and_a_models_drafters_as_a_walk_of_every_worker_would(tmp_path):
    """Registering looks up the name's earlier sessions and the model's other drafters in indexes
    (a walk of every worker per registration made a thousand GPUs re-registering quadratic), and the
    stats count each node's workers from a third: after registrations, replacements and departures
    they agree with the walk, in registration order."""
    core = make_core(tmp_path)
    rng = random.Random(5)
    for step in range(300):
        live = list(core.workers)
        if live and rng.random() < 0.3:
            core.deregister(rng.choice(live), float(step), reason="left")
            continue
        role = rng.choice(["target", "drafter"])
        model = ModelClaim(id=f"m{rng.randrange(4)}", step=0) if role == "drafter" else None
        core.register(role=role, name=f"{role}{rng.randrange(6)}", pid=step, host=f"h{rng.randrange(2)}", gpu=None,
                      now=float(step), model=model)  # a name already registered on its host is replaced
    workers = list(core.workers.values())
    assert len(workers) > 10 and any(w.model for w in workers)
    for w in workers:
        assert core.registry.sessions_of(w.name, w.role, w.host) == [w]  # one live session a name
    for model in {f"m{k}" for k in range(4)}:
        assert core.registry.of_model(model) == [w for w in workers if w.model == model]
    assert core.registry.models() == {w.model for w in workers if w.model}
    assert core.registry.on_node == Counter((w.node, w.role) for w in workers)
    assert core.registry.sessions_of("nobody", "target", "h0") == [] and core.registry.of_model("m9") == []

