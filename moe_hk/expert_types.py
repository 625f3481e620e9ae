"""What both expert paths (`moe_hk.ragged_path`, `moe_hk.ring_path`) take besides the routing:
this shard's expert weights and the concrete backends that run them.

Shapes: D model width, F expert width, L local experts.
"""
from __future__ import annotations

from typing import NamedTuple

import jax


class ExpertWeights(NamedTuple):
  """This shard's experts (already gathered over fsdp)."""
  wi_0: jax.Array  # [L, D, F]
  wi_1: jax.Array  # [L, D, F]
  wo: jax.Array    # [L, F, D]


class Backends(NamedTuple):
  """Concrete implementations, resolved from 'auto' for the mesh's platform."""
  a2a: str  # 'native' | 'emulated'
  gmm: str  # 'ragged_dot' | 'blocked' | 'megablox'
  interpret: bool = False  # Run 'megablox' in Pallas's interpreter (a CPU mesh).


class LayerCall(NamedTuple):
  """What one call of the layer asks beyond its input, passed unchanged from the Haiku module
  (`moe_hk.MoELayer`) through `moe_hk.moe_forward` to each shard (`moe_hk.shard_forward`)."""
  # The training step and the layer's ordinal among the MoE layers (int32 scalars, may be
  # traced): the labels of the layer's host events (None: no events).
  step: jax.Array | int | None = None
  layer_index: jax.Array | int | None = None
  # Run the worst-case buffer: no truncation, no overflow check, no fallback.
  force_dropless: bool = False
  # 'step' mode only (bool scalar): an earlier MoE layer of this step overflowed, so this
  # layer takes the chunked dropless path too.
  after_overflow: jax.Array | bool | None = None
