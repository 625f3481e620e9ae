"""One shard's MoE layer with its overflow check and dropless fallback (inside shard_map).

Shapes: B local batch, S sequence, D model width, E experts, K experts per token, P expert
shards, L = E / P local experts, T = B * S local tokens, R capped buffer rows.

Routing happens once, here, for both branches: the load-balance loss, tokens per expert and
the overflow check all come from the full step's routing, never from a chunk. A token whose
router logits are not all finite is routed to no expert (`moe_hk.routing`): no path sends its
rows, and its output row is NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_hk import dispatch_plan, fallback, routing as routing_lib
from moe_hk.config import MoEConfig
from moe_hk.ragged_path import Backends, ExpertWeights, gather_counts, ragged_moe
from moe_hk.ring_path import ring_moe
from moe_hk.stats import MoEStats


def moe_shard(x: jax.Array, router_w: jax.Array, experts: ExpertWeights, *, config: MoEConfig,
              backends: Backends, mesh_axes: tuple[str, ...], force_dropless: bool = False,
              after_overflow: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
  """`x [B, S, D]` -> `(y [B, S, D], MoEStats)` on one shard, the stats this shard's view
  before `moe_hk.stats.reduce_stats` (`moe_hk.stats.REDUCTIONS` says what each field holds).

  Picks, statically, one of: the worst-case buffer (`force_dropless`); the capped path behind
  an overflow check that falls back to the chunked dropless path (`moe_dropless_fallback`
  'layer' or 'step'; 'layer' with adaptive chunking falls back to the first rung of
  `fallback.traffic_ladder` whose chunks fit, chosen at run time); or the capped path alone.
  In 'step' mode the check also takes the chunked path when `after_overflow` (bool scalar, the
  same on every device) says an earlier MoE layer of the step overflowed.
  """
  batch, seq, width = x.shape
  tokens, k = batch * seq, config.num_experts_per_tok
  shards = jax.lax.axis_size(config.expert_axis)
  local = config.num_experts // shards
  capped_rows = dispatch_plan.buffer_rows(shards, tokens, k, local, config.ragged_buffer_factor)
  worst_rows = dispatch_plan.worst_case_rows(shards, tokens, k, local)

  route = routing_lib.route(x.reshape(tokens, width), router_w, k, config.router_score,
                            config.norm_topk_prob)
  # The capped path gathers these [P, E] counts again inside `path`: a few ints per shard,
  # kept so both paths share one signature and the custom_vjp's branches stay self-contained.
  traffic = dispatch_plan.traffic_matrix(gather_counts(route.expert_ids, config))
  would_drop = dispatch_plan.overflow_rows(traffic, capped_rows)

  path = ring_moe if config.use_ring_of_experts else ragged_moe
  run = functools.partial(path, config=config, backends=backends)
  ids = route.expert_ids.reshape(batch, seq, k)
  weights = route.weights.reshape(batch, seq, k)

  def nan_unrouted(y, expert_ids):
    # Each branch's output, inside the branch (routing.nan_where_unrouted says why there).
    return routing_lib.nan_where_unrouted(y.reshape(tokens, width),
                                          expert_ids.reshape(tokens, k),
                                          config.num_experts).reshape(batch, seq, width)

  def capped(operands, expert_ids):
    x_, weights_, experts_ = operands
    return nan_unrouted(run(x_.reshape(tokens, width), expert_ids.reshape(tokens, k),
                            weights_.reshape(tokens, k), experts_, rows=capped_rows), expert_ids)

  def chunked(rung):
    # rung.rows <= the fixed rung's <= capped_rows; below a chunk's worst case, a rung runs
    # only when its chunks' actual traffic fits (see `adaptive_rung`), so no rung drops a row.
    def run_chunks(operands, expert_ids):
      x_, weights_, experts_ = operands
      def chunk(x_c, ids_c, weights_c):
        return run(x_c, ids_c, weights_c, experts_, rows=rung.rows)
      return nan_unrouted(fallback.chunked_dropless(chunk, x_, (expert_ids, weights_),
                                                    rung.chunks), expert_ids)
    return run_chunks

  def fixed():
    num_chunks = fallback.fallback_num_chunks(
        batch=batch, seq=seq, k=k, shards=shards, local_experts=local, rows=capped_rows,
        requested=config.dropless_fallback_num_chunks)
    return fallback.fixed_rung(capped_rows=capped_rows, worst_rows=worst_rows,
                               max_chunks=num_chunks)

  operands = (x, weights, experts)
  zero = jnp.zeros((), jnp.int32)
  if force_dropless:
    y = nan_unrouted(run(x.reshape(tokens, width), route.expert_ids, route.weights, experts,
                         rows=worst_rows), ids)
    ran_fallback, dropped, chunks = zero, zero, zero
  elif builds_fallback(config, shards=shards, tokens=tokens):
    last = fixed()
    if config.moe_dropless_fallback == "layer" and config.dropless_fallback_chunking == "adaptive":
      rungs = fallback.traffic_ladder(seq=seq, capped_rows=capped_rows, worst_rows=worst_rows,
                                      max_chunks=last.chunks)
      index = adaptive_rung(ids, rungs, capped_rows, config=config, mesh_axes=mesh_axes)
      y = fallback.switch_with_recompute(index, (capped, *map(chunked, rungs)), operands, ids)
    else:
      # Uniform over every mesh axis: each device's cond must take the same branch as its
      # peers in every collective inside the branches.
      overflow = jax.lax.pmax(would_drop > 0, mesh_axes)
      if after_overflow is not None:
        overflow = jnp.logical_or(overflow, after_overflow)
      y = fallback.cond_with_recompute(overflow, chunked(last), capped, operands, ids)
      rungs, index = (last,), overflow.astype(jnp.int32)
    ran_fallback = (index > 0).astype(jnp.int32)
    dropped = jnp.where(index > 0, 0, would_drop)
    chunks = jnp.asarray((0, *(r.chunks for r in rungs)), jnp.int32)[index]
  else:
    y = capped(operands, ids)
    ran_fallback, dropped, chunks = zero, would_drop, zero

  stats = MoEStats(
      fallback=ran_fallback,
      required_factor=dispatch_plan.required_factor(traffic, tokens * k),
      would_drop_rows=would_drop,
      dropped_rows=dropped,
      tokens_per_expert=routing_lib.tokens_per_expert(route.expert_ids, config.num_experts),
      nonfinite_tokens=routing_lib.nonfinite_tokens(route),
      lb_loss=routing_lib.load_balance_loss(route, config.num_experts),
      z_loss=routing_lib.router_z_loss(route),
      fallback_chunks=chunks,
      router_entropy=routing_lib.router_entropy(route),
      receiver_overflow_rows=dispatch_plan.receiver_overflow_rows(traffic, capped_rows),
      routed_rows_per_device=jnp.zeros((0, config.num_experts), jnp.int32))
  return y.astype(x.dtype), stats


def builds_fallback(config: MoEConfig, *, shards: int, tokens: int) -> bool:
  """Whether the layer builds its overflow check and dropless fallback (without
  `force_dropless`): a fallback mode and a buffer below the worst case of `tokens` tokens per
  shard over `shards` expert shards. With the worst-case buffer nothing can overflow, so no
  cond is built and the fallback costs nothing."""
  k, local = config.num_experts_per_tok, config.num_experts // shards
  return config.moe_dropless_fallback != "none" and (
      dispatch_plan.buffer_rows(shards, tokens, k, local, config.ragged_buffer_factor)
      < dispatch_plan.worst_case_rows(shards, tokens, k, local))


def adaptive_rung(expert_ids: jax.Array, rungs: tuple[fallback.Rung, ...], rows: int, *,
                  config: MoEConfig, mesh_axes: tuple[str, ...]) -> jax.Array:
  """Branch to run (int32 scalar, the same on every device): 0 for the capped layer (one
  chunk of `rows` rows) when nothing overflows, else 1 + the first of `rungs` whose every
  chunk fits its buffer on every receiver. `expert_ids [B, S, K]` is this shard's routing;
  its rows per expert in the rungs' finest chunks are all-gathered over the expert axis to
  `[P, f, E]`."""
  ladder = (fallback.Rung(1, rows), *rungs)
  fine = fallback.chunk_counts(expert_ids, fallback.finest_chunks(ladder), config.num_experts)
  fine = jax.lax.all_gather(fine, config.expert_axis)
  # A rung fits only if it fits on every expert group: pmax the overflow flags over every
  # mesh axis, as the fixed fallback does its predicate.
  overflows = jax.lax.pmax(fallback.rung_overflows(fine, ladder), mesh_axes)
  return fallback.first_fit(overflows)
