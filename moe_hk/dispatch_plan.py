"""Dispatch plan of the ragged all-to-all: traffic, truncation, exchange arguments (the buffer's
size: `moe_hk.buffer_size`).

Shapes (per expert-parallel shard): P shards on the expert axis, E experts, L = E / P local
experts (shard j owns experts j*L .. j*L+L-1), T local tokens, K experts per token,
N = T * K routed rows (the *balanced* receive size), R receive-buffer rows.

Every shard all-gathers its per-expert row counts, so `counts [P, E]` (row i = sender i) and
everything derived from it here is identical on all shards of an expert group.

Drop order (part of the contract): receiver j's buffer is filled by senders i = 0, 1, ... in
turn; sender i's rows for j are ordered by local expert, then by flattened token position
(b, s, k), and a prefix is kept. Example, P = 2, L = 1, R = 4, traffic A = [[3, 2], [1, 3]]:
receiver 0 gets 3 rows from shard 0 and 1 from shard 1 (all fit, 4 <= 4); receiver 1 gets
2 rows from shard 0 and only the first 2 of shard 1's 3 rows: sent C = [[3, 2], [1, 2]].
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def traffic_matrix(counts: jax.Array) -> jax.Array:
  """`A [P, P]`: rows sender i routes to shard j's experts, from `counts [P, E]`."""
  num_shards = counts.shape[0]
  return counts.reshape(num_shards, num_shards, -1).sum(axis=-1)


def truncate(traffic: jax.Array, rows: int) -> jax.Array:
  """`C [P, P]`: rows actually sent; each receiver's column is filled sender by sender up to R."""
  filled = jnp.minimum(jnp.cumsum(traffic, axis=0), rows)
  return jnp.diff(filled, axis=0, prepend=0)


def kept_per_expert(counts: jax.Array, sent: jax.Array) -> jax.Array:
  """`[P, E]`: rows of sender i kept for each expert, a prefix in local-expert order."""
  num_shards = counts.shape[0]
  per_receiver = counts.reshape(num_shards, num_shards, -1)  # [P, P, L]
  before = jnp.cumsum(per_receiver, axis=-1) - per_receiver
  kept = jnp.clip(sent[:, :, None] - before, 0, per_receiver)
  return kept.reshape(counts.shape)


def required_factor(traffic: jax.Array, routed_rows: int) -> jax.Array:
  """Smallest buffer factor with no overflow: `max_j sum_i A[i, j] / N` (float32 scalar)."""
  return jnp.max(traffic.sum(axis=0)).astype(jnp.float32) / routed_rows


def receiver_overflow_rows(traffic: jax.Array, rows: int) -> jax.Array:
  """`[P]` int32: rows beyond receiver j's buffer of `rows`."""
  return jnp.maximum(traffic.sum(axis=0) - rows, 0)


def overflow_rows(traffic: jax.Array, rows: int) -> jax.Array:
  """Rows of the expert group beyond the receivers' buffers (int32 scalar)."""
  return jnp.sum(receiver_overflow_rows(traffic, rows))


def chunk_receiver_rows(fine_counts: jax.Array, num_chunks: int) -> jax.Array:
  """`[num_chunks, P]`: rows each receiver's L experts get in each of `num_chunks` chunks.

  `fine_counts [P, f, E]` holds sender i's rows per expert in each of f fine chunks, and
  `num_chunks` divides f: chunk c merges fine chunks c * f / num_chunks onwards. The ring of
  experts receives the same rows (its gathered chunk's rows for each shard's experts).
  """
  senders, fine, experts = fine_counts.shape
  merged = fine_counts.reshape(senders, num_chunks, fine // num_chunks, senders,
                               experts // senders)
  return merged.sum(axis=(0, 2, 4))


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


class Exchange(NamedTuple):
  """Arguments of one `ragged_all_to_all`, from the calling shard's point of view, each `[P]`.

  Row ranges: this shard sends `operand[input_offsets[j] : + send_sizes[j]]` to shard j, which
  writes them at `output[output_offsets[j] : + send_sizes[j]]` of *its own* buffer (the sender
  chooses where in the receiver's buffer); `recv_sizes[j]` rows arrive here from shard j.
  """
  input_offsets: jax.Array
  send_sizes: jax.Array
  output_offsets: jax.Array
  recv_sizes: jax.Array


class DispatchPlan(NamedTuple):
  """Everything one shard needs to dispatch its rows and bring the results back."""
  dispatch: Exchange           # sorted rows [N, D] -> receive buffer [R, D].
  combine: Exchange            # expert outputs [R, D] -> back into the sorted slots [N, D].
  buffer_expert: jax.Array     # [R] int32 local expert of each buffer row; L marks an empty row.
  local_group_sizes: jax.Array # [L] int32 rows per local expert in this shard's buffer.
  traffic: jax.Array           # [P, P] int32 untruncated traffic A.
  sent: jax.Array              # [P, P] int32 truncated traffic C.


def make_plan(counts: jax.Array, shard: jax.Array, rows: int) -> DispatchPlan:
  """Plans the exchange for shard `shard` (traced int) from the all-gathered `counts [P, E]`.

  The sender's rows are sorted by global expert id, so its rows for shard j are contiguous and
  start at `exclusive_cumsum(A[shard])[j]`; rows past the truncated size stay unsent.
  """
  num_shards, num_experts = counts.shape
  local_experts = num_experts // num_shards
  traffic = traffic_matrix(counts)
  sent = truncate(traffic, rows)
  source_offsets = exclusive_cumsum(traffic, axis=1)    # [P, P] where i's rows for j start.
  buffer_offsets = exclusive_cumsum(sent, axis=0)       # [P, P] where i's rows land in j's buffer.

  dispatch = Exchange(
      input_offsets=source_offsets[shard],
      send_sizes=sent[shard],
      output_offsets=buffer_offsets[shard],
      recv_sizes=sent[:, shard])
  combine = Exchange(
      input_offsets=buffer_offsets[:, shard],
      send_sizes=sent[:, shard],
      output_offsets=source_offsets[:, shard],
      recv_sizes=sent[shard])

  kept = kept_per_expert(counts, sent).reshape(num_shards, num_shards, local_experts)
  mine = kept[:, shard, :]                              # [P senders, L]: buffer blocks in order.
  used = jnp.sum(mine)
  # The buffer holds (sender, local expert) blocks back to back; empty rows get label L so
  # that they sort after every expert (jnp.repeat would otherwise reuse the last label).
  labels = jnp.concatenate([jnp.tile(jnp.arange(local_experts, dtype=jnp.int32), num_shards),
                            jnp.array([local_experts], jnp.int32)])
  block_sizes = jnp.concatenate([mine.reshape(-1), (rows - used)[None]])
  buffer_expert = jnp.repeat(labels, block_sizes, total_repeat_length=rows)
  return DispatchPlan(dispatch, combine, buffer_expert, mine.sum(axis=0), traffic, sent)
