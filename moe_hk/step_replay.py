"""`moe_dropless_fallback='step'`: discard a train step whose MoE layers overflowed, replay it.

The first attempt runs every layer capped (ring of experts). If any layer's capped buffer
would have dropped rows, its update is thrown away and the same step (same batch, same RNG,
same state) is run again with the replay graph, in which every MoE layer takes the chunked
dropless path (`MoEConfig.for_step_replay()`), so memory stays at the capped level.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from moe_hk.stats import MoEStats


def any_overflow(tree: Any) -> jax.Array:
  """True if any `MoEStats` in `tree` reports rows beyond its capped buffer (bool scalar)."""
  stats = [s for s in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, MoEStats))
           if isinstance(s, MoEStats)]
  if not stats:
    raise ValueError("any_overflow found no MoEStats in the step's outputs.")
  return jnp.any(jnp.stack([jnp.max(s.would_drop_rows) for s in stats]) > 0)


class StepWithReplay:
  """Runs `step(*args)`; when `overflowed(outputs)` is true, returns `replay_step(*args)`.

  `step` and `replay_step` are the same train step built from the layer config and from
  `config.for_step_replay()`. Neither may donate its arguments: a discarded attempt must
  leave the state intact for the replay. Reading the flag moves one scalar to the host.
  """

  def __init__(self, step: Callable[..., Any], replay_step: Callable[..., Any],
               overflowed: Callable[[Any], jax.Array] = any_overflow):
    self.step = step
    self.replay_step = replay_step
    self.overflowed = overflowed
    self.replays = 0  # Steps replayed so far (reported as moe/step_replays).

  def __call__(self, *args) -> tuple[Any, bool]:
    """Returns the step's outputs and whether they come from a replay."""
    outputs = self.step(*args)
    if not bool(jax.device_get(self.overflowed(outputs))):
      return outputs, False
    self.replays += 1
    return self.replay_step(*args), True
