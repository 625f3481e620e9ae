"""Llama 4 (`Llama4ForCausalLM`, `model_type='llama4_text'`, and the language model of the
multimodal `Llama4ForConditionalGeneration`, `'llama4'`, whose tensors sit under
`language_model.`): every `interleave_moe_layer_step`-th layer MoE, the others dense of
`intermediate_size_mlp`; the experts fused (`feed_forward.experts.gate_up_proj [E, D, 2F]`,
gate then up, and `down_proj [E, F, D]`, both `[in, out]`), the router
`feed_forward.router`, a shared expert `feed_forward.shared_expert`.

The launcher's model groups one period of the layer pattern (MoE every `moe_every`-th, NoPE
every `nope_every`-th block) per layer-stack entry, so Hugging Face layer L is block
L mod period of group L // period.
"""
from __future__ import annotations

import dataclasses
import math

from launch.hf.family import Family, Tensor

_GROUP = "model/groups/model/~_group/block_{}"


@dataclasses.dataclass(frozen=True)
class Llama4Family(Family):
  """Llama 4's names; `prefix` is where the language model's tensors sit."""
  prefix: str = ""

  def tensors(self, keys: dict | None = None) -> list[Tensor]:
    """Every leaf of the model built from `keys` (the model's config keys) and its name."""
    period = math.lcm(keys["moe_every"], keys["nope_every"] or 1)
    p, width = self.prefix, keys["moe.mlp_dim"]
    out = [Tensor("model/embed", "embeddings", p + "model.embed_tokens.weight", False, 0),
           Tensor("model", "final_norm", p + "model.norm.weight", False, 0),
           Tensor("model", "unembed", p + "lm_head.weight", False, 0)]
    for block in range(period):
      at = dict(period=period, offset=block)
      module, layer = _GROUP.format(block), p + "model.layers.{layer}."
      out += [Tensor(module, "attention_norm", layer + "input_layernorm.weight", False, 1, **at),
              Tensor(module, "mlp_norm", layer + "post_attention_layernorm.weight", False, 1,
                     **at)]
      out += [Tensor(module, n, layer + f"self_attn.{n}_proj.weight", True, 1, **at)
              for n in "qkvo"]
      ff = layer + "feed_forward."
      if (block + 1) % keys["moe_every"]:  # a dense block
        out += [Tensor(module + "/mlp", n, ff + f"{hf}_proj.weight", True, 1, **at)
                for n, hf in zip(("wi_0", "wi_1", "wo"), ("gate", "up", "down"))]
        continue
      out += [Tensor(module + "/moe/router", "w", ff + "router.weight", True, 1, **at),
              Tensor(module + "/moe", "wi_0", ff + "experts.gate_up_proj", False, 1,
                     columns=(0, width, 2 * width), **at),
              Tensor(module + "/moe", "wi_1", ff + "experts.gate_up_proj", False, 1,
                     columns=(width, 2 * width, 2 * width), **at),
              Tensor(module + "/moe", "wo", ff + "experts.down_proj", False, 1, **at)]
      out += [Tensor(module + "/shared_expert", n, ff + f"shared_expert.{hf}_proj.weight", True,
                     1, **at) for n, hf in zip(("wi_0", "wi_1", "wo"), ("gate", "up", "down"))]
    return out


_NAMES = dict(moe="feed_forward", experts=("gate_up_proj", "gate_up_proj", "down_proj"),
              router="router", experts_field="num_local_experts",
              expert_width_field="intermediate_size", qk_norm=False)
TEXT = Llama4Family(model_type="llama4_text", architecture="Llama4ForCausalLM", **_NAMES)
MULTIMODAL = Llama4Family(model_type="llama4", architecture="Llama4ForConditionalGeneration",
                          prefix="language_model.", **_NAMES)
