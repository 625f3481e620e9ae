"""`MoEConfig`: the layer's settings, validated when constructed.

Checks that need the mesh or the input (experts divisible by the expert-axis size, batch
divisible by the devices) live in `moe_hk.mesh` (`check_layer`) and run when the layer first
sees both.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from moe_hk.buffer_size import WORST_CASE

FALLBACK_MODES = ("none", "layer", "step")
FALLBACK_CHUNKINGS = ("fixed", "adaptive")
A2A_IMPLS = ("auto", "native", "emulated")
GMM_IMPLS = ("auto", "ragged_dot", "blocked", "megablox", "tokamax")
ROUTER_SCORES = ("softmax", "sigmoid")
ROUTER_WEIGHTS_ON = ("output", "input")
DTYPES = ("float32", "bfloat16")


def _fail(field: str, value: Any, allowed: str) -> None:
  raise ValueError(f"MoEConfig.{field}={value!r} is invalid: {allowed}.")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Settings of one MoE layer, checked when constructed.

  Names follow the reference implementation where it has one; make variants with `replace`.
  Checks that need the mesh or the input run in `moe_hk.check_layer`.

  Attributes:
    num_experts: E, routed experts in the layer.
    num_experts_per_tok: K, experts each token is sent to (top-k), in [1, E].
    emb_dim: D, model width.
    mlp_dim: F, hidden width of each SwiGLU expert.
    ragged_buffer_factor: Receive buffer of each expert shard, in balanced loads: `factor x`
      the T * K rows a shard routes (at most the worst case), > 0; -1 is the worst case,
      which never drops a row.
    moe_dropless_fallback: What happens when a shard's buffer would overflow: 'none' drops
      rows; 'layer' (default) reruns the layer dropless over token chunks; 'step' runs the
      step dropless from its first overflowing MoE layer on (that layer and every later one
      take the chunked path; the layers before it fit their buffers, so their capped forward
      is the dropless one). Both paths. With the worst-case buffer nothing can overflow and no
      fallback is built, so the default costs nothing there.
    dropless_fallback_num_chunks: Token chunks of the fallback, each with its chunk's
      worst-case buffer; 0 picks the fewest whose buffer fits the capped one. A count that
      does not divide the local sequence or fit the capped buffer is refused when the layer
      is traced.
    dropless_fallback_chunking: How the 'layer' fallback chunks. 'adaptive' (default)
      decides at run time from the step's traffic: the first rung of a ladder (chunk count,
      buffer rows per chunk: 1.26, 1.58, 2.0, ... capped buffers in all, up to 3.98, then the
      count above) whose every chunk fits, so an overflow costs about what its rows need.
      'fixed' always runs the count above (sized for the worst case, whatever the overflow):
      one compiled branch, the shortest compile (each rung is a compiled branch). 'step'
      mode always runs the count above.
    use_ring_of_experts: All-gather the expert group's tokens and run the local experts on
      them (then reduce-scatter), instead of the ragged all-to-all.
    a2a_impl: Ragged all-to-all backend: 'native' (XLA's; TPU, GPU), 'emulated' (dense
      collectives, same results; CPU), or 'auto' (by the mesh's platform).
    gmm_impl: Grouped-matmul backend: 'ragged_dot' (XLA's; TPU), 'megablox' (jax's Pallas
      TPU kernels; TPU, interpreted on CPU), 'tokamax' (tokamax's Pallas Mosaic GPU kernels
      for bfloat16, XLA's ragged_dot for float32; GPU, on tokamax's XLA reference on CPU;
      not TPU), 'blocked' (CPU, GPU), or 'auto' (ragged_dot on TPU, else blocked).
    gmm_block_rows: Row block of the 'blocked' grouped matmul.
    router_score: Combine weights: 'softmax' over the K selected logits, or 'sigmoid' of each
      selected logit (Llama4; top-1 weights then still train the router).
    norm_topk_prob: With 'softmax': True (default) renormalises the K selected experts'
      probabilities to sum to 1 (the softmax over their logits: Mixtral, Qwen3-MoE's
      `norm_topk_prob=True`); False keeps each one's probability under the softmax over all
      E logits (Qwen3-MoE's `norm_topk_prob=False`). 'sigmoid' needs True (no sum to keep).
    router_weights_on: Where a token's router weight applies: 'output' (default) weighs each
      of its K experts' outputs before they are summed (Mixtral, Qwen3-MoE); 'input' scales
      the row each expert receives and sums the K outputs as they are (Llama 4, whose sigmoid
      scores multiply the routed expert's input). The two differ: SwiGLU is not linear.
    dtype: Compute dtype of the expert matmuls, 'float32' or 'bfloat16' (a name or a jnp
      dtype, stored as its name); parameters stay float32.
    load_balance_loss_weight: Weight of the Switch-style load-balance loss in
      `MoEStats.lb_loss`.
    router_z_loss_weight: Weight of the ST-MoE router z-loss in `MoEStats.z_loss` (1e-3 is
      the usual choice; 0 by default).
    expert_axis: Mesh axis the experts are sharded over.
    stream_step_stats: Send every step's stats (required factor, fallback, drops) to the
      host through `jax.debug.callback` when the layer is given a step
      (`moe_hk.events.STEP_STATS_EVENT`); the step returns them either way.
    emit_fallback_events: Call back to the host from the branch that fell back
      (`moe_hk.events.FALLBACK_EVENT`) when the layer is given a step, so host alerts react
      at once.
    record_traffic: Report every device's routed rows per expert
      (`MoEStats.routed_rows_per_device`), the traffic a capacity planner replays; off, that
      field is empty (`[0, E]`).

  Raises:
    ValueError: When constructed with a value outside the ranges above, in one line naming
      the field, the value and what is valid.
  """

  num_experts: int
  num_experts_per_tok: int
  emb_dim: int
  mlp_dim: int
  ragged_buffer_factor: float = float(WORST_CASE)
  moe_dropless_fallback: str = "layer"
  dropless_fallback_num_chunks: int = 0
  dropless_fallback_chunking: str = "adaptive"
  use_ring_of_experts: bool = False
  a2a_impl: str = "auto"
  gmm_impl: str = "auto"
  gmm_block_rows: int = 128
  router_score: str = "softmax"
  norm_topk_prob: bool = True
  router_weights_on: str = "output"
  dtype: str = "float32"
  load_balance_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.0
  expert_axis: str = "expert"
  stream_step_stats: bool = True
  emit_fallback_events: bool = True
  record_traffic: bool = False

  def __post_init__(self):
    for name in ("num_experts", "num_experts_per_tok", "emb_dim", "mlp_dim", "gmm_block_rows"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(name, value, "must be a positive integer")
    if self.num_experts_per_tok > self.num_experts:
      _fail("num_experts_per_tok", self.num_experts_per_tok,
            f"must be in [1, num_experts={self.num_experts}]")
    factor = self.ragged_buffer_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
        factor == WORST_CASE or factor > 0):
      _fail("ragged_buffer_factor", factor, "must be -1 (worst-case buffer) or > 0")
    self._check_choice("moe_dropless_fallback", FALLBACK_MODES)
    self._check_choice("dropless_fallback_chunking", FALLBACK_CHUNKINGS)
    self._check_choice("a2a_impl", A2A_IMPLS)
    self._check_choice("gmm_impl", GMM_IMPLS)
    self._check_choice("router_score", ROUTER_SCORES)
    self._check_choice("router_weights_on", ROUTER_WEIGHTS_ON)
    if not isinstance(self.norm_topk_prob, bool) or (
        not self.norm_topk_prob and self.router_score != "softmax"):
      _fail("norm_topk_prob", self.norm_topk_prob,
            "must be True or False, and False only with router_score='softmax'")
    self._normalise_dtype()
    chunks = self.dropless_fallback_num_chunks
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
      _fail("dropless_fallback_num_chunks", chunks, "must be 0 (automatic) or a positive integer")
    for name in ("load_balance_loss_weight", "router_z_loss_weight"):
      if getattr(self, name) < 0:
        _fail(name, getattr(self, name), "must be >= 0")
    if not self.expert_axis or not isinstance(self.expert_axis, str):
      _fail("expert_axis", self.expert_axis, "must be a mesh axis name")

  def _normalise_dtype(self) -> None:
    """Accepts a dtype name or a jnp/numpy dtype; stores the name."""
    try:
      name = jnp.dtype(self.dtype).name
    except TypeError:
      name = None
    if name not in DTYPES:
      _fail("dtype", self.dtype, "must be one of " + ", ".join(repr(a) for a in DTYPES) +
            " (a name or the jnp dtype)")
    object.__setattr__(self, "dtype", name)

  def _check_choice(self, field: str, allowed: tuple[str, ...]) -> None:
    value = getattr(self, field)
    if value not in allowed:
      _fail(field, value, "must be one of " + ", ".join(repr(a) for a in allowed))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def falls_back(self) -> bool:
    """Whether an overflow runs the layer dropless (`moe_dropless_fallback` 'layer' or
    'step') rather than dropping rows ('none')."""
    return self.moe_dropless_fallback != "none"

  @property
  def layer_fallback(self) -> bool:
    """'layer': an overflowing layer alone reruns dropless, in chunks."""
    return self.moe_dropless_fallback == "layer"

  @property
  def step_fallback(self) -> bool:
    """'step': from the first overflowing layer on, every MoE layer of the step runs
    dropless (`moe_hk.step_mode`)."""
    return self.moe_dropless_fallback == "step"

  @property
  def capped(self) -> bool:
    """True when the receive buffer is smaller than the worst case can be."""
    return self.ragged_buffer_factor != WORST_CASE

  def replace(self, **changes) -> "MoEConfig":
    return dataclasses.replace(self, **changes)
