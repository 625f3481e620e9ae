"""`moe_dropless_fallback='step'`: one compiled train step that replays itself dropless when any
MoE layer overflowed, with the train state donated.

The step first runs every MoE layer capped. If any capped buffer would have dropped rows, the
same step (same batch, same state) is computed again in the same program by the replay graph,
in which every MoE layer takes the chunked dropless path (`MoEConfig.for_step_replay()`), so
memory stays at the capped level. Two `lax.cond`s on the one overflow flag order it so that
no second copy of the state and no second set of gradients is ever alive:

  1. the capped gradients are applied unless the step overflowed (the state is returned
     unchanged if it did), after which they are dead;
  2. if it overflowed, the replay's gradients are computed from that (unchanged) state and
     applied.

Under a cond's autodiff both branches' residuals would be kept, but nothing here is
differentiated through a cond: each branch takes its own gradients.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from moe_hk.stats import MoEStats

# (state, *args) -> (aux outputs containing MoEStats, gradients)
GradFn = Callable[..., tuple[Any, Any]]
# (state, gradients) -> new state
ApplyFn = Callable[[Any, Any], Any]


def any_overflow(tree: Any) -> jax.Array:
  """True if any `MoEStats` in `tree` reports rows beyond its capped buffer (bool scalar)."""
  stats = [s for s in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, MoEStats))
           if isinstance(s, MoEStats)]
  if not stats:
    raise ValueError("any_overflow found no MoEStats in the step's outputs.")
  return jnp.any(jnp.stack([jnp.max(s.would_drop_rows) for s in stats]) > 0)


def step_with_replay(grads: GradFn, replay_grads: GradFn, apply: ApplyFn, state: Any,
                     *args: Any) -> tuple[Any, Any, jax.Array]:
  """The train step `apply(state, grads(state, *args))`, replayed with `replay_grads` when the
  capped attempt overflowed. Traced inside the caller's jit (which may donate `state`).

  `grads` and `replay_grads` are the same gradient computation built from the layer config and
  from `config.for_step_replay()`; both return `(aux, gradients)` of identical structure, aux
  holding the `MoEStats` that `any_overflow` reads. Returns `(new state, aux of the attempt
  that was applied, replayed: bool scalar)`.
  """
  aux, capped_grads = grads(state, *args)
  replayed = any_overflow(aux)
  state = jax.lax.cond(replayed, lambda s, _: s, apply, state, capped_grads)

  def replay(s):
    replay_aux, replay_gradients = replay_grads(s, *args)
    return apply(s, replay_gradients), replay_aux
  state, aux = jax.lax.cond(replayed, replay, lambda s: (s, aux), state)
  return state, aux, replayed
