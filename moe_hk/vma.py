"""Helpers for shard_map's varying-manual-axes (vma) types.

Inside `shard_map`, every value records the mesh axes it varies over. A scan carry, the two
branches of a cond, and a custom_vjp's cotangents must agree with what they are combined with.
"""
from __future__ import annotations

import jax


def varying_axes(x: jax.Array) -> frozenset:
  """Mesh axes `x` varies over inside shard_map (empty outside)."""
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return manual.varying if manual is not None else frozenset()


def vary_like(value: jax.Array, *refs: jax.Array) -> jax.Array:
  """Marks `value` as varying over every mesh axis any of `refs` varies over."""
  missing = frozenset().union(*map(varying_axes, refs)) - varying_axes(value)
  return jax.lax.pcast(value, tuple(sorted(missing)), to="varying") if missing else value


def sum_to_axes_of(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
  """Sums a cotangent over the mesh axes its primal is replicated on (what autodiff of a
  replicated value used on every shard does implicitly)."""
  extra = varying_axes(cotangent) - varying_axes(primal)
  return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent
