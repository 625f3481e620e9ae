"""A Llama 4 `config.json` (text, or the multimodal one's `text_config`) as the launcher's model
keys, refusing in one line what the model does not implement: a layer pattern other than MoE
every k-th layer and NoPE every n-th, biases, another activation, tied embeddings, another
RoPE scaling than llama3. The RoPE base and scaling are read from `rope_parameters`
(transformers 5) or `rope_theta` and `rope_scaling` (transformers 4).
"""
from __future__ import annotations

import json
from typing import Any, Callable

# Fields of a Llama 4 text config that `model_keys` reads and checks (`hf_config.BOOKKEEPING`
# holds those known not to change the model; any other is refused).
READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "intermediate_size_mlp",
    "num_local_experts", "num_experts_per_tok", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "tie_word_embeddings", "hidden_act", "attention_bias", "router_jitter_noise",
    "moe_layers", "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers",
    "no_rope_layer_interval", "nope_layer_interval", "attention_chunk_size", "layer_types",
    "attn_temperature_tuning", "floor_scale", "attn_scale",
}
_REQUIRED = {"tie_word_embeddings": (False,), "hidden_act": ("silu",), "attention_bias": (False,),
             "router_jitter_noise": (0, 0.0)}
# The multimodal config's fields beside the bookkeeping: text_config, which `model_keys` reads,
# and the vision tower's and its tokens', which do not change the language model (not converted).
MULTIMODAL_READ = {"text_config", "vision_config", "boi_token_index", "eoi_token_index",
                   "image_token_index", "tie_word_embeddings"}


def _pattern(hf: dict, refuse: Callable) -> tuple[int, int]:
  """(moe_every, nope_every) of the config's layers: MoE every k-th layer (`moe_layers` or
  `interleave_moe_layer_step`), RoPE-less every n-th (`no_rope_layers` or its interval)."""
  layers = hf["num_hidden_layers"]
  step = hf.get("interleave_moe_layer_step", 1)
  moe = hf.get("moe_layers")
  if moe is not None and list(moe) != list(range(step - 1, layers, step)):
    refuse("moe_layers", moe, f"implemented: every k-th layer MoE (here k = {step}: "
           f"{list(range(step - 1, layers, step))})")
  interval = hf.get("no_rope_layer_interval", 4)
  if hf.get("nope_layer_interval", interval) != interval:
    refuse("nope_layer_interval", hf["nope_layer_interval"], "implemented: the interval "
           f"no_rope_layer_interval gives, which transformers reads ({interval})")
  default = [int((i + 1) % interval != 0) for i in range(layers)]
  rope = hf.get("no_rope_layers") or default
  if list(rope) != default and any(not r for r in rope):
    refuse("no_rope_layers", rope, f"implemented: every n-th layer without RoPE (here n = "
           f"{interval}: {default})")
  return step, interval if not all(rope) else 0


def _rope(hf: dict, refuse: Callable) -> dict[str, Any]:
  """The RoPE base and scaling keys; transformers 5 (`rope_parameters`) or 4 (`rope_theta`,
  `rope_scaling`)."""
  rope = dict(hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {}))
  theta = rope.pop("rope_theta", hf.get("rope_theta"))
  if theta is None:
    refuse("rope_theta", None, "needs rope_parameters.rope_theta or rope_theta")
  kind = rope.get("rope_type", rope.get("type", "default"))
  keys = {"rope_theta": float(theta), "rope_layout": "interleaved",
          "rope_scaling.type": "none"}
  if kind == "llama3":
    keys.update({"rope_scaling.type": "llama3", "rope_scaling.factor": float(rope["factor"]),
                 "rope_scaling.low_freq_factor": float(rope["low_freq_factor"]),
                 "rope_scaling.high_freq_factor": float(rope["high_freq_factor"]),
                 "rope_scaling.original_max_positions":
                     int(rope["original_max_position_embeddings"])})
  elif kind != "default":
    refuse("rope_scaling", rope, "implemented: none or llama3")
  return keys


def model_keys(hf: dict, refuse: Callable) -> dict[str, Any]:
  """The launcher's config keys (dotted) for a Llama 4 text config `hf`; `refuse(field, value,
  why)` raises the converter's one-line error."""
  for field, value in hf.items():
    if field in _REQUIRED and value not in _REQUIRED[field]:
      refuse(field, value, f"implemented: {' or '.join(map(json.dumps, _REQUIRED[field]))}")
  moe_every, nope_every = _pattern(hf, refuse)
  chunk = hf.get("attention_chunk_size") or 0
  heads, width = hf["num_attention_heads"], hf["hidden_size"]
  return {
      "vocab_size": hf["vocab_size"], "emb_dim": width, "num_layers": hf["num_hidden_layers"],
      "moe_every": moe_every, "nope_every": nope_every, "num_heads": heads,
      "num_kv_heads": hf.get("num_key_value_heads", heads),
      "head_dim": hf.get("head_dim") or width // heads, "mlp_dim": hf["intermediate_size_mlp"],
      "tie_embeddings": False, "qk_norm": False, "qk_l2_norm": bool(hf.get("use_qk_norm")),
      "shared_expert": True, "attention_chunk_size": chunk,
      "attn_temperature_tuning": bool(hf.get("attn_temperature_tuning", True)),
      "floor_scale": float(hf.get("floor_scale", 8192)),
      "attn_scale": float(hf.get("attn_scale", 0.1)), "norm_eps": float(hf["rms_norm_eps"]),
      **_rope(hf, refuse),
      "moe.num_experts": hf["num_local_experts"],
      "moe.num_experts_per_tok": hf["num_experts_per_tok"],
      "moe.mlp_dim": hf["intermediate_size"], "moe.router_score": "sigmoid",
      "moe.router_weights_on": "input", "moe.norm_topk_prob": True,
  }


def semantics(keys: dict[str, Any]) -> list[str]:
  """What a converted Llama 4 computes, one line per topic."""
  scaling = keys["rope_scaling.type"]
  return [
      f"MoE every {keys['moe_every']} layer(s), the others dense SwiGLU of {keys['mlp_dim']}; "
      f"no RoPE every {keys['nope_every'] or 'no'} layer(s) (whole prefix"
      f"{', temperature-tuned queries' if keys['attn_temperature_tuning'] else ''}), the "
      f"others within chunks of {keys['attention_chunk_size'] or 'the whole prefix'}",
      f"RoPE base {keys['rope_theta']:g}, interleaved pairs, scaling {scaling}; query/key L2 "
      f"norm after the rotation: {'yes' if keys['qk_l2_norm'] else 'no'}",
      f"router: sigmoid of the top-{keys['moe.num_experts_per_tok']} logits scaling the "
      "routed expert's input; a shared expert beside the routed ones"]
