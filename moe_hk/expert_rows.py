"""Rows bound for experts and back, shared by both MoE paths (`ragged_path`, `ring_path`):
moving rows (a gather whose backward is a gather too), weighting them, the grouped SwiGLU,
and the sum over each token's K rows.

Shapes: D model width, K experts per token, L local experts, N routed rows, R buffer rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_hk.config import MoEConfig
from moe_hk.expert_types import Backends, ExpertWeights
from moe_hk.grouped_matmul import expert_mlp
from moe_hk.vma import sum_to_axes_of, vary_like


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def take_rows(source: jax.Array, index: jax.Array, inverse: jax.Array, kept: jax.Array,
              copies: int) -> jax.Array:
  """`source [S, D]` row `index[i] // copies` at row i -> `[S * copies, D]`, where `index` is
  a permutation of `S * copies` rows (each source row used `copies` times, as a token's K
  routed rows are) and `inverse` its inverse (`inverse[index[i]] = i`). Rows from `kept`
  (int32 scalar) on come out 0 and their gradient is dropped (a grouped matmul may leave
  the gradient of its padding rows undefined).

  The backward is a gather too (`g[inverse]`, then the sum over each source row's copies),
  not the gather's transpose, a scatter-add, which on a TPU costs several times a gather of
  the same rows.
  """
  at = jnp.where(jnp.arange(index.shape[0]) < kept, index // copies, source.shape[0])
  return jnp.take(source, at, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(source, index, inverse, kept, copies):
  # An empty array of source's type: the backward returns a cotangent of that type.
  like = vary_like(jnp.zeros((0,), source.dtype), source)
  return take_rows(source, index, inverse, kept, copies), (inverse, kept, like)


def _take_rows_bwd(copies, residuals, g):
  inverse, kept, like = residuals
  rows = jnp.take(g, jnp.where(inverse < kept, inverse, g.shape[0]), axis=0, mode="fill",
                  fill_value=0).reshape(-1, copies, g.shape[-1])
  summed = rows[:, 0] if copies == 1 else jnp.sum(rows.astype(jnp.float32), axis=1)
  # A source replicated over an axis the rows vary over gets the sum of its shards' cotangents,
  # as autodiff gives a replicated value used on every shard.
  return sum_to_axes_of(summed.astype(like.dtype), like), None, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def inverse_permutation(index: jax.Array) -> jax.Array:
  """`[M]` int32: the inverse of the permutation `index [M]`."""
  return jnp.argsort(index)


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
  which come back 0; cut them off the gradient where they are gathered (`take_rows`,
  `grouped_rows`): their gradient is undefined with 'megablox') with `experts` in the compute
  dtype -> `[R, D]`."""
  return expert_mlp(rows, experts.wi_0, experts.wi_1, experts.wo, group_sizes, backends.gmm,
                    config.gmm_block_rows, backends.interpret)


def grouped_rows(source: jax.Array, index: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`source [S, D]` rows at `index [R]` (rows grouped by local expert, `group_sizes [L]`)
  -> `[R, D]`, with the rows past `sum(group_sizes)` 0 and cut off from the gradient: they
  take an out-of-range index, whose transposed scatter drops them. For an `index` that picks
  any rows (the ring's); a permutation moves with `take_rows`."""
  kept = jnp.arange(index.shape[0]) < jnp.sum(group_sizes)
  return jnp.take(source, jnp.where(kept, index, source.shape[0]), axis=0, mode="fill",
                  fill_value=0)
