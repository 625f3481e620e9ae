"""Router: top-k expert choice, combine weights and the load-balance loss (pure functions).

Shapes: T local tokens, D model width, E experts, K experts per token.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import entr


class Routing(NamedTuple):
  """The router's decision for T tokens."""
  expert_ids: jax.Array   # [T, K] int32, the chosen experts in descending logit order.
  weights: jax.Array      # [T, K] float32 combine weights.
  probs: jax.Array        # [T, E] float32 softmax over all logits (load-balance loss only).
  log_norm: jax.Array     # [T] float32 logsumexp of each token's logits (router z-loss only).


def route(x: jax.Array, router_w: jax.Array, k: int, score: str = "softmax") -> Routing:
  """Routes tokens `x [T, D]` with `router_w [D, E]`; logits and weights in float32.

  `score='softmax'` normalises the K selected logits; `'sigmoid'` (Llama4) squashes each
  selected logit on its own, so top-1 weights still carry a gradient to the router.
  """
  logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))  # [T, E]
  top_logits, expert_ids = jax.lax.top_k(logits, k)  # [T, K]
  if score == "softmax":
    weights = jax.nn.softmax(top_logits, axis=-1)
  elif score == "sigmoid":
    weights = jax.nn.sigmoid(top_logits)
  else:
    raise ValueError(f"router score {score!r} is not one of 'softmax', 'sigmoid'.")
  return Routing(expert_ids.astype(jnp.int32), weights, jax.nn.softmax(logits, axis=-1),
                 jax.nn.logsumexp(logits, axis=-1))


def tokens_per_expert(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """Routed rows per expert `[E]` int32 from `expert_ids [T, K]`."""
  return jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1)


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
  """Switch-style loss of one shard: E * sum_e (fraction of rows to e) * (mean prob of e).

  Equals 1 when routing is uniform. Computed once from the full router output, never per
  chunk, so the capped and the fallback branches report the same value.
  """
  counts = tokens_per_expert(routing.expert_ids, num_experts).astype(jnp.float32)
  fraction = counts / routing.expert_ids.size
  mean_prob = jnp.mean(routing.probs, axis=0)
  return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(routing: Routing) -> jax.Array:
  """ST-MoE router z-loss of one shard: mean over tokens of logsumexp(logits)^2.

  Keeps router logits small, so their float32 softmax and top-k stay well conditioned.
  """
  return jnp.mean(jnp.square(routing.log_norm))


def router_entropy(routing: Routing) -> jax.Array:
  """Mean over tokens of the entropy (nats) of the router's softmax over all E experts.

  log(E) when every token is undecided; near 0 when each token is sure of its experts.
  """
  return jnp.mean(jnp.sum(entr(routing.probs), axis=-1))
