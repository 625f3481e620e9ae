"""`LayerCall`: what one call of the MoE layer asks beyond its input and parameters."""
from __future__ import annotations

from typing import NamedTuple

import jax


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
