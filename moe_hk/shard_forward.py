"""One shard's MoE layer with its overflow check and dropless fallback (inside shard_map).

Shapes: B local batch, S sequence, D model width, E experts, K experts per token, P expert
shards, L = E / P local experts, T = B * S local tokens, R capped buffer rows.

`moe_shard` runs the layer's stages, each a function here:

0. `size` (once per trace, by the caller, outside shard_map): the shard's shape, its capped and
   worst-case buffers (`moe_hk.buffer_size`) and whether the layer builds its fallback.
1. route: `moe_hk.routing.route`, once for both paths: the load-balance loss, tokens per
   expert and the overflow check all come from the full step's routing, never from a chunk.
2. `check`: every shard's rows per expert all-gathered, the rows beyond each receiver's buffer.
3. `exchange_or_fall_back`: the capped exchange, or (when a buffer would overflow) the chunked
   dropless fallback, or the worst-case buffer; each path exchanges, runs the experts and
   combines a token's K rows (`moe_hk.ragged_path`, `moe_hk.ring_path`).
4. `shard_stats`: the shard's `MoEStats`.

A token whose router logits are not all finite is routed to no expert (`moe_hk.routing`): no
path sends its rows, and its output row is NaN.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from moe_hk import buffer_size, dispatch_plan, fallback, routing as routing_lib
from moe_hk.config import MoEConfig
from moe_hk.expert_types import Backends, ExpertWeights
from moe_hk.layer_call import LayerCall
from moe_hk.ragged_path import gather_counts, ragged_moe
from moe_hk.ring_path import ring_moe
from moe_hk.stats import MoEStats


class ShardSize(NamedTuple):
  """One shard's shape and receive buffers."""
  batch: int
  seq: int
  width: int
  k: int
  shards: int        # P, on the expert axis
  local: int         # L
  capped_rows: int   # R: the buffer of `ragged_buffer_factor`
  worst_rows: int    # the worst case's buffer
  # The layer builds its overflow check and dropless fallback (unless `force_dropless`): a
  # fallback mode and a buffer below the worst case. With the worst-case buffer nothing can
  # overflow, so no cond is built and the fallback costs nothing.
  builds_fallback: bool

  @property
  def tokens(self) -> int:
    return self.batch * self.seq


class Check(NamedTuple):
  """The overflow check on the step's routing, the same on every shard of an expert group."""
  traffic: jax.Array     # [P, P] int32: rows sender i routes to shard j's experts
  would_drop: jax.Array  # int32 scalar: rows of the group beyond the receivers' buffers


class Ran(NamedTuple):
  """What the path that ran did."""
  y: jax.Array           # [B, S, D] in x's dtype
  fallback: jax.Array    # int32 scalar: 1 if the chunked dropless path ran
  dropped: jax.Array     # int32 scalar: rows dropped (none when the fallback ran)
  chunks: jax.Array      # int32 scalar: the chunks the fallback ran (0: it did not)


def size(x_shape: tuple[int, int, int], config: MoEConfig, shards: int) -> ShardSize:
  """The shape of one shard's input `x_shape = (B, S, D)` and its buffers over `shards` (P)
  expert shards."""
  batch, seq, width = x_shape
  k, local = config.num_experts_per_tok, config.num_experts // shards
  capped = buffer_size.buffer_rows(shards, batch * seq, k, local, config.ragged_buffer_factor)
  worst = buffer_size.worst_case_rows(shards, batch * seq, k, local)
  return ShardSize(batch, seq, width, k, shards, local, capped_rows=capped, worst_rows=worst,
                   builds_fallback=config.falls_back and capped < worst)


def check(route: routing_lib.Routing, config: MoEConfig, shard: ShardSize) -> Check:
  """Every shard's routed rows per expert, all-gathered, and the rows beyond the capped
  buffers. The capped path gathers the counts again inside its branch: a few ints per shard,
  kept so both paths share one signature and the recomputing branches stay self-contained."""
  traffic = dispatch_plan.traffic_matrix(gather_counts(route.expert_ids, config))
  return Check(traffic, dispatch_plan.overflow_rows(traffic, shard.capped_rows))


Gather = Callable[[ExpertWeights], ExpertWeights]


def as_stored(experts: ExpertWeights) -> ExpertWeights:
  """The `Gather` of experts stored as they run (no fsdp dim, already in the compute dtype)."""
  return experts


class _Paths:
  """The ways one shard can run its experts, each `(operands, expert_ids [B, S, K]) -> y`
  with operands `(x [B, S, D], weights [B, S, K], experts)`, `experts` as stored; each path
  makes them the experts it runs with `gather` where it runs them, and makes the rows of an
  unrouted token NaN inside its own branch (`routing.nan_where_unrouted` says why there)."""

  def __init__(self, config: MoEConfig, backends: Backends, shard: ShardSize, gather: Gather):
    self.config, self.shard, self.gather = config, shard, gather
    path = ring_moe if config.use_ring_of_experts else ragged_moe
    self.run = functools.partial(path, config=config, backends=backends)

  def _nan_unrouted(self, y: jax.Array, expert_ids: jax.Array) -> jax.Array:
    s = self.shard
    return routing_lib.nan_where_unrouted(
        y.reshape(s.tokens, s.width), expert_ids.reshape(s.tokens, s.k),
        self.config.num_experts).reshape(s.batch, s.seq, s.width)

  def buffer(self, rows: int) -> Callable:
    """The whole shard's rows through one buffer of `rows` rows (capped or worst case)."""
    s = self.shard
    def run_buffer(operands, expert_ids):
      x, weights, experts = operands
      y = self.run(x.reshape(s.tokens, s.width), expert_ids.reshape(s.tokens, s.k),
                   weights.reshape(s.tokens, s.k), self.gather(experts), rows=rows)
      return self._nan_unrouted(y.astype(x.dtype), expert_ids)
    return run_buffer

  def chunked(self, rung: fallback.Rung) -> Callable:
    """The chunked dropless path of `rung`: rung.rows <= the fixed rung's <= the capped
    buffer's; below a chunk's worst case, a rung runs only when its chunks' actual traffic
    fits (`adaptive_rung`), so no rung drops a row. Each chunk's output is cast to x's dtype
    in the chunk, so the scan stacks no float32 copy of the layer's output. Each chunk gathers
    the experts itself: the scan's backward then sums the chunks' weight gradients as the
    experts are stored (float32; on an fsdp axis each chunk's reduce-scattered), not in a carry
    of the gathered experts' size and compute dtype (a bfloat16 sum rounded per chunk)."""
    def run_chunks(operands, expert_ids):
      x, weights, experts = operands
      def chunk(x_c, ids_c, weights_c):
        return self.run(x_c, ids_c, weights_c, self.gather(experts),
                        rows=rung.rows).astype(x.dtype)
      return self._nan_unrouted(
          fallback.chunked_dropless(chunk, x, (expert_ids, weights), rung.chunks), expert_ids)
    return run_chunks


def _fixed_rung(config: MoEConfig, shard: ShardSize) -> fallback.Rung:
  """The fixed fallback's rung: the fewest chunks whose worst case fits the capped buffer."""
  s = shard
  num_chunks = fallback.fallback_num_chunks(
      batch=s.batch, seq=s.seq, k=s.k, shards=s.shards, local_experts=s.local,
      rows=s.capped_rows, requested=config.dropless_fallback_num_chunks)
  return fallback.fixed_rung(capped_rows=s.capped_rows, worst_rows=s.worst_rows,
                             max_chunks=num_chunks)


def exchange_or_fall_back(x: jax.Array, route: routing_lib.Routing, experts: ExpertWeights,
                          checked: Check, *, config: MoEConfig, backends: Backends,
                          mesh_axes: tuple[str, ...], shard: ShardSize,
                          call: LayerCall, gather: Gather) -> Ran:
  """Runs the shard's experts on `x [B, S, D]` by the path the layer was built for: the
  worst-case buffer (`call.force_dropless`); the capped path behind the overflow check, which
  falls back to the chunked dropless path (`moe_dropless_fallback` 'layer' or 'step'; 'layer'
  with adaptive chunking falls back to the first rung of `fallback.traffic_ladder` whose
  chunks fit, chosen at run time); or the capped path alone. In 'step' mode the check also
  takes the chunked path when `call.after_overflow` (bool scalar, the same on every device)
  says an earlier MoE layer of the step overflowed. `experts` are as stored; `gather` makes
  them the experts a path runs (`moe_shard`)."""
  s, paths, zero = shard, _Paths(config, backends, shard, gather), jnp.zeros((), jnp.int32)
  ids = route.expert_ids.reshape(s.batch, s.seq, s.k)
  operands = (x, route.weights.reshape(s.batch, s.seq, s.k), experts)
  if call.force_dropless:
    return Ran(paths.buffer(s.worst_rows)(operands, ids), zero, zero, zero)
  if not s.builds_fallback:
    return Ran(paths.buffer(s.capped_rows)(operands, ids), zero, checked.would_drop, zero)
  capped, last = paths.buffer(s.capped_rows), _fixed_rung(config, s)
  if config.layer_fallback and config.dropless_fallback_chunking == "adaptive":
    rungs = fallback.traffic_ladder(seq=s.seq, capped_rows=s.capped_rows,
                                    worst_rows=s.worst_rows, max_chunks=last.chunks)
    index = adaptive_rung(ids, rungs, s.capped_rows, config=config, mesh_axes=mesh_axes)
    y = fallback.switch_with_recompute(index, (capped, *map(paths.chunked, rungs)), operands,
                                       ids)
  else:
    # Uniform over every mesh axis: each device's cond must take the same branch as its peers
    # in every collective inside the branches.
    overflow = jax.lax.pmax(checked.would_drop > 0, mesh_axes)
    if call.after_overflow is not None:
      overflow = jnp.logical_or(overflow, call.after_overflow)
    y = fallback.cond_with_recompute(overflow, paths.chunked(last), capped, operands, ids)
    rungs, index = (last,), overflow.astype(jnp.int32)
  chunks = jnp.asarray((0, *(r.chunks for r in rungs)), jnp.int32)[index]
  return Ran(y, (index > 0).astype(jnp.int32), jnp.where(index > 0, 0, checked.would_drop),
             chunks)


def shard_stats(route: routing_lib.Routing, checked: Check, ran: Ran, config: MoEConfig,
                shard: ShardSize) -> MoEStats:
  """This shard's view of the step's `MoEStats`, before `moe_hk.stats.reduce_stats`."""
  return MoEStats(
      fallback=ran.fallback,
      required_factor=dispatch_plan.required_factor(checked.traffic, shard.tokens * shard.k),
      would_drop_rows=checked.would_drop,
      dropped_rows=ran.dropped,
      tokens_per_expert=routing_lib.tokens_per_expert(route.expert_ids, config.num_experts),
      nonfinite_tokens=routing_lib.nonfinite_tokens(route),
      lb_loss=routing_lib.load_balance_loss(route, config.num_experts),
      z_loss=routing_lib.router_z_loss(route),
      fallback_chunks=ran.chunks,
      router_entropy=routing_lib.router_entropy(route),
      receiver_overflow_rows=dispatch_plan.receiver_overflow_rows(checked.traffic,
                                                                  shard.capped_rows),
      routed_rows_per_device=jnp.zeros((0, config.num_experts), jnp.int32))


def moe_shard(x: jax.Array, router_w: jax.Array, experts: ExpertWeights, *, config: MoEConfig,
              backends: Backends, mesh_axes: tuple[str, ...], shard: ShardSize,
              call: LayerCall = LayerCall(), gather: Gather = as_stored
              ) -> tuple[jax.Array, MoEStats]:
  """`x [B, S, D]` -> `(y [B, S, D], MoEStats)` on one shard of size `shard` (`size`), the
  stats this shard's view before `moe_hk.stats.reduce_stats` (`moe_hk.stats.REDUCTIONS` says
  what each field holds): route, check, exchange or fall back, stats. `experts` are this
  shard's as stored and `gather` (`moe_hk.mesh_forward`: the fsdp all-gather in the compute
  dtype) makes them the `[L, D, F]` experts that run, inside each path: once in a buffer's,
  per chunk in the fallback's."""
  route = routing_lib.route(x.reshape(shard.tokens, shard.width), router_w, shard.k,
                            config.router_score, config.norm_topk_prob)
  checked = check(route, config, shard)
  ran = exchange_or_fall_back(x, route, experts, checked, config=config, backends=backends,
                              mesh_axes=mesh_axes, shard=shard, call=call, gather=gather)
  return ran.y, shard_stats(route, checked, ran, config, shard)


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
