"""Float32 -> bfloat16 rounding that XLA cannot move out of a layer scan.

In a scan over stacked layer weights, the TPU compiler rewrites `convert(slice_i(w))` as
`slice_i(convert(w))` and hoists the convert: a bfloat16 copy of every layer's weights then
lives through the whole step (docs/aot-memory.md measures it on the Maverick config; an
`optimization_barrier` does not stop it). `to_bfloat16` rounds with
integer arithmetic instead, which that rewrite does not match, so each layer's weights are
rounded inside its own iteration. The result is bit for bit `w.astype(jnp.bfloat16)`
(round to nearest, ties to even) for every finite value and infinity, NaN staying NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def to_bfloat16(w: jax.Array) -> jax.Array:
  """`w` (float32, any shape) rounded to bfloat16, the same shape."""
  bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
  tie_to_even = (bits >> 16) & 1
  rounded = (bits + 0x7FFF + tie_to_even) >> 16
  # NaN: keep the top bits (quiet NaN) instead of letting the rounding carry into the sign.
  rounded = jnp.where(jnp.isnan(w), (bits >> 16) | 0x40, rounded)
  return jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)


def to_compute_dtype(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """`w.astype(dtype)`, through `to_bfloat16` for float32 -> bfloat16."""
  if w.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
    return to_bfloat16(w)
  return w.astype(dtype)
