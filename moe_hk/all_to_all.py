"""Ragged all-to-all backends with one semantics (`jax.lax.ragged_all_to_all`'s).

`native` is the XLA collective (TPU/GPU). XLA:CPU rejects it ("UNIMPLEMENTED: HLO opcode
ragged-all-to-all"), so `emulated` reproduces it with a dense `all_to_all` in a `lax.scan`:
every segment is padded to `seg = min(operand rows, output rows)` rows (no segment can be
longer) and cut into pieces of `ceil(seg / P)` rows; iteration i sends piece i of every
segment at once (`[P, piece, ...]`, about one segment's rows), and the receiver scatters the
rows that are real into its buffer at the sender's chosen offsets. Peak memory stays near the
native op's (one padded segment in flight, not P), and the compiled program holds one
exchange, not one per peer.

Shapes: operand `[M, ...]`, output `[R, ...]`, exchange arguments `[P]` each (see `Exchange`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_hk.dispatch_plan import Exchange
from moe_hk.vma import vary_like


def native_ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange,
                             axis_name: str) -> jax.Array:
  """XLA's collective. Its result takes `output`'s type, so a buffer made inside shard_map
  (`jnp.zeros`, replicated by type) is first marked varying like the rows it receives: typed
  replicated, its gradient would be summed over the shards."""
  return jax.lax.ragged_all_to_all(operand, vary_like(output, operand), *exchange,
                                   axis_name=axis_name)


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange,
                               axis_name: str) -> jax.Array:
  """`ragged_all_to_all` from a scan of dense `all_to_all`s; output rows nobody writes keep
  their input value."""
  num_shards = jax.lax.axis_size(axis_name)
  out_rows, tail = output.shape[0], output.shape[1:]
  seg = min(operand.shape[0], out_rows)
  piece = -(-seg // num_shards)
  pos = jnp.arange(piece, dtype=jnp.int32)
  rows_mask = lambda m: m.reshape(m.shape + (1,) * len(tail))  # broadcast over [...]
  # Where each sender's rows go in this shard's buffer: the senders choose.
  offsets = jax.lax.all_to_all(exchange.output_offsets, axis_name, 0, 0, tiled=True)

  def send_piece(carry, first):
    received, written = carry
    at = first + pos                                                   # [piece]
    rows = jnp.take(operand, exchange.input_offsets[:, None] + at, axis=0,
                    mode="clip")                                       # [P, piece, ...]
    rows = jnp.where(rows_mask(at < exchange.send_sizes[:, None]), rows, 0)
    rows = jax.lax.all_to_all(rows, axis_name, 0, 0, tiled=True)        # piece from each sender
    # Padding positions point past the buffer and are dropped by the scatter.
    target = jnp.where(at < exchange.recv_sizes[:, None], offsets[:, None] + at, out_rows)
    # Segments never overlap, so adding into zeros places each row exactly once; `add` keeps
    # the backward a plain gather.
    received = received.at[target.reshape(-1)].add(rows.reshape(-1, *tail), mode="drop")
    written = written.at[target.reshape(-1)].set(True, mode="drop")
    return (received, written), None

  inputs = (operand, output, *exchange, offsets)
  init = (vary_like(jnp.zeros_like(output), *inputs),
          vary_like(jnp.zeros((out_rows,), jnp.bool_), *inputs))
  (received, written), _ = jax.lax.scan(
      send_piece, init, jnp.arange(0, seg, piece, dtype=jnp.int32))
  return jnp.where(rows_mask(written), received, output)


def local_ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange
                            ) -> jax.Array:
  """The exchange of an axis of one shard: a copy of the first `send_sizes[0]` operand rows
  over the output's first rows (the plan's offsets are sums over the shards before this one,
  of which there are none, so both are 0). A slice and a select, whose backward is the same:
  XLA's collective copies the rows through its own path (on a v5e chip, 7 ms a call for
  32,768 x 2048 bfloat16 rows, `benchmarks.chip_profile`), and a gather's backward is a
  scatter."""
  out_rows, in_rows = output.shape[0], operand.shape[0]
  rows = operand[:out_rows] if in_rows >= out_rows else jnp.pad(
      operand, [(0, out_rows - in_rows)] + [(0, 0)] * (operand.ndim - 1))
  written = jnp.arange(out_rows) < exchange.send_sizes[0]
  return jnp.where(written.reshape((-1,) + (1,) * (output.ndim - 1)), rows, output)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange, axis_name: str,
                      impl: str) -> jax.Array:
  """Dispatches to the `native` or `emulated` backend (already resolved from 'auto'), or,
  on an axis of one shard, to `local_ragged_all_to_all`."""
  assert impl in ("native", "emulated"), f"a2a impl {impl!r}: resolve_backends picks it"
  if jax.lax.axis_size(axis_name) == 1:
    return local_ragged_all_to_all(operand, output, exchange)
  if impl == "native":
    return native_ragged_all_to_all(operand, output, exchange, axis_name)
  return emulated_ragged_all_to_all(operand, output, exchange, axis_name)
