"""`MoEStats`: what one MoE layer reports per step (identical on every device)."""
from __future__ import annotations

from typing import NamedTuple

import jax


class MoEStats(NamedTuple):
  """Per-layer, per-step statistics, global over the mesh."""
  fallback: jax.Array           # [] int32, 1 if the dropless fallback ran this step.
  required_factor: jax.Array    # [] float32, max over expert groups and receivers of received / N.
  would_drop_rows: jax.Array    # [] int32, rows beyond the capped buffers, fallback or not.
  dropped_rows: jax.Array       # [] int32, rows actually dropped (0 after a fallback or uncapped).
  tokens_per_expert: jax.Array  # [E] int32, routed rows per expert over the whole batch.
  # [] int32, tokens whose router logits are not all finite, over the whole batch: routed to
  # no expert (in no count above or below: no overflow, no fallback), their output rows NaN.
  nonfinite_tokens: jax.Array
  lb_loss: jax.Array            # [] float32, load-balance loss x load_balance_loss_weight.
  z_loss: jax.Array             # [] float32, router z-loss x router_z_loss_weight.
  # [] int32, chunks the dropless fallback ran in (0 if it did not): the count of the rung
  # that ran. Adaptive rungs of one count differ in buffer rows per chunk (see
  # `moe_hk.fallback.traffic_ladder`), each chunk no larger than the fixed fallback's.
  fallback_chunks: jax.Array
  router_entropy: jax.Array     # [] float32, mean over tokens of the router softmax's entropy (nats).
  # [P] int32, rows beyond the capped buffer of each receiving expert shard, summed over
  # expert groups (sums to would_drop_rows): which receivers overflowed.
  receiver_overflow_rows: jax.Array
  # [devices, E] int32 with MoEConfig.record_traffic (else [0, E]): rows each device routed to
  # each expert, devices in mesh order (expert axis fastest: P consecutive devices are one
  # expert group).
  routed_rows_per_device: jax.Array
