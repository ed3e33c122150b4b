"""Speculative evaluation: output equals greedy, and acceptance is counted exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_testing import LAYER_IDS, VOCAB, make_trainer, target_states
from drafter_worker.dflash.export import save_drafter
from drafter_worker.speculative_eval import evaluate, greedy_generate
from hsd.cli import main

PROMPTS = [[5, 17, 42, 8, 99, 3], [250, 11, 7], [60, 61, 62, 63, 64, 65, 66, 67]]


class GreedyOracle:
    """Proposes the target's own greedy continuation, then wrong tokens from position ``num_right`` on."""

    def __init__(self, target, prompts, *, block_size: int, num_right: int, max_new_tokens: int):
        self.block_size, self.num_right = block_size, num_right
        self.target_layer_ids = LAYER_IDS
        self.greedy = {tuple(p): p + greedy_generate(target, p, max_new_tokens + block_size, set()) for p in prompts}

    def propose(self, seq_ids, ctx_hs):
        assert ctx_hs.shape[0] == len(seq_ids) - 1  # the verified prefix, minus the bonus token
        seq = seq_ids.tolist()
        full = next(g for g in self.greedy.values() if g[:len(seq)] == seq)
        right = full[len(seq):len(seq) + self.block_size - 1]
        return torch.tensor([t if k < self.num_right else (t + 1) % VOCAB for k, t in enumerate(right)])


def _accounted(result: dict) -> None:
    """tau (tokens per verify step) and the per-position acceptance describe the same verify steps:
    tau = 1 + the mean accepted drafts = 1 + the sum of the rates at which each position was accepted."""
    assert result["tau"] == pytest.approx(1 + sum(result["per_position"]), abs=1e-12)


def test_random_drafter_output_equals_greedy(tiny_target, tiny_target_model):
    trainer = make_trainer(tiny_target, num_draft_layers=1)
    result = evaluate(tiny_target, trainer.model, PROMPTS, 12, target=tiny_target_model)
    assert result["matches_greedy"] and result["num_new_tokens"] == 3 * 12
    _accounted(result)
    # An untrained drafter's guesses among 300 tokens are rarely the target's: well under the
    # 1 + 1.0 a drafter trained on the target's output reaches (the test below).
    assert result["tau"] < 1.5, result
    rates = result["per_position"]
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))


@pytest.mark.parametrize("num_right", [0, 2, 3])
def test_tau_is_one_plus_the_accepted_drafts(tiny_target, tiny_target_model, num_right):
    oracle = GreedyOracle(tiny_target_model, PROMPTS, block_size=4, num_right=num_right, max_new_tokens=10)
    result = evaluate(tiny_target, oracle, PROMPTS, 10, target=tiny_target_model)
    assert result["tau"] == 1 + num_right
    assert result["per_position"] == [1.0] * num_right + [0.0] * (3 - num_right)
    # Each verify step adds num_right + 1 tokens; the prefill adds the first one.
    per_prompt = 1 + -(-(10 - 1) // (num_right + 1))
    assert result["num_verify_steps"] == 3 * (per_prompt - 1)


def test_training_on_the_targets_own_output_raises_tau(tiny_target, tiny_target_model):
    prompt = PROMPTS[0]
    answer = greedy_generate(tiny_target_model, prompt, 40, set())
    ids = torch.tensor([prompt + answer])
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, len(prompt):] = True
    seq_lens = torch.tensor([ids.shape[1]])
    hs = target_states(tiny_target_model, ids)
    trainer = make_trainer(tiny_target, num_draft_layers=2, lr=3e-3, total_steps=200, num_anchors=64)
    before = evaluate(tiny_target, trainer.model, [prompt], 40, target=tiny_target_model)["tau"]
    for _ in range(60):
        trainer.micro_batch(hs, ids, loss_mask, seq_lens)
        trainer.apply_step()
    after = evaluate(tiny_target, trainer.model, [prompt], 40, target=tiny_target_model)
    print(f"tau before {before:.2f} after {after['tau']:.2f}, per position {after['per_position']}")
    assert after["tau"] > before + 1.0


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tokenizer(out_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(200)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def test_hsd_eval_cli(tiny_target, tmp_path, capsys):
    target_dir = tmp_path / "target"
    shutil.copytree(tiny_target, target_dir)
    _tokenizer(target_dir)
    rows = [{"conversations": [{"from": "human", "value": f"w{i} w{i + 1} w{i + 2}"},
                               {"from": "gpt", "value": "w9"}]} for i in range(4)]
    (target_dir / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = make_trainer(target_dir)
    save_drafter(trainer.model, tmp_path / "drafter", dtype="float32")
    config = tmp_path / "eval.yaml"
    config.write_text(f"target:\n  model: {target_dir}\n  num_capture_layers: 1\n")
    # In-process: the command is a thin shell, and a second interpreter would only re-import torch.
    assert main(["eval", "--config", str(config), "--drafter", str(tmp_path / "drafter"), "--prompts", "3",
                 "--max-new-tokens", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 3 and result["num_new_tokens"] == 18
    # the command's figures are those of speculative decoding with that drafter on the first 3
    # held-out prompts, as the chat template renders them
    from transformers import AutoTokenizer
    from drafter_worker.eval_prompts import load_chat_prompts
    prompts = load_chat_prompts(target_dir / "heldout.jsonl", AutoTokenizer.from_pretrained(target_dir), 3)
    assert result == evaluate(target_dir, str(tmp_path / "drafter"), prompts, 6)
    assert main(["eval", "--config", str(config), "--drafter", str(tmp_path / "drafter"), "--prompts", "1",
                 "--max-new-tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert "tau " in text and "acceptance per position:" in text
    assert main(["eval", "--config", str(config), "--drafter", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_evaluation_feeds_the_drafter_raw_layer_outputs(tiny_target_model):
    """hsd eval gives the drafter what training and the engines give it: the last layer's block is
    that layer's raw output, not hidden_states[N] (the final norm's output)."""
    from drafter_worker.speculative_eval import forward_capturing
    ids = torch.randint(1, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny_target_model(ids, output_hidden_states=True)
        out, hs = forward_capturing(tiny_target_model, ids, [1, 3])
    hidden = tiny_target_model.config.hidden_size
    torch.testing.assert_close(hs[:, :hidden], plain.hidden_states[2][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(tiny_target_model.model.norm(hs[:, hidden:]), plain.hidden_states[4][0], atol=1e-5,
                               rtol=0)
    assert (hs[:, hidden:] - plain.hidden_states[4][0]).abs().max() > 0.1
    torch.testing.assert_close(out.logits, plain.logits, atol=0, rtol=0)
