"""The MoE layer on one expert-parallel shard over a ragged all-to-all (runs inside shard_map).

Shapes: B local batch, S sequence, D model width, F expert width, E experts, K experts per
token, P expert shards, L = E / P local experts, T = B * S local tokens, N = T * K routed rows,
R receive-buffer rows.

Data path: route -> sort the N rows by expert -> all-gather per-expert counts -> plan (with
truncation when capped) -> ragged all-to-all into a zeroed [R, D] buffer -> group by local
expert -> SwiGLU grouped matmul -> ungroup -> reverse all-to-all into the senders' slots ->
unsort -> weighted sum over K. Dropped rows come back as exact zeros.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_hk import dispatch_plan, routing as routing_lib
from moe_hk.all_to_all import ragged_all_to_all
from moe_hk.config import MoEConfig
from moe_hk.grouped_matmul import expert_mlp


class ExpertWeights(NamedTuple):
  """This shard's experts (already gathered over fsdp)."""
  wi_0: jax.Array  # [L, D, F]
  wi_1: jax.Array  # [L, D, F]
  wo: jax.Array    # [L, F, D]


class ShardStats(NamedTuple):
  """One shard's view before reduction over the mesh (see `MoEStats` for the reduced form)."""
  required_factor: jax.Array    # [] float32, same on every shard of the expert group.
  would_drop_rows: jax.Array    # [] int32, rows of the expert group beyond the cap.
  dropped_rows: jax.Array       # [] int32, rows of the expert group actually dropped.
  tokens_per_expert: jax.Array  # [E] int32, this shard's routed rows per expert.
  lb_loss: jax.Array            # [] float32, this shard's unweighted load-balance loss.


def combine_rows(rows: jax.Array, weights: jax.Array) -> jax.Array:
  """Weighted sum over K: rows `[T * K, D]` in (t, k) order, weights `[T, K]` -> `[T, D]` f32."""
  tokens, k = weights.shape
  return jnp.einsum("tk,tkd->td", weights, rows.reshape(tokens, k, -1).astype(jnp.float32))


def ragged_moe_shard(x: jax.Array, router_w: jax.Array, experts: ExpertWeights, *,
                     config: MoEConfig, a2a_impl: str, gmm_impl: str,
                     force_dropless: bool = False) -> tuple[jax.Array, ShardStats]:
  """One shard's MoE layer: `x [B, S, D]` -> `y [B, S, D]` and its `ShardStats`.

  `force_dropless` uses the worst-case buffer (no truncation) whatever the factor.
  """
  axis = config.expert_axis
  batch, seq, width = x.shape
  tokens, k = batch * seq, config.num_experts_per_tok
  num_shards = jax.lax.axis_size(axis)
  local_experts = config.num_experts // num_shards
  routed = tokens * k
  capped_rows = dispatch_plan.buffer_rows(num_shards, tokens, k, local_experts,
                                         config.ragged_buffer_factor)
  rows = (dispatch_plan.worst_case_rows(num_shards, tokens, k, local_experts)
          if force_dropless else capped_rows)

  x2 = x.reshape(tokens, width)
  route = routing_lib.route(x2, router_w, k, config.router_score)
  flat_expert = route.expert_ids.reshape(routed)                 # [N], (t, k) order
  order = jnp.argsort(flat_expert, stable=True)                  # [N]
  sorted_rows = x2.astype(config.compute_dtype)[order // k]      # [N, D]
  counts = routing_lib.tokens_per_expert(route.expert_ids, config.num_experts)   # [E]
  all_counts = jax.lax.all_gather(counts, axis)                  # [P, E]
  plan = dispatch_plan.make_plan(all_counts, jax.lax.axis_index(axis), rows)

  buffer = ragged_all_to_all(sorted_rows, jnp.zeros((rows, width), sorted_rows.dtype),
                             plan.dispatch, axis, a2a_impl)      # [R, D]
  group_order = jnp.argsort(plan.buffer_expert, stable=True)     # [R]
  cast = lambda w: w.astype(config.compute_dtype)
  grouped_out = expert_mlp(buffer[group_order], cast(experts.wi_0), cast(experts.wi_1),
                           cast(experts.wo), plan.local_group_sizes, gmm_impl,
                           config.gmm_block_rows)                # [R, D]
  buffer_out = grouped_out[jnp.argsort(group_order)]
  returned = ragged_all_to_all(buffer_out, jnp.zeros_like(sorted_rows), plan.combine, axis,
                               a2a_impl)                         # [N, D]
  unsorted = returned[jnp.argsort(order)]                        # [N, D], (t, k) order
  y = combine_rows(unsorted, route.weights).astype(x.dtype).reshape(batch, seq, width)

  stats = ShardStats(
      required_factor=dispatch_plan.required_factor(plan.traffic, routed),
      would_drop_rows=dispatch_plan.overflow_rows(plan.traffic, capped_rows),
      dropped_rows=dispatch_plan.overflow_rows(plan.traffic, rows),
      tokens_per_expert=counts,
      lb_loss=routing_lib.load_balance_loss(route, config.num_experts))
  return y, stats
