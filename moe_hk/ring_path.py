"""The MoE layer on one shard by ring of experts: all-gather tokens, run local experts, reduce.

Shapes: D model width, E experts, K experts per token, P expert shards, L = E / P local
experts, T local tokens, G = P * T gathered tokens, R buffer rows.

Every shard sees the whole expert group's tokens and routing, picks the rows routed to its L
experts, runs them, and `psum_scatter`s the weighted outputs back to the tokens' own shards.
Drop order when capped: by local expert, then by position in the gathered batch (shard-major,
then (b, s, k)); the first R rows are kept.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_hk.config import MoEConfig
from moe_hk.expert_types import Backends, ExpertWeights
from moe_hk.expert_rows import grouped_experts_mlp, grouped_rows, weighted_inputs


def ring_moe(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, experts: ExpertWeights,
             *, rows: int, config: MoEConfig, backends: Backends) -> jax.Array:
  """One shard's MoE output by ring of experts with a buffer of `rows` rows.

  x `[T, D]`, expert_ids / weights `[T, K]` (this shard's routing) -> `[T, D]` float32. Rows
  of id E (`routing.unrouted_id`) are no shard's: every shard labels them L, so none runs them
  (`shard_forward` makes such a token's output row NaN).
  """
  axis = config.expert_axis
  _, k = expert_ids.shape
  local = config.num_experts // jax.lax.axis_size(axis)
  gathered_x = jax.lax.all_gather(x.astype(config.compute_dtype), axis, tiled=True)  # [G, D]
  gathered_ids = jax.lax.all_gather(expert_ids, axis, tiled=True).reshape(-1)  # [G * K]
  gathered_w = jax.lax.all_gather(weights, axis, tiled=True).reshape(-1)       # [G * K]

  local_id = gathered_ids - jax.lax.axis_index(axis) * local
  label = jnp.where((local_id >= 0) & (local_id < local), local_id, local)     # L: not ours
  picked = jnp.argsort(label, stable=True)[:rows]                # [R] by expert, then position
  counts = jnp.zeros((local + 1,), jnp.int32).at[label].add(1)[:local]
  before = jnp.cumsum(counts) - counts
  group_sizes = jnp.clip(rows - before, 0, counts)               # [L] kept prefix per expert
  picked_w = gathered_w[picked]                                  # [R]
  rows_in = weighted_inputs(grouped_rows(gathered_x, picked // k, group_sizes), picked_w,
                            config)
  out = grouped_experts_mlp(rows_in, experts, group_sizes, config,
                            backends)                            # [R, D], 0 past the kept rows
  out = out.astype(jnp.float32)
  weighted = out if config.router_weights_on == "input" else out * picked_w[:, None]
  tokens_out = jnp.zeros((gathered_x.shape[0], x.shape[-1]), jnp.float32)
  tokens_out = tokens_out.at[picked // k].add(weighted)          # [G, D]
  return jax.lax.psum_scatter(tokens_out, axis, scatter_dimension=0, tiled=True)
