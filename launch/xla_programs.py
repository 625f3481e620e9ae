"""Compiling ahead of time: TPU topology devices, abstract inputs and compiler memory figures.

A TPU topology needs the libtpu wheel matching jax (`jax[tpu]==<jax version>`) but no TPU:
`jax.jit(f).lower(...).compile()` then compiles for that topology from any machine.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import topologies


def tpu_topology_devices(topology: str) -> Sequence[jax.Device]:
  """Devices of a TPU topology such as 'v5p:2x2x1' (needs libtpu, not a TPU)."""
  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices


def total_memory_bytes(compiled) -> int:
  """Arguments + outputs + temporaries - aliased bytes of one device, from the compiler."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def abstract_like(tree, sharding_tree):
  """ShapeDtypeStructs of `tree` placed with `sharding_tree` (for `.lower`)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s),
                      tree, sharding_tree)
