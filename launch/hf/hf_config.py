"""A Hugging Face `config.json` as the launcher's model keys, and back.

`model_keys` reads the shapes and semantics of a supported family's config and refuses, in one
line naming the field and its value, anything the model does not implement: a sliding window,
RoPE scaling, biases, another activation, dense layers between MoE ones, a field its family's
reader does not read that is not in BOOKKEEPING (the fields known not to change the model). The
RoPE base is read from `rope_parameters` (transformers 5) or the top level (transformers 4),
which must agree when both are there; the expert count from `num_experts` or
`num_local_experts` likewise.
"""
from __future__ import annotations

import json
import os
from typing import Any

from launch.hf import llama4, llama4_config, mixtral, qwen3_moe
from launch.hf.family import Family
from launch.setup.errors import UserError

FAMILIES = {f.model_type: f for f in (mixtral.FAMILY, qwen3_moe.FAMILY, llama4.TEXT,
                                      llama4.MULTIMODAL)}
# Fields known not to change what the model computes, in every family: the file's and
# transformers' bookkeeping (the model type, which `family_of` reads; versions, dtypes, the
# attention backend transformers picked, the cache generation uses), token ids, training-only
# settings, the context length (a RoPE scaling is read from rope_scaling) and a flag of Llama 4's
# release that transformers does not read (`for_llm_compressor`). Any other field is read by the
# family's `model_keys` or refused.
BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "_attn_implementation_autoset", "cache_implementation", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "output_router_logits",
    "router_aux_loss_coef", "attention_dropout", "max_position_embeddings",
    "for_llm_compressor",
}
# Fields of Mixtral and Qwen3-MoE that `model_keys` reads and checks (`max_window_layers` says
# which layers a sliding window covers: checked through `use_sliding_window`, required false).
_READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings", "hidden_act",
    "sliding_window", "use_sliding_window", "max_window_layers", "attention_bias",
    "router_jitter_noise", "decoder_sparse_step", "mlp_only_layers", "layer_types",
}
# field -> the values the model implements (what published checkpoints of the families hold).
_REQUIRED = {
    "rope_scaling": (None,), "tie_word_embeddings": (False,), "hidden_act": ("silu",),
    "attention_bias": (False,), "router_jitter_noise": (0, 0.0), "decoder_sparse_step": (1,),
    "mlp_only_layers": ([],), "use_sliding_window": (False,),
}


def read(folder: str) -> dict[str, Any]:
  """`folder/config.json` as a dict; UserError without one."""
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"--from_hf={folder}: no config.json there; pass a Hugging Face "
                    "checkpoint folder (config.json and *.safetensors).")
  with open(path) as f:
    return json.load(f)


def _shown(value: Any) -> str:
  """`value` as JSON, cut to 100 characters (a quantization scheme would fill the screen)."""
  text = json.dumps(value)
  return text if len(text) <= 100 else text[:97] + "..."


def _refuse(field: str, value: Any, why: str) -> None:
  raise UserError(f"config.json {field}={_shown(value)}: {why}; launch.convert does not "
                  "convert this checkpoint.")


def family_of(hf: dict[str, Any]) -> Family:
  """The family of `hf`'s model_type; UserError naming the supported ones."""
  kind = hf.get("model_type")
  if kind not in FAMILIES:
    _refuse("model_type", kind, f"supported: {', '.join(FAMILIES)}")
  return FAMILIES[kind]


def _one(hf: dict[str, Any], field: str, *where: tuple[str, ...]) -> Any:
  """The value of `field` found at each path of `where` in `hf` (absent ones skipped), which
  must agree; UserError when none has it or two differ."""
  found = {}
  for path in where:
    node = hf
    for part in path:
      node = node.get(part) if isinstance(node, dict) else None
    if node is not None:
      found[".".join(path)] = node
  if not found:
    _refuse(field, None, f"needs one of {', '.join('.'.join(p) for p in where)}")
  if len(set(map(json.dumps, found.values()))) > 1:
    _refuse(field, found, "the places it is given disagree")
  return next(iter(found.values()))


def _known(hf: dict[str, Any], read: set[str]) -> None:
  """Refuses a field of `hf` that is neither in `read` (the fields its reader reads) nor in
  BOOKKEEPING."""
  for field, value in hf.items():
    if field not in read and field not in BOOKKEEPING:
      _refuse(field, value, "a field launch.convert does not know (it may change the model)")


def _check(hf: dict[str, Any]) -> None:
  """Refuses a field the converter does not know, or a value the model does not implement."""
  _known(hf, _READ)
  for field, value in hf.items():
    if field in _REQUIRED and value not in _REQUIRED[field]:
      _refuse(field, value, f"implemented: {' or '.join(map(json.dumps, _REQUIRED[field]))}")
  if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
    _refuse("sliding_window", hf["sliding_window"], "sliding-window attention is not "
            "implemented (implemented: null)")
  rope = hf.get("rope_parameters") or {}
  if rope.get("rope_type", "default") != "default":
    _refuse("rope_parameters.rope_type", rope["rope_type"], "implemented: \"default\"")
  if any(t != "full_attention" for t in hf.get("layer_types") or []):
    _refuse("layer_types", hf["layer_types"], "implemented: \"full_attention\" only")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The language model's config: `hf`, or a multimodal checkpoint's `text_config` (its other
  fields checked known: the vision tower is not converted)."""
  if family_of(hf) is not llama4.MULTIMODAL:
    return hf
  _known(hf, llama4_config.MULTIMODAL_READ)
  return hf["text_config"]


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
  """The launcher's config keys (dotted) for a checkpoint of config `hf`."""
  family = family_of(hf)
  if isinstance(family, llama4.Llama4Family):
    text = text_config(hf)
    _known(text, llama4_config.READ)
    return llama4_config.model_keys(text, _refuse)
  _check(hf)
  for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "num_experts_per_tok", "rms_norm_eps",
                family.expert_width_field):
    if hf.get(field) is None:
      _refuse(field, None, "the model's shape needs it")
  heads, width = hf["num_attention_heads"], hf["hidden_size"]
  experts = _one(hf, "num_experts", ("num_experts",), ("num_local_experts",))
  return {
      "vocab_size": hf["vocab_size"], "emb_dim": width, "num_layers": hf["num_hidden_layers"],
      "moe_every": 1, "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", heads),
      "head_dim": hf.get("head_dim") or width // heads, "mlp_dim": hf["intermediate_size"],
      "tie_embeddings": False, "qk_norm": family.qk_norm, "shared_expert": False,
      "rope_theta": float(_one(hf, "rope_theta", ("rope_parameters", "rope_theta"),
                               ("rope_theta",))),
      "norm_eps": float(hf["rms_norm_eps"]),
      "moe.num_experts": experts, "moe.num_experts_per_tok": hf["num_experts_per_tok"],
      "moe.mlp_dim": hf[family.expert_width_field], "moe.router_score": "softmax",
      "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
  }


def semantics(keys: dict[str, Any], family: Family) -> str:
  """What the converted model computes, in one line per topic, for the console."""
  if isinstance(family, llama4.Llama4Family):
    return "\n".join([
        f"family {family.model_type} ({family.architecture}): {keys['num_layers']} layers; "
        f"width {keys['emb_dim']}, {keys['num_heads']} query / {keys['num_kv_heads']} "
        f"key-value heads of {keys['head_dim']}" + (
            "; the vision tower is not converted" if family is llama4.MULTIMODAL else ""),
        *llama4_config.semantics(keys),
        f"RMSNorm epsilon {keys['norm_eps']:g}; output projection untied (lm_head)",
        f"experts {keys['moe.num_experts']}, expert width {keys['moe.mlp_dim']}"])
  return "\n".join([
      f"family {family.model_type} ({family.architecture}): {keys['num_layers']} layers, "
      f"every one MoE; width {keys['emb_dim']}, {keys['num_heads']} query / "
      f"{keys['num_kv_heads']} key-value heads of {keys['head_dim']}",
      f"RoPE base {keys['rope_theta']:g}, rotate-half layout (dimension i with i + head_dim/2)",
      f"RMSNorm epsilon {keys['norm_eps']:g}; per-head query/key norms: "
      f"{'yes' if keys['qk_norm'] else 'no'}",
      "output projection untied (lm_head), logits not scaled",
      f"experts {keys['moe.num_experts']}, top-{keys['moe.num_experts_per_tok']}, softmax "
      f"router, top-k weights {'' if keys['moe.norm_topk_prob'] else 'not '}renormalised; "
      f"expert width {keys['moe.mlp_dim']}"])


def exported(hf: dict[str, Any], dtype: str) -> tuple[dict[str, Any], Family]:
  """The config.json of an export and its family: the imported one (a multimodal Llama 4's
  language model as `llama4_text`: the vision tower was not imported) with `dtype`, and the
  RoPE base and scaling both at the top level (`rope_theta`, `rope_scaling`: transformers 4)
  and in `rope_parameters` (transformers 5)."""
  family = family_of(hf)
  if family is llama4.MULTIMODAL:
    hf = dict(text_config(hf), model_type=llama4.TEXT.model_type,
              architectures=[llama4.TEXT.architecture])
    family = llama4.TEXT
  theta = _one(hf, "rope_theta", ("rope_parameters", "rope_theta"), ("rope_theta",))
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
  rope["rope_theta"] = theta
  scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
  out = dict(hf, dtype=dtype, torch_dtype=dtype, rope_theta=theta, rope_parameters=rope,
             rope_scaling=None if scaling["rope_type"] == "default" else scaling)
  return out, family
