"""``hsd eval``: held-out prompts of the target, speculative decoding with an exported drafter (DFlash
or EAGLE-3: :mod:`drafter_worker.speculative_eval` loads the one the export names)."""

from __future__ import annotations

import json
from pathlib import Path

from common.run.config import Config, ConfigError
from common.run.target_config import MODEL_CONFIG_NAME


def run_eval(config: Config, *, drafter: str, num_prompts: int, prompts_file: str | None, max_new_tokens: int,
             device: str, as_json: bool) -> int:
    target_dir = config.target.model
    if not target_dir or not (Path(target_dir) / MODEL_CONFIG_NAME).is_file():
        raise ConfigError(f"target.model: {target_dir or '(empty)'} is not a model directory with a "
                          f"{MODEL_CONFIG_NAME}")
    from drafter_worker.layers import find_drafter_dir
    try:
        drafter = str(find_drafter_dir(drafter))
    except FileNotFoundError as exc:
        raise ConfigError(f"--drafter: {exc}") from None
    if num_prompts <= 0:
        raise ConfigError(f"--prompts must be positive, got {num_prompts}")
    from transformers import AutoTokenizer

    from drafter_worker.eval_prompts import load_chat_prompts
    from drafter_worker.speculative_eval import evaluate
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_chat_prompts(prompts_file or Path(target_dir) / "heldout.jsonl", tokenizer, num_prompts)
    result = evaluate(target_dir, drafter, prompts, max_new_tokens, device=device)
    if as_json:
        print(json.dumps(result))
    else:
        rates = " ".join(f"{r:.2f}" for r in result["per_position"])
        print(f"tau {result['tau']:.3f} over {result['num_verify_steps']} verify steps, "
              f"{result['num_prompts']} prompts, {result['num_new_tokens']} new tokens (output == greedy)")
        print(f"acceptance per position: {rates}")
    return 0
