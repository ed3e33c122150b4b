"""Which captured target layers a serving engine can feed a drafter, per engine and objective.

A drafter trains on the target layers of the capture contract; served, it gets what the engine
captures instead (both checked by running vLLM 0.33's and SGLang 0.5.23's own loaders on exports):

- vLLM collects ``hidden_states + residual`` at the top of decoder layer ``idx`` for every ``idx``
  in its auxiliary layer ids (the models' ``forward``, fed by
  ``eagle3_utils.get_eagle3_aux_layers_from_config``): EAGLE-3 exports carry those ids as
  ``eagle_aux_hidden_state_layer_ids`` (layer ``i`` → ``i + 1``), DFlash's ``target_layer_ids`` get
  the ``+ 1`` from the engine; index ``N`` is collected after the layer loop, so the last layer's
  output (id ``N - 1``) is served too: every layer ``0 <= i <= N - 1``.
- SGLang sets ``layers_to_capture = [i + 1 for i in ids]`` (``set_eagle3_layers_to_capture``,
  ``set_dflash_layers_to_capture``) and collects before layer ``i + 1`` only, inside the loop: the
  last layer's output is never captured, so it serves ``0 <= i <= N - 2``.

A layer outside an engine's range is refused naming that engine (SGLang, for the last layer).
``target.allow_unservable`` turns the check off (a drafter evaluated with ``hsd eval`` only, served
by vLLM alone, or an engine patched to capture after the loop).
"""

from __future__ import annotations

from collections.abc import Sequence

ENGINES = ("vLLM", "SGLang")
ALLOW_KEY = "target.allow_unservable"


def servable_range(engine: str, objective: str, num_layers: int) -> tuple[int, int]:
    """(first, last) layer id ``engine`` can capture for a drafter of ``objective`` on an N-layer target."""
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "vLLM":  # the stream entering layer i + 1, and after the loop for i = N - 1
        return 0, num_layers - 1
    return 0, num_layers - 2  # SGLang: the stream entering layer i + 1, which exists for i <= N - 2 only


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
    return ("; ".join(problems) + " (SGLang captures a layer's output as the stream entering the next layer, "
            f"so never the last layer's); choose layers within range or set {ALLOW_KEY}=true")
