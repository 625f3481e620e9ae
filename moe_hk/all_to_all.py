"""Ragged all-to-all backends with one semantics (`jax.lax.ragged_all_to_all`'s).

`native` is the XLA collective (TPU/GPU). XLA:CPU rejects it ("UNIMPLEMENTED: HLO opcode
ragged-all-to-all"), so `emulated` reproduces it with P - 1 `ppermute` rounds: in round s each
shard sends its segment for shard (me + s) mod P, padded to `min(operand rows, output rows)`
(no segment can be longer), with the sender's chosen output offset and size; the receiver
scatters it into its buffer. Peak memory stays near the native op's instead of holding every
peer's padded segment at once.

Shapes: operand `[M, ...]`, output `[R, ...]`, exchange arguments `[P]` each (see `Exchange`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_hk.dispatch_plan import Exchange


def native_ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange,
                             axis_name: str) -> jax.Array:
  return jax.lax.ragged_all_to_all(operand, output, *exchange, axis_name=axis_name)


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange,
                               axis_name: str) -> jax.Array:
  """`ragged_all_to_all` from `ppermute`s; output rows nobody writes keep their input value."""
  num_shards = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  out_rows = output.shape[0]
  seg = min(operand.shape[0], out_rows)
  pos = jnp.arange(seg, dtype=jnp.int32)
  rows_mask = lambda m, n: m.reshape((n,) + (1,) * (output.ndim - 1))  # broadcast over [...]
  received = jnp.zeros_like(output)
  written = jnp.zeros((out_rows,), jnp.bool_)
  for shift in range(num_shards):
    peer = (me + shift) % num_shards
    size = exchange.send_sizes[peer]
    rows = jnp.take(operand, exchange.input_offsets[peer] + pos, axis=0, mode="clip")
    rows = jnp.where(rows_mask(pos < size, seg), rows, 0)
    offset = exchange.output_offsets[peer]
    if shift:
      perm = [(i, (i + shift) % num_shards) for i in range(num_shards)]
      rows, offset, size = jax.lax.ppermute((rows, offset, size), axis_name, perm)
    # Padding positions point past the buffer and are dropped by the scatter.
    target = jnp.where(pos < size, offset + pos, out_rows)
    # Segments never overlap, so adding into zeros places each row exactly once; `add` keeps
    # the backward a plain gather.
    received = received.at[target].add(rows, mode="drop")
    written = written.at[target].set(True, mode="drop")
  return jnp.where(rows_mask(written, out_rows), received, output)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, exchange: Exchange, axis_name: str,
                      impl: str) -> jax.Array:
  """Dispatches to the `native` or `emulated` backend (already resolved from 'auto')."""
  if impl == "native":
    return native_ragged_all_to_all(operand, output, exchange, axis_name)
  if impl == "emulated":
    return emulated_ragged_all_to_all(operand, output, exchange, axis_name)
  raise ValueError(f"a2a_impl={impl!r} must be 'native' or 'emulated' here.")
