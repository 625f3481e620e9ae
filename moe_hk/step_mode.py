"""`moe_dropless_fallback='step'`: a step that overflowed anywhere trains as the dropless model
from its first overflowing MoE layer on, in the same pass, with the train state donated.

What a replay of the whole step on the chunked dropless path would compute, without a second
pass: the MoE layers before the first overflowing one fit their capped buffers, so their
capped forward and backward already are the dropless ones (the layer tests hold the capped
layer that drops nothing equal to the dense reference, gradients included); from that layer
on, every MoE layer takes the chunked dropless path, whatever its own traffic. The model
threads one flag through its MoE layers:

  flag = False
  y, stats = moe_forward(..., after_overflow=flag)
  flag = overflowed(flag, stats)   # before the next MoE layer

and the step's `any_overflow` says whether it ran dropless. One pass means no second copy of
the state, no second set of gradients and no capped pass's residuals held beside the dropless
ones: the step costs what the 'layer' fallback costs. Both paths.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moe_hk.stats import MoEStats


def overflowed(after_overflow: jax.Array, stats: MoEStats) -> jax.Array:
  """The flag for the next MoE layer: this step overflowed in this layer or an earlier one
  (bool scalar; `stats` are the layer's global stats, the same on every device)."""
  return jnp.logical_or(after_overflow, stats.would_drop_rows > 0)


def any_overflow(tree: Any) -> jax.Array:
  """True if any `MoEStats` in `tree` reports rows beyond its capped buffer (bool scalar)."""
  stats = [s for s in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, MoEStats))
           if isinstance(s, MoEStats)]
  if not stats:
    raise ValueError("any_overflow found no MoEStats in the step's outputs.")
  return jnp.any(jnp.stack([jnp.max(s.would_drop_rows) for s in stats]) > 0)
