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
from moe_hk.expert_types import Backends, ExpertWeights
from moe_hk.grouped_matmul import expert_mlp
from moe_hk.routing import tokens_per_expert


def combine_rows(rows: jax.Array, weights: jax.Array, config: MoEConfig) -> jax.Array:
  """Sum over K of rows `[T * K, D]` in (t, k) order -> `[T, D]` float32: weighted by
  `weights [T, K]` when the router weighs outputs (`config.router_weights_on`), else as they
  are (the weights scaled the inputs: `weighted_inputs`)."""
  tokens, k = weights.shape
  rows = rows.reshape(tokens, k, -1).astype(jnp.float32)
  if config.router_weights_on == "input":
    return jnp.sum(rows, axis=1)
  return jnp.einsum("tk,tkd->td", weights, rows)


def weighted_inputs(rows: jax.Array, row_weights: jax.Array, config: MoEConfig) -> jax.Array:
  """Rows `[N, D]` (compute dtype) bound for experts, each scaled by its router weight
  `row_weights [N]` when the router weighs inputs (`config.router_weights_on='input'`), else
  as they are."""
  if config.router_weights_on != "input":
    return rows
  return (rows.astype(jnp.float32) * row_weights[:, None]).astype(rows.dtype)


def grouped_experts_mlp(rows: jax.Array, experts: ExpertWeights, group_sizes: jax.Array,
                        config: MoEConfig, backends: Backends) -> jax.Array:
  """SwiGLU of rows `[R, D]` grouped by local expert (`group_sizes [L]`, then padding rows,
  which come back 0; take them with `grouped_rows`: their gradient is undefined with
  'megablox') with `experts` in the compute dtype -> `[R, D]`."""
  return expert_mlp(rows, experts.wi_0, experts.wi_1, experts.wo, group_sizes, backends.gmm,
                    config.gmm_block_rows, backends.interpret)


def grouped_rows(source: jax.Array, index: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`source [S, D]` rows at `index [R]` (rows grouped by local expert, `group_sizes [L]`)
  -> `[R, D]`, with the rows past `sum(group_sizes)` 0 and cut off from the gradient: they
  take an out-of-range index, whose transposed scatter drops them. So the grouped matmul
  may leave the gradient of its padding rows undefined (megablox does)."""
  in_groups = jnp.arange(index.shape[0]) < jnp.sum(group_sizes)
  return jnp.take(source, jnp.where(in_groups, index, source.shape[0]), axis=0, mode="fill",
                  fill_value=0)


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
  sorted_rows = weighted_inputs(x.astype(config.compute_dtype)[order // k],
                                weights.reshape(-1)[order], config)   # [N, D]
  plan = dispatch_plan.make_plan(gather_counts(expert_ids, config), jax.lax.axis_index(axis),
                                 rows)
  buffer = ragged_all_to_all(sorted_rows, jnp.zeros((rows, x.shape[-1]), sorted_rows.dtype),
                             plan.dispatch, axis, backends.a2a)   # [R, D]
  by_expert = jnp.argsort(plan.buffer_expert, stable=True)       # [R], empty rows last
  grouped = grouped_rows(buffer, by_expert, plan.local_group_sizes)
  out = grouped_experts_mlp(grouped, experts, plan.local_group_sizes, config,
                            backends)[jnp.argsort(by_expert)]  # [R, D], buffer order
  returned = ragged_all_to_all(out, jnp.zeros_like(sorted_rows), plan.combine, axis,
                               backends.a2a)                     # [N, D]
  return combine_rows(returned[jnp.argsort(order)], weights, config)
