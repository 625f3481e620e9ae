"""What both expert paths (`moe_hk.ragged_path`, `moe_hk.ring_path`) take besides the routing:
this shard's expert weights and the concrete backends that run them.

Shapes: D model width, F expert width, L local experts.
"""
from __future__ import annotations

from typing import NamedTuple

import jax


class ExpertWeights(NamedTuple):
  """This shard's experts: as stored (float32, D possibly sharded over fsdp) or as a path runs
  them (gathered over fsdp, in the compute dtype: `moe_hk.shard_forward.Gather`)."""
  wi_0: jax.Array  # [L, D, F]
  wi_1: jax.Array  # [L, D, F]
  wo: jax.Array    # [L, F, D]


class Backends(NamedTuple):
  """Concrete implementations, resolved from 'auto' for the mesh's platform."""
  a2a: str  # 'native' | 'emulated'
  gmm: str  # 'ragged_dot' | 'blocked' | 'megablox'
  interpret: bool = False  # Run 'megablox' in Pallas's interpreter (a CPU mesh).
