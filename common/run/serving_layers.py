"""Which captured target layers a serving engine can feed a drafter, per engine and objective.

A drafter trains on the target layers of the capture contract; served, it gets what the engine
captures instead. Both engines take a layer's output as the residual stream *entering* the next
decoder layer, never after the loop:

- vLLM collects ``hidden_states + residual`` at the top of decoder layer ``idx`` for every ``idx``
  in its auxiliary layer ids (the models' ``forward``, fed by
  ``eagle3_utils.get_eagle3_aux_layers_from_config``): EAGLE-3 exports carry those ids as
  ``eagle_aux_hidden_state_layer_ids`` (layer ``i`` → ``i + 1``), DFlash's ``target_layer_ids`` get
  the ``+ 1`` from the engine. The output of the last layer (id ``N``) is never collected.
- SGLang sets ``layers_to_capture = [i + 1 for i in ids]`` (``set_eagle3_layers_to_capture``,
  ``set_dflash_layers_to_capture``) and collects before layer ``i + 1`` likewise.

So a layer ``i`` is servable by both engines for both objectives when ``0 <= i <= N - 2``: the last
layer's output is never what an engine feeds. ``target.allow_unservable`` turns the check off (a
drafter evaluated with ``hsd eval`` only, or an engine patched to capture after the loop).
"""

from __future__ import annotations

from collections.abc import Sequence

ENGINES = ("vLLM", "SGLang")
ALLOW_KEY = "target.allow_unservable"


def servable_range(engine: str, objective: str, num_layers: int) -> tuple[int, int]:
    """(first, last) layer id ``engine`` can capture for a drafter of ``objective`` on an N-layer target."""
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r}: one of {', '.join(ENGINES)}")
    # Both engines capture the stream entering layer i + 1, which exists for i <= N - 2 only.
    return 0, num_layers - 2


def unservable_reason(layer_ids: Sequence[int], *, num_layers: int, objective: str) -> str | None:
    """None when every engine can serve ``layer_ids``; else a sentence naming each engine that cannot,
    its valid range, and the layers outside it."""
    problems = []
    for engine in ENGINES:
        first, last = servable_range(engine, objective, num_layers)
        outside = [i for i in layer_ids if not first <= i <= last]
        if outside:
            problems.append(f"{engine} serves layers {first}..{last} of this {num_layers}-layer target for "
                            f"{objective}, not {outside}")
    if not problems:
        return None
    return ("; ".join(problems) + " (an engine captures a layer's output as the stream entering the next "
            f"layer, so the last layer's never is); choose layers within range or set {ALLOW_KEY}=true")
