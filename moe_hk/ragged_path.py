"""The MoE layer on one expert-parallel shard over a ragged all-to-all (runs inside shard_map).

Shapes: D model width, F expert width, E experts, K experts per token, P expert shards,
L = E / P local experts, T local tokens, N = T * K routed rows, R receive-buffer rows.

Data path, given the routing: sort the N rows by expert -> plan from the all-gathered
per-expert counts (with truncation when capped) -> ragged all-to-all into a zeroed [R, D]
buffer -> group by local expert -> SwiGLU grouped matmul -> ungroup -> reverse all-to-all into
the senders' slots -> unsort -> weighted sum over K. Dropped rows come back as exact zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_hk import dispatch_plan
from moe_hk.all_to_all import ragged_all_to_all
from moe_hk.config import MoEConfig
from moe_hk.expert_rows import (combine_rows, grouped_experts_mlp, inverse_permutation,
                                take_rows, weighted_inputs)
from moe_hk.expert_types import Backends, ExpertWeights
from moe_hk.routing import tokens_per_expert


def gather_counts(expert_ids: jax.Array, config: MoEConfig) -> jax.Array:
  """Every shard's routed rows per expert `[P, E]` from this shard's `expert_ids [T, K]`."""
  return jax.lax.all_gather(tokens_per_expert(expert_ids, config.num_experts), config.expert_axis)


def ragged_moe(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, experts: ExpertWeights,
               *, rows: int, config: MoEConfig, backends: Backends) -> jax.Array:
  """One shard's MoE output over the ragged all-to-all with a buffer of `rows` rows.

  x `[T, D]`, expert_ids / weights `[T, K]` (this shard's routing) -> `[T, D]` float32. Rows
  of id E (`routing.unrouted_id`) sort after every expert's and are in no count, so they are
  never sent and come back as 0 (`shard_forward` makes such a token's output row NaN).
  """
  axis = config.expert_axis
  _, k = expert_ids.shape
  order = jnp.argsort(expert_ids.reshape(-1), stable=True)       # [N], by expert
  unsort = inverse_permutation(order)
  every = jnp.int32(order.shape[0])
  sorted_rows = weighted_inputs(
      take_rows(x.astype(config.compute_dtype), order, unsort, every, k),
      weights.reshape(-1)[order], config)                        # [N, D]
  plan = dispatch_plan.make_plan(gather_counts(expert_ids, config), jax.lax.axis_index(axis),
                                 rows)
  buffer = ragged_all_to_all(sorted_rows, jnp.zeros((rows, x.shape[-1]), sorted_rows.dtype),
                             plan.dispatch, axis, backends.a2a)   # [R, D]
  out = _experts_on_buffer(buffer, plan, experts, config, backends,
                           one_block=jax.lax.axis_size(axis) == 1
                           or plan.local_group_sizes.shape[0] == 1)
  returned = ragged_all_to_all(out, jnp.zeros_like(sorted_rows), plan.combine, axis,
                               backends.a2a)                     # [N, D]
  return combine_rows(take_rows(returned, unsort, order, every, 1), weights, config)


def _experts_on_buffer(buffer: jax.Array, plan: dispatch_plan.DispatchPlan,
                       experts: ExpertWeights, config: MoEConfig, backends: Backends,
                       one_block: bool) -> jax.Array:
  """The local experts' SwiGLU of the receive buffer's rows `[R, D]` -> `[R, D]` in buffer
  order, 0 in its empty rows. The buffer holds (sender, local expert) blocks back to back,
  its empty rows last: grouped by expert already when there is one sender or one local expert
  (`one_block`), else regrouped there and back. Either way the rows past the groups (the
  empty rows) reach no sender's gradient: no exchange sends them back."""
  sizes = plan.local_group_sizes
  if one_block:
    return grouped_experts_mlp(buffer, experts, sizes, config, backends)
  by_expert = jnp.argsort(plan.buffer_expert, stable=True)       # [R], empty rows last
  to_buffer = inverse_permutation(by_expert)
  grouped = take_rows(buffer, by_expert, to_buffer, jnp.sum(sizes), 1)
  out = grouped_experts_mlp(grouped, experts, sizes, config, backends)
  return take_rows(out, to_buffer, by_expert, jnp.int32(out.shape[0]), 1)
