"""`MoEConfig`: the layer's settings, validated when constructed.

Checks that need the mesh or the input (experts divisible by the expert-axis size, batch
divisible by the devices) live in `moe_hk.mesh` and run when the layer first sees both.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FALLBACK_MODES = ("none", "layer", "step")
FALLBACK_CHUNKINGS = ("fixed", "adaptive")
A2A_IMPLS = ("auto", "native", "emulated")
GMM_IMPLS = ("auto", "ragged_dot", "blocked", "megablox")
ROUTER_SCORES = ("softmax", "sigmoid")
DTYPES = ("float32", "bfloat16")


def _fail(field: str, value: Any, allowed: str) -> None:
  raise ValueError(f"MoEConfig.{field}={value!r} is invalid: {allowed}.")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Settings of one MoE layer (names follow the reference implementation where it has one)."""

  num_experts: int                 # E: routed experts in the layer.
  num_experts_per_tok: int         # K: experts each token is sent to (top-k).
  emb_dim: int                     # D: model width.
  mlp_dim: int                     # F: hidden width of each SwiGLU expert.
  # Receive buffer per EP shard = factor x balanced rows (T * K); -1 = worst case (never drops).
  ragged_buffer_factor: float = -1.0
  # What happens when a shard's buffer would overflow: 'none' drops rows, 'layer' reruns the
  # layer dropless over token chunks, 'step' runs the step dropless from its first
  # overflowing MoE layer on: that layer and every later one take the chunked path (the layers
  # before it fit their buffers, so their capped forward is the dropless one). Either path.
  # 'layer' by default: no row is dropped unless asked; with the worst-case buffer (factor -1)
  # nothing can overflow and no fallback is built, so it costs nothing there.
  moe_dropless_fallback: str = "layer"
  # 0 picks the fewest token chunks whose worst-case buffer fits the capped one.
  dropless_fallback_num_chunks: int = 0
  # How the 'layer' fallback chunks (both paths). 'adaptive' decides at run time from the
  # step's traffic: the first rung of a ladder (chunk count, buffer rows per chunk: 1.26, 1.58,
  # 2.0, ... capped buffers in all, up to 3.98, then the count above) whose every chunk fits,
  # so an overflow costs about what its rows need. 'fixed' always runs the count above (n,
  # sized for the worst case, whatever the overflow), one compiled branch: the shortest
  # compile (each rung is a compiled branch). 'step' mode always runs n.
  dropless_fallback_chunking: str = "adaptive"
  use_ring_of_experts: bool = False   # All-gather tokens instead of the ragged all-to-all.
  a2a_impl: str = "auto"              # 'native' (TPU/GPU), 'emulated' (CPU), 'auto' by platform.
  # 'ragged_dot' (XLA's; TPU), 'megablox' (jax's Pallas TPU kernels; TPU, interpreted on
  # CPU), 'blocked' (CPU, GPU), or 'auto' by platform (ragged_dot on TPU, else blocked).
  gmm_impl: str = "auto"
  gmm_block_rows: int = 128           # Row block of the 'blocked' grouped matmul.
  router_score: str = "softmax"       # 'softmax' over the K selected logits, or 'sigmoid'.
  # Compute dtype of the expert matmuls (a name or a jnp dtype, stored as its name); params
  # stay float32.
  dtype: str = "float32"
  load_balance_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.0   # ST-MoE z-loss weight (1e-3 is the usual choice).
  expert_axis: str = "expert"         # Mesh axis the experts are sharded over.
  # Stream each step's stats (required factor, fallback, drops) to the host through
  # jax.debug.callback when the layer is given a step; the step returns them either way.
  stream_step_stats: bool = True
  # Call back to the host from the branch that fell back (`moe_dropless_fallback_layers`
  # events) when the layer is given a step, so host alerts react at once.
  emit_fallback_events: bool = True
  # Report every device's routed rows per expert (`MoEStats.routed_rows_per_device`), the
  # traffic a capacity planner replays; off, that field is empty ([0, E]).
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
        factor == -1 or factor > 0):
      _fail("ragged_buffer_factor", factor, "must be -1 (worst-case buffer) or > 0")
    self._check_choice("moe_dropless_fallback", FALLBACK_MODES)
    self._check_choice("dropless_fallback_chunking", FALLBACK_CHUNKINGS)
    self._check_choice("a2a_impl", A2A_IMPLS)
    self._check_choice("gmm_impl", GMM_IMPLS)
    self._check_choice("router_score", ROUTER_SCORES)
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
  def capped(self) -> bool:
    """True when the receive buffer is smaller than the worst case can be."""
    return self.ragged_buffer_factor != -1

  def replace(self, **changes) -> "MoEConfig":
    return dataclasses.replace(self, **changes)
