"""What vLLM and SGLang read from an exported drafter directory, written from their published loaders.

No engine runs here; each function states what the engine's loader does with a directory, so a
test can tell whether a drafter the project exported would load and be fed the layers it was
trained on. Modelled (read in the engines' sources, never copied):

- file selection, both engines: ``DefaultModelLoader._prepare_weights`` — ``*.safetensors`` at the
  top of the directory (before ``*.bin``/``*.pt``); with a ``model.safetensors.index.json`` only the
  files its ``weight_map`` names; every selected file is read, so a second file adds its tensors;
- vLLM DFlash: ``vllm/model_executor/models/qwen3_dflash.py`` (``DFlashQwen3Model.__init__`` reads
  ``dflash_config`` merged into ``eagle_config``, ``mask_token_id``, ``layer_types``,
  ``rope_parameters``; ``DFlashQwen3ForCausalLM.load_weights`` prefixes ``model.`` to every name but
  ``lm_head``, renames ``d2t``, skips ``t2d``; ``hf_to_vllm_mapper`` stacks q/k/v and gate/up;
  ``AutoWeightsLoader`` rejects a name no parameter has) and ``eagle3_utils.
  get_eagle3_aux_layers_from_config`` (a top-level ``eagle_aux_hidden_state_layer_ids`` wins, else
  ``dflash_config.target_layer_ids`` + 1; ``fc`` is ``target_hidden_size`` × that many);
- vLLM EAGLE-3: ``llama_eagle3.py`` (``Eagle3LlamaForCausalLM.load_weights``: ``midlayer.`` →
  ``layers.0.``, ``d2t`` → ``draft_id_to_target_id``, ``t2d`` skipped, ``model.`` prefix but for
  ``lm_head``; ``draft_vocab_size`` sizes ``lm_head``; ``eagle_aux_hidden_state_layer_ids`` used as
  capture ids);
- SGLang DFlash: ``python/sglang/srt/speculative/dflash_utils.py`` (``parse_dflash_draft_config``:
  ``target_layer_ids``, ``num_target_layers``, ``block_size``, ``mask_token`` with its default
  ``<|MASK|>``, ``mask_token_id``, each in ``dflash_config`` or at the top level;
  ``resolve_target_layer_ids`` range check), ``models/dflash.py`` (``DFlashDraftModel.load_weights``:
  names without ``model.``, stacked q/k/v and gate/up, an unknown name silently ignored, ``fc.weight``
  shape checked; RoPE from the top-level ``rope_theta``/``rope_scaling``) and the target's
  ``set_dflash_layers_to_capture`` (``layers_to_capture = ids + 1``);
- SGLang EAGLE-3: ``models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``: ``draft_vocab_size`` sizes
  ``lm_head`` — without it the target's vocabulary; ``load_weights``: ``d2t`` → ``hot_token_id``,
  ``t2d`` skipped, ``model.`` added when the bare name is no parameter, unknown names ignored) and
  ``set_eagle3_layers_to_capture`` (``eagle_config.eagle_aux_hidden_state_layer_ids`` + 1).

SGLang collects a captured state at the top of decoder layer ``idx`` for ``idx < N`` only, so its
capture ids lie in ``1..N-1``; vLLM (0.33) also collects index ``N`` after the layer loop (the last
layer's output), so its ids lie in ``1..N``. An engine that ignores an unknown tensor (SGLang) would run with
a parameter never loaded: :func:`load_problems` reports a tensor no parameter takes and a parameter
no tensor fills for every engine alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

ENGINES = ("vLLM", "SGLang")
INDEX_FILE = "model.safetensors.index.json"
NOT_WEIGHTS = {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
SGLANG_DEFAULT_MASK = "<|MASK|>"
_STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
            ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def weight_files(directory: Path) -> list[Path]:
    """The files ``DefaultModelLoader._prepare_weights`` reads from a local directory."""
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        files = sorted(p for p in directory.glob(pattern) if p.name not in NOT_WEIGHTS)
        if files:
            break
    index = directory / INDEX_FILE
    if files and files[0].suffix == ".safetensors" and index.is_file():
        named = set(json.loads(index.read_text())["weight_map"].values())
        files = [p for p in files if p.name in named]
    return files


def read_tensors(files: list[Path]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor of every selected file, in file order (duplicates kept)."""
    tensors = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                tensors.append((name, tuple(view.get_shape()), view.get_dtype()))
    return tensors


def _target(target_dir: Path) -> dict:
    doc = json.loads((target_dir / "config.json").read_text())
    return doc.get("text_config", doc)


def _get(doc: dict, section: str, key: str, default=None):
    """``doc[section][key]``, else the top-level ``doc[key]`` (both engines accept either)."""
    return (doc.get(section) or {}).get(key, doc.get(key, default))


def capture_ids(engine: str, doc: dict) -> list[int] | None:
    """The ids of the decoder layers at whose top the engine collects the drafter's inputs (the stream
    entering layer id, i.e. the output of layer id - 1); None when the config names none."""
    eagle3 = "LlamaForCausalLMEagle3" in doc.get("architectures", [])
    if engine == "vLLM":
        ids = doc.get("eagle_aux_hidden_state_layer_ids")
        if not ids and not eagle3:
            ids = [i + 1 for i in _get(doc, "dflash_config", "target_layer_ids") or []]
        return list(ids) if ids else None
    key = ("eagle_config", "eagle_aux_hidden_state_layer_ids") if eagle3 else ("dflash_config", "target_layer_ids")
    ids = (doc.get(key[0]) or {}).get(key[1]) if eagle3 else _get(doc, *key)
    return [i + 1 for i in ids] if ids else None


def expected_params(engine: str, doc: dict, target: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter the engine's drafter module loads from the file, with its shape."""
    eagle3 = "LlamaForCausalLMEagle3" in doc.get("architectures", [])
    hidden, inter = doc["hidden_size"], doc["intermediate_size"]
    heads, kv_heads = doc["num_attention_heads"], doc["num_key_value_heads"]
    head_dim = doc.get("head_dim") or hidden // heads
    target_hidden = doc.get("target_hidden_size") or hidden
    ids = capture_ids(engine, doc) or []
    qkv_in = 2 * hidden if eagle3 else hidden
    layer = {"self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, qkv_in),
             "self_attn.o_proj.weight": (hidden, heads * head_dim),
             "mlp.gate_up_proj.weight": (2 * inter, hidden), "mlp.down_proj.weight": (hidden, inter),
             "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    if eagle3:
        draft_vocab = doc.get("draft_vocab_size") or doc["vocab_size"]  # both engines fall back to the target's
        layer["hidden_norm.weight"] = (hidden,)
        stem = "model.layers.0." if engine == "vLLM" else "model.midlayer."
        params = {stem + k: v for k, v in layer.items()}
        params.update({"model.fc.weight": (hidden, 3 * target_hidden), "model.norm.weight": (hidden,),
                       "lm_head.weight": (draft_vocab, hidden)})
        params["draft_id_to_target_id" if engine == "vLLM" else "hot_token_id"] = (draft_vocab,)
        return params
    layer.update({"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)})
    prefix = "model." if engine == "vLLM" else ""
    params = {f"{prefix}layers.{i}.{k}": v for i in range(doc["num_hidden_layers"]) for k, v in layer.items()}
    params.update({f"{prefix}fc.weight": (hidden, len(ids) * target_hidden), f"{prefix}hidden_norm.weight": (hidden,),
                   f"{prefix}norm.weight": (hidden,)})
    return params


def engine_name(engine: str, name: str, *, eagle3: bool) -> str | None:
    """The parameter a file's tensor goes to (before stacking), or None when the loader skips it."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id" if engine == "vLLM" else "hot_token_id"
    if engine == "vLLM":
        if eagle3:
            name = name.replace("midlayer.", "layers.0.")
        return name if name.startswith("lm_head") else "model." + name
    return ("model." + name if eagle3 and not name.startswith("lm_head") else name)


def load_problems(engine: str, drafter_dir: Path, *, target_dir: Path, trained_layer_ids: list[int],
                  tokenizer=None) -> list[str]:
    """Why ``engine`` would not serve ``drafter_dir`` as trained (empty: it would)."""
    doc = json.loads((drafter_dir / "config.json").read_text())
    target = _target(target_dir)
    num_layers = target["num_hidden_layers"]
    eagle3 = "LlamaForCausalLMEagle3" in doc.get("architectures", [])
    if not eagle3 and "DFlashDraftModel" not in doc.get("architectures", []):
        return [f"architectures {doc.get('architectures')} name no drafter model {engine} registers"]
    problems = []
    files = weight_files(drafter_dir)
    if len(files) != 1:
        problems.append(f"{engine} reads {len(files)} weight files ({', '.join(p.name for p in files)}), not one")
    ids = capture_ids(engine, doc)
    trained = [i + 1 for i in trained_layer_ids]
    if ids is None:
        problems.append(f"{engine} finds no layer ids in the config (it would capture its own default layers)")
    elif ids != trained:
        problems.append(f"{engine} captures at the top of layers {ids}, the drafter trained on the outputs of "
                        f"{trained_layer_ids} (top of {trained})")
    elif not all(1 <= i <= num_layers - (engine != "vLLM") for i in ids):
        problems.append(f"{engine} never collects the top of layer {max(ids)} of a {num_layers}-layer target")
    if not eagle3:
        problems += _dflash_config_problems(engine, doc, target, tokenizer)
    elif doc.get("draft_vocab_size") is None:
        problems.append(f"no draft_vocab_size: {engine} sizes lm_head to the target's vocabulary")
    want = expected_params(engine, doc, target)
    filled: dict[str, list] = {}
    for name, shape, _dtype in read_tensors(files):
        param = engine_name(engine, name, eagle3=eagle3)
        if param is None:
            continue
        shard = None
        for old, (new, shard_id) in _STACKED.items():
            if old in param:
                param, shard = param.replace(old, new), shard_id
                break
        if param not in want:
            problems.append(f"tensor {name!r} maps to {param!r}, no parameter of {engine}'s drafter "
                            + ("(vLLM's loader raises)" if engine == "vLLM" else "(SGLang ignores it)"))
            continue
        filled.setdefault(param, []).append((shard, shape))
    for param, shape in want.items():
        parts = filled.get(param)
        if not parts:
            problems.append(f"{engine}'s parameter {param} {shape} is filled by no tensor")
        elif len({s for s, _ in parts}) != len(parts):
            problems.append(f"{engine}'s parameter {param} is filled {len(parts)} times")
        elif _joined(parts) != shape:
            problems.append(f"{engine}'s parameter {param} is {shape}, the file gives {[s for _, s in parts]}")
    return problems


def _joined(parts: list) -> tuple[int, ...]:
    """The shape the stacked shards of one parameter make (rows concatenated)."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    return (sum(shape[0] for _, shape in parts), *parts[0][1][1:])


def _dflash_config_problems(engine: str, doc: dict, target: dict, tokenizer) -> list[str]:
    problems = []
    mask_id = _get(doc, "dflash_config", "mask_token_id")
    if mask_id is None or not 0 <= int(mask_id) < target["vocab_size"]:
        problems.append(f"mask_token_id {mask_id} is not a row of the target's embedding")
    if engine == "SGLang":
        mask = _get(doc, "dflash_config", "mask_token")
        if mask is None:
            problems.append(f"no dflash_config.mask_token: SGLang versions that resolve the mask by its text look "
                            f"up {SGLANG_DEFAULT_MASK!r}")
        elif tokenizer is not None and tokenizer.convert_tokens_to_ids(mask) != mask_id:
            problems.append(f"mask_token {mask!r} is id {tokenizer.convert_tokens_to_ids(mask)} in the target's "
                            f"tokenizer, not mask_token_id {mask_id}")
        if _get(doc, "dflash_config", "block_size") is None:
            problems.append("no block_size (SGLang reads it in dflash_config or at the top level)")
        if doc.get("rope_theta") is None:
            problems.append("no top-level rope_theta: SGLang's DFlash model uses its default base")
        num_target = _get(doc, "dflash_config", "num_target_layers")
        ids = _get(doc, "dflash_config", "target_layer_ids") or []
        if num_target is not None and not all(0 <= i < num_target for i in ids):
            problems.append(f"target_layer_ids {ids} outside 0..{num_target - 1} (resolve_target_layer_ids raises)")
    else:
        layer_types = doc.get("layer_types")
        if layer_types is not None and len(layer_types) != doc["num_hidden_layers"]:
            problems.append(f"layer_types has {len(layer_types)} entries for {doc['num_hidden_layers']} layers")
        if "rope_theta" not in (doc.get("rope_parameters") or {}) and doc.get("rope_theta") is None:
            problems.append("no rope_theta: vLLM sets its default base 1e6")
    return problems


def reads(engine: str, objective: str) -> str:
    """One line: what ``engine`` reads for ``objective`` (the report lists it)."""
    files = "every top-level *.safetensors (an index file restricts them)"
    table = {
        ("vLLM", "dflash"): "architectures, dflash_config.{target_layer_ids (+1), mask_token_id}, top-level "
                            "eagle_aux_hidden_state_layer_ids first if present, target_hidden_size, layer_types, "
                            "rope_parameters; names get model. (lm_head kept), q/k/v and gate/up stacked",
        ("SGLang", "dflash"): "dflash_config (or top level) {target_layer_ids (+1), num_target_layers, block_size, "
                              "mask_token (default <|MASK|>), mask_token_id}, top-level rope_theta/rope_scaling, "
                              "fc.weight shape [H, K*H]; bare names, q/k/v and gate/up stacked, unknown ignored",
        ("vLLM", "eagle3"): "architectures, eagle_aux_hidden_state_layer_ids (as given), draft_vocab_size, "
                            "target_hidden_size; midlayer. -> layers.0., d2t -> draft_id_to_target_id, t2d skipped",
        ("SGLang", "eagle3"): "eagle_config.eagle_aux_hidden_state_layer_ids (+1), draft_vocab_size, "
                              "target_hidden_size; d2t -> hot_token_id, t2d skipped, model. added, unknown ignored",
    }
    return f"{engine} {objective}: {files}; {table[(engine, objective)]}"
