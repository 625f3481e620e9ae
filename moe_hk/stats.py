"""`MoEStats`: what one MoE layer reports per step, and how a shard's view becomes the global one.

Shapes: E experts, P expert shards (the size of the expert axis).

Inside `shard_map` every shard computes its own `MoEStats` (`moe_hk.shard_forward.moe_shard`);
`reduce_stats` turns them into the layer's global stats, identical on every device, with one
reduction per field from `REDUCTIONS`. A new field is one line in `MoEStats`, one entry in
`REDUCTIONS`, and its per-shard value in `moe_shard`.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from moe_hk.config import MoEConfig


class MoEStats(NamedTuple):
  """Per-layer, per-step statistics of the MoE layer, global over the mesh.

  What `moe_hk.moe_forward` returns beside `y`, and what `moe_hk.MoELayer` puts in Haiku state
  (or returns with `return_stats=True`). Every field is the same on every device. Inside the
  layer's `shard_map` the same type holds one shard's view before `reduce_stats` (see
  `REDUCTIONS` for what each field is there).

  Attributes:
    fallback: `[]` int32, 1 if the dropless fallback ran this step.
    required_factor: `[]` float32, the smallest `ragged_buffer_factor` that would have dropped
      nothing: max over expert groups and receivers of rows received / balanced rows (T * K).
    would_drop_rows: `[]` int32, rows beyond the capped buffers, whether or not the fallback
      then ran.
    dropped_rows: `[]` int32, rows actually dropped (0 when the fallback ran or the buffer is
      the worst case).
    tokens_per_expert: `[E]` int32, routed rows per expert over the whole batch.
    nonfinite_tokens: `[]` int32, tokens whose router logits are not all finite, over the whole
      batch: routed to no expert (in no count above or below: no overflow, no fallback), their
      output rows NaN.
    lb_loss: `[]` float32, load-balance loss x `load_balance_loss_weight`.
    z_loss: `[]` float32, router z-loss x `router_z_loss_weight`.
    fallback_chunks: `[]` int32, chunks the dropless fallback ran in (0 if it did not): the
      count of the rung that ran. Adaptive rungs of one count differ in buffer rows per chunk
      (`moe_hk.fallback.traffic_ladder`), each chunk no larger than the fixed fallback's.
    router_entropy: `[]` float32, mean over tokens of the entropy (nats) of the router's
      softmax over all experts.
    receiver_overflow_rows: `[P]` int32, rows beyond the capped buffer of each receiving expert
      shard, summed over expert groups (sums to `would_drop_rows`): which receivers overflowed.
    routed_rows_per_device: `[devices, E]` int32 with `MoEConfig.record_traffic` (else
      `[0, E]`): rows each device routed to each expert, devices in mesh order (expert axis
      fastest: P consecutive devices are one expert group).
  """
  fallback: jax.Array
  required_factor: jax.Array
  would_drop_rows: jax.Array
  dropped_rows: jax.Array
  tokens_per_expert: jax.Array
  nonfinite_tokens: jax.Array
  lb_loss: jax.Array
  z_loss: jax.Array
  fallback_chunks: jax.Array
  router_entropy: jax.Array
  receiver_overflow_rows: jax.Array
  routed_rows_per_device: jax.Array


class MeshReduction:
  """The collectives that turn one shard's `MoEStats` into global ones (inside shard_map)."""

  def __init__(self, local: MoEStats, mesh: Mesh, config: MoEConfig):
    self.local, self.config, self.devices = local, config, mesh.size
    self.axes = tuple(mesh.axis_names)
    self.other_axes = tuple(a for a in self.axes if a != config.expert_axis)

  def max(self, value: jax.Array) -> jax.Array:
    return jax.lax.pmax(value, self.axes)

  def sum(self, value: jax.Array) -> jax.Array:
    return jax.lax.psum(value, self.axes)

  def mean(self, value: jax.Array) -> jax.Array:
    return jax.lax.pmean(value, self.axes)

  def per_group(self, value: jax.Array) -> jax.Array:
    """An expert group's quantity (traffic-derived: equal on the group's shards), taken once
    per group (pmax over the expert axis) and summed over the groups."""
    return jax.lax.psum(jax.lax.pmax(value, self.config.expert_axis), self.other_axes)

  @staticmethod
  def weighted_mean(weight: str) -> Callable[[MeshReduction, jax.Array], jax.Array]:
    """The mean times the config field `weight` (a loss as the step adds it)."""
    return lambda r, value: r.mean(value) * getattr(r.config, weight)

  @functools.cached_property
  def rows_per_device(self) -> jax.Array:
    """`[devices, E]`: every device's `tokens_per_expert`, replicated, devices in mesh order
    (the last axis fastest). A psum of one-hot rows (an all_gather over several axes is not
    inferred replicated by shard_map)."""
    value = self.local.tokens_per_expert
    rows = jnp.zeros((self.devices, *value.shape), value.dtype)
    return jax.lax.psum(rows.at[jax.lax.axis_index(self.axes)].set(value), self.axes)

  def routed_rows(self, value: jax.Array) -> jax.Array:
    """This shard's rows per expert `[E]` -> the batch's. When the traffic is recorded its
    per-device rows sum to the global counts: one collective serves both."""
    if self.config.record_traffic:
      return self.rows_per_device.sum(axis=0, dtype=value.dtype)
    return self.sum(value)

  def traffic(self, placeholder: jax.Array) -> jax.Array:
    """The empty `[0, E]` per shard -> `rows_per_device` with `record_traffic`, else itself."""
    return self.rows_per_device if self.config.record_traffic else placeholder


# Each field's reduction, `(MeshReduction, one shard's value) -> global value`; the comment
# says what the field holds on one shard.
REDUCTIONS: dict[str, Callable[[MeshReduction, jax.Array], jax.Array]] = {
    "fallback": MeshReduction.max,                # 1 if this device ran the fallback.
    "required_factor": MeshReduction.max,         # The expert group's (same on its shards).
    "would_drop_rows": MeshReduction.per_group,   # The group's rows beyond the capped buffer.
    "dropped_rows": MeshReduction.per_group,      # The group's rows actually dropped.
    "tokens_per_expert": MeshReduction.routed_rows,  # This shard's routed rows per expert.
    "nonfinite_tokens": MeshReduction.sum,        # This shard's non-finite tokens.
    "lb_loss": MeshReduction.weighted_mean("load_balance_loss_weight"),  # Unweighted.
    "z_loss": MeshReduction.weighted_mean("router_z_loss_weight"),       # Unweighted.
    "fallback_chunks": MeshReduction.max,         # Chunks of the rung that ran (the same).
    "router_entropy": MeshReduction.mean,         # This shard's mean router entropy.
    "receiver_overflow_rows": MeshReduction.per_group,  # [P] the group's, per receiver.
    "routed_rows_per_device": MeshReduction.traffic,    # [0, E] placeholder.
}
assert tuple(REDUCTIONS) == MoEStats._fields, "REDUCTIONS needs one entry per MoEStats field"


def reduce_stats(local: MoEStats, mesh: Mesh, config: MoEConfig) -> MoEStats:
  """Turns one shard's stats into global ones, identical on every device (inside shard_map
  over `mesh`), field by field with `REDUCTIONS`."""
  reduction = MeshReduction(local, mesh, config)
  return MoEStats(*(REDUCTIONS[name](reduction, value)
                    for name, value in zip(MoEStats._fields, local)))
