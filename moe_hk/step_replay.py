"""`moe_dropless_fallback='step'`: one compiled train step that replays itself dropless when any
MoE layer overflowed, with the train state donated.

The step first runs the forward with every MoE layer capped. If any capped buffer would have
dropped rows, the gradients come instead from the replay graph, the same loss in which every
MoE layer takes the chunked dropless path (`MoEConfig.for_step_replay()`), so memory stays at
the capped level; otherwise from the capped forward's own backward. One `lax.cond` on the
overflow flag picks which, after the capped forward and before any backward:

  * no second copy of the state: the caller applies the chosen gradients once, outside the
    cond, so its update runs in place on the donated state;
  * no second set of gradients: the capped backward runs only in the branch that keeps it;
  * what the replay branch holds beside its own work is the capped forward's residuals (under
    the launcher's remat, one `[B, S, D]` per layer group).

Nothing is differentiated through the cond (each branch takes its own gradients), so no
branch's residuals are kept for another.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from moe_hk.stats import MoEStats

# (params, *args) -> (scalar loss, aux holding MoEStats)
LossFn = Callable[..., tuple[jax.Array, Any]]


def any_overflow(tree: Any) -> jax.Array:
  """True if any `MoEStats` in `tree` reports rows beyond its capped buffer (bool scalar)."""
  stats = [s for s in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, MoEStats))
           if isinstance(s, MoEStats)]
  if not stats:
    raise ValueError("any_overflow found no MoEStats in the step's outputs.")
  return jnp.any(jnp.stack([jnp.max(s.would_drop_rows) for s in stats]) > 0)


def grads_with_replay(loss: LossFn, replay_loss: LossFn, params: Any, *args: Any
                      ) -> tuple[Any, Any, jax.Array]:
  """Gradients of `loss(params, *args)` w.r.t. params, from `replay_loss` instead when the capped
  forward overflowed. Traced inside the caller's jit, which applies them (and may donate).

  `loss` and `replay_loss` are the same loss built from the layer config and from
  `config.for_step_replay()`; both return `(scalar, aux)` with identical aux structure, aux
  holding the `MoEStats` that `any_overflow` reads. Returns `(gradients, aux of the attempt
  they come from, replayed: bool scalar)`.
  """
  value, pullback, aux = jax.vjp(lambda p: loss(p, *args), params, has_aux=True)
  replayed = any_overflow(aux)

  def capped(_):
    return pullback(jnp.ones_like(value))[0], aux

  def replay(_):
    (_, replay_aux), gradients = jax.value_and_grad(replay_loss, has_aux=True)(params, *args)
    return gradients, replay_aux
  gradients, aux = jax.lax.cond(replayed, replay, capped, None)
  return gradients, aux, replayed
