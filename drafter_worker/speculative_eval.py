"""Speculative decoding with the target verifying greedily: the figures users compare drafters by.

Each verify step: the drafter drafts from the last accepted token, conditioned on the target's
captured states of the verified prefix; the target runs once over prefix + draft; the longest draft
prefix that matches the target's own greedy choices is accepted, and the target's next token (the
"bonus") is appended. Reported: the mean acceptance length ``tau`` (accepted + 1 per verify step)
and per-position acceptance rates (share of verify steps whose draft position k was accepted), as
vLLM and SGLang print them.

The loop knows a drafter only through :class:`Proposer`: DFlash drafts one block at once
(:class:`drafter_worker.dflash.eval.DFlashProposer`), EAGLE-3 chains its steps
(:class:`drafter_worker.eagle3.eval.Eagle3Proposer`); its drafter family
(:mod:`common.run.drafter_family`) makes one of a draft model, and of an exported drafter the family
its config names (:func:`load_proposer`).

Correctness is checked, not assumed: the speculative output must equal the target's plain greedy
output token for token, else :class:`SpeculativeMismatch` is raised. Kept simple on purpose: the
target re-runs the whole prefix at every step (no KV cache), which is fine for the small models
this runs on in tests and quick checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from common.run.drafter_family import export_family, family_of
from common.run.target_model import find_decoder
from drafter_worker.layers import find_drafter_dir, read_export_config


class SpeculativeMismatch(AssertionError):
    """The speculative output differs from the target's greedy output: acceptance is broken."""


class Proposer(Protocol):
    """What the verifier needs of a drafter."""

    block_size: int  # the bonus token plus the drafts of one verify step
    target_layer_ids: list[int]  # the target layers whose raw outputs it reads

    def propose(self, seq_ids: torch.Tensor, ctx_hs: torch.Tensor) -> torch.Tensor:
        """``block_size - 1`` draft tokens following ``seq_ids [L]``; ``ctx_hs [L-1, K*H]`` are the
        target's captured states of every position but the last (whose state does not exist yet)."""


@dataclass
class Generation:
    tokens: list[int]
    accepted: list[int]  # drafts accepted at each verify step


def forward_capturing(target, ids: torch.Tensor, layer_ids: list[int]):
    """The target's forward and ``[T, K*H]`` of the first sequence: the raw outputs of ``layer_ids``
    (forward hooks on the decoder layers), as the target worker captures them and the engines feed a
    drafter; ``hidden_states[N]`` of ``output_hidden_states`` would be the final norm's output."""
    decoder, layers_name = find_decoder(target)
    layers = decoder._modules[layers_name]
    outputs: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(_module, _args, output) -> None:
            outputs[index] = output[0] if isinstance(output, tuple) else output
        return hook
    handles = [layers[i].register_forward_hook(keep(i)) for i in layer_ids]
    try:
        out = target(ids)
    finally:
        for handle in handles:
            handle.remove()
    return out, torch.cat([outputs[i][0] for i in layer_ids], dim=-1)


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """Truncate at ``max_new_tokens`` and after the first end-of-sequence token; True when done."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[:i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The target's plain greedy output (whole prefix re-run each token, like the verifier)."""
    device = target.device
    new: list[int] = []
    while True:
        ids = torch.tensor([prompt + new], device=device)
        new.append(int(target(ids).logits[0, -1].argmax()))
        new, done = _finish(new, max_new_tokens, eos)
        if done:
            return new


@torch.no_grad()
def speculative_generate(target, proposer: Proposer, prompt: list[int], max_new_tokens: int,
                         eos: set[int]) -> Generation:
    device = target.device
    out, hs = forward_capturing(target, torch.tensor([prompt], device=device), proposer.target_layer_ids)
    seq = list(prompt) + [int(out.logits[0, -1].argmax())]  # the prefill's token is the first bonus
    new, done = _finish(seq[len(prompt):], max_new_tokens, eos)
    accepted: list[int] = []
    while not done:
        length = len(seq)
        draft = proposer.propose(torch.tensor(seq, device=device), hs[:length - 1]).tolist()
        out, hs = forward_capturing(target, torch.tensor([seq + draft], device=device), proposer.target_layer_ids)
        greedy = out.logits[0, length - 1:].argmax(-1).tolist()  # greedy[j]: the target's token after seq+draft[:j]
        num_accepted = 0
        while num_accepted < len(draft) and draft[num_accepted] == greedy[num_accepted]:
            num_accepted += 1
        seq += draft[:num_accepted] + [greedy[num_accepted]]
        accepted.append(num_accepted)
        # Rows up to the new last-but-one position saw only verified tokens (the target is causal).
        hs = hs[:len(seq) - 1]
        new, done = _finish(seq[len(prompt):], max_new_tokens, eos)
    return Generation(tokens=new, accepted=accepted)


def _eos_ids(target) -> set[int]:
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def load_proposer(path: str | os.PathLike, target_dir, *, device="cpu") -> Proposer:
    """The exported drafter at ``path`` (or a checkpoint's step directory) as the proposer of the
    drafter family its ``config.json`` names; one that names none is read as the default family's,
    whose loader says what it lacks."""
    drafter_dir = find_drafter_dir(path)
    family = export_family(read_export_config(drafter_dir))
    return family.load_proposer(drafter_dir, target_dir, device=device)


def as_proposer(drafter, target_dir, *, device="cpu") -> Proposer:
    """``drafter``: an exported drafter's directory, a draft model (its family's proposer, by the
    model's ``objective``), or a :class:`Proposer`."""
    if isinstance(drafter, (str, os.PathLike)):
        return load_proposer(drafter, target_dir, device=device)
    if hasattr(drafter, "propose"):
        return drafter
    return family_of(drafter.objective).proposer(drafter)


def evaluate(target_dir, drafter, prompts: list[list[int]], max_new_tokens: int, *, device="cpu",
             target=None) -> dict:
    """Speculative decoding over ``prompts``: ``{"tau", "per_position", ...}``.

    ``drafter``: what :func:`as_proposer` takes. ``target`` reuses an already loaded target model.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("evaluate needs at least one prompt, and no empty prompt")
    if target is None:
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    proposer = as_proposer(drafter, target_dir, device=device)
    num_layers = target.config.get_text_config().num_hidden_layers
    if not all(0 <= i < num_layers for i in proposer.target_layer_ids):
        raise ValueError(f"drafter layer ids {proposer.target_layer_ids} out of range for a {num_layers}-layer target")
    eos = _eos_ids(target)
    accepted: list[int] = []
    num_new = 0
    for i, prompt in enumerate(prompts):
        reference = greedy_generate(target, list(prompt), max_new_tokens, eos)
        result = speculative_generate(target, proposer, list(prompt), max_new_tokens, eos)
        if result.tokens != reference:
            at = next((j for j, (a, b) in enumerate(zip(result.tokens, reference)) if a != b),
                      min(len(result.tokens), len(reference)))
            raise SpeculativeMismatch(f"prompt {i}: speculative output differs from greedy at new token {at}: "
                                      f"{result.tokens[at:at + 5]} vs {reference[at:at + 5]}")
        accepted += result.accepted
        num_new += len(result.tokens)
    num_drafts = proposer.block_size - 1
    steps = max(1, len(accepted))
    return {
        "tau": sum(a + 1 for a in accepted) / steps if accepted else 1.0,
        "per_position": [sum(a >= k for a in accepted) / steps for k in range(1, num_drafts + 1)],
        "num_prompts": len(prompts),
        "num_verify_steps": len(accepted),
        "num_new_tokens": num_new,
        "block_size": proposer.block_size,
        "matches_greedy": True,
    }
