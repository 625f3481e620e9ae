"""What a compiled program holds per device, and the abstract inputs it is compiled for.

`jax.jit(f).lower(*abstract).compile()` compiles without data; `compiled.memory_analysis()`
then gives the compiler's figures for one device.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def total_memory_bytes(compiled) -> int:
  """Arguments + outputs + temporaries - aliased bytes of one device, from the compiler."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def per_device_bytes(a: jax.ShapeDtypeStruct) -> int:
  """Bytes of one device's shard of `a` (a ShapeDtypeStruct with a sharding)."""
  return math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize


def abstract_like(tree, sharding_tree):
  """ShapeDtypeStructs of `tree` placed with `sharding_tree` (for `.lower`)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s),
                      tree, sharding_tree)
