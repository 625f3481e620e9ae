"""Where a token is, as attention sees it: rotary embeddings (their frequencies, with llama3's
scaling, in the rotate-half or the interleaved layout) and, on layers without them, Llama 4's
attention temperature.

Shapes: B batch, S sequence, Dh head dim; positions are 0 .. S - 1.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections

from launch.setup.choices import ROPE_LAYOUTS, ROPE_SCALINGS

__all__ = ["ROPE_LAYOUTS", "ROPE_SCALINGS", "frequencies", "rotary", "temperature"]


def frequencies(head_dim: int, base: float, scaling: ml_collections.ConfigDict | None = None
                ) -> jax.Array:
  """`[Dh / 2]` float32: the rotation rate of each dimension pair, `base ** (-2i / Dh)`; with
  `scaling.type == 'llama3'`, Llama 3's: pairs whose wavelength exceeds
  `original_max_positions / low_freq_factor` turn `factor` times slower, those below
  `original_max_positions / high_freq_factor` keep their rate, and those between blend the
  two by where their wavelength falls (none when the two factors are equal)."""
  rates = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None or scaling.type == "none":
    return rates
  window = float(scaling.original_max_positions)
  low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
  wavelength = 2 * math.pi / rates
  slowed = jnp.where(wavelength > window / low, rates / factor, rates)
  if high == low:  # no band between the two (Llama 4 Scout's factors): slowed or kept
    return slowed
  blend = (window / wavelength - low) / (high - low)
  blended = (1 - blend) * slowed / factor + blend * slowed
  middle = (wavelength >= window / high) & (wavelength <= window / low)
  return jnp.where(middle, blended, slowed)


def rotary(x: jax.Array, rates: jax.Array, layout: str = "rotate_half") -> jax.Array:
  """`x [B, S, ..., Dh]` rotated by position: pair j turns by `position x rates[j]`.
  'rotate_half' pairs dimension j with j + Dh/2; 'interleaved' pairs 2j with 2j + 1 (Llama 4:
  each pair a complex number)."""
  seq, dim = x.shape[1], x.shape[-1]
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * rates[None]      # [S, Dh / 2]
  angles = angles.reshape(1, seq, *([1] * (x.ndim - 3)), dim // 2)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x32 = x.astype(jnp.float32)
  if layout == "rotate_half":
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
  if layout != "interleaved":
    raise ValueError(f"rope_layout={layout!r} is not one of {ROPE_LAYOUTS}.")
  pairs = x32.reshape(*x.shape[:-1], dim // 2, 2)
  real, imag = pairs[..., 0], pairs[..., 1]
  turned = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
  return turned.reshape(x.shape).astype(x.dtype)


def temperature(seq: int, floor_scale: float, attn_scale: float) -> jax.Array:
  """`[S]` float32: Llama 4's query scale on layers without rotary embeddings,
  `1 + attn_scale x log(1 + floor((position + 1) / floor_scale))`: 1 for the first
  `floor_scale - 1` positions, then slowly growing, so that attention stays sharp far out."""
  positions = jnp.arange(seq, dtype=jnp.float32)
  return 1.0 + attn_scale * jnp.log1p(jnp.floor((positions + 1.0) / floor_scale))
