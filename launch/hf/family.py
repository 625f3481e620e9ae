"""What a Hugging Face family is to the converter: its names for the model's tensors.

A family maps every parameter leaf of the launcher's model (built with `moe_every=1`, an
untied output projection) to a tensor name of the published layout. Leaves of the layer stack
hold every layer (`[n, ...]`), the experts' every expert too (`[n, E, ...]`); Hugging Face
stores one `[out, in]` tensor per layer (and expert), so a `dense` weight `[in, out]` is its
transpose.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

# The layer stack's block of the launcher's model with moe_every=1 (launch.model.transformer).
BLOCK = "model/groups/model/~_group/block_0"


class Tensor(NamedTuple):
  """One parameter leaf `params[module][name]` and the Hugging Face tensors it holds."""
  module: str
  name: str
  hf: str           # the name, with {layer} and {expert} where the leaf stacks them
  transpose: bool   # the leaf's trailing two axes are the Hugging Face tensor's swapped
  stacked: int      # leading axes the leaf stacks: 0, 1 (layers) or 2 (layers, experts)
  # The leaf's layer i (of the layer stack) is the Hugging Face layer i x period + offset:
  # a layer group of `period` blocks, this leaf in block `offset`.
  period: int = 1
  offset: int = 0
  # (start, stop, width): the leaf is columns start .. stop - 1 of the Hugging Face tensor's
  # last axis, `width` wide (two leaves fused in one tensor: Llama 4's gate_up_proj); None:
  # all of it.
  columns: tuple[int, int, int] | None = None

  def hf_name(self, ids: tuple[int, ...]) -> str:
    """The Hugging Face name of the tensor at leading index `ids` (layer, expert)."""
    named = dict(zip(("layer", "expert"), ids))
    if "layer" in named:
      named["layer"] = named["layer"] * self.period + self.offset
    return self.hf.format(**named)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model_type the converter reads and writes."""
  model_type: str                       # config.json's model_type
  architecture: str                     # the transformers class, config.json's architectures
  moe: str                              # the MoE block's module name in a layer
  experts: tuple[str, str, str]         # its experts' gate, up and down projections
  router: str                           # the router's name under `moe`
  experts_field: str                    # config.json's expert count
  expert_width_field: str               # config.json's expert hidden width
  qk_norm: bool                         # per-head query/key RMSNorms (self_attn.q_norm, k_norm)

  def tensors(self, keys: dict | None = None) -> list[Tensor]:
    """Every leaf of the model's parameters and its Hugging Face name (`keys`, the model's
    config keys, matter to families whose layers differ: `launch.hf.llama4`)."""
    layer, moe = "model.layers.{layer}.", f"model.layers.{{layer}}.{self.moe}."
    expert = moe + "experts.{expert}."
    out = [Tensor("model/embed", "embeddings", "model.embed_tokens.weight", False, 0),
           Tensor("model", "final_norm", "model.norm.weight", False, 0),
           Tensor("model", "unembed", "lm_head.weight", False, 0),
           Tensor(BLOCK, "attention_norm", layer + "input_layernorm.weight", False, 1),
           Tensor(BLOCK, "mlp_norm", layer + "post_attention_layernorm.weight", False, 1),
           Tensor(f"{BLOCK}/moe/router", "w", moe + f"{self.router}.weight", True, 1)]
    out += [Tensor(BLOCK, n, layer + f"self_attn.{n}_proj.weight", True, 1) for n in "qkvo"]
    if self.qk_norm:
      out += [Tensor(BLOCK, n, layer + f"self_attn.{n}.weight", False, 1)
              for n in ("q_norm", "k_norm")]
    out += [Tensor(f"{BLOCK}/moe", n, expert + f"{hf}.weight", True, 2)
            for n, hf in zip(("wi_0", "wi_1", "wo"), self.experts)]
    return out
