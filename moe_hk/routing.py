"""Router: top-k expert choice, combine weights and the load-balance loss (pure functions).

Shapes: T local tokens, D model width, E experts, K experts per token.

A token whose router logits are not all finite (NaN or inf input, or logits that overflow) is
routed to no expert: its K rows get the id `E` (`unrouted_id`), which sorts after every expert
and which every count leaves out, like the buffer's padding rows, and combine weight 0. It
never raises the required buffer factor, overflows a buffer or triggers the fallback; the
layer's output row for it is NaN (`nan_where_unrouted`), and the router statistics are means
over the finite tokens only.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import entr


class Routing(NamedTuple):
  """The router's decision for T tokens."""
  # [T, K] int32, the chosen experts in descending logit order; `unrouted_id` (E) for every
  # row of a token whose logits are not all finite.
  expert_ids: jax.Array
  weights: jax.Array      # [T, K] float32 combine weights (0 for a non-finite token).
  probs: jax.Array        # [T, E] float32 softmax over all logits (load-balance loss only).
  log_norm: jax.Array     # [T] float32 logsumexp of each token's logits (router z-loss only).
  finite: jax.Array       # [T] bool, the token's router logits are all finite.


def unrouted_id(num_experts: int) -> int:
  """The expert id of a non-finite token's rows: E, after every expert, in no count."""
  return num_experts


def route(x: jax.Array, router_w: jax.Array, k: int, score: str = "softmax",
          norm_topk_prob: bool = True) -> Routing:
  """Routes tokens `x [T, D]` with `router_w [D, E]`; logits and weights in float32.

  `score='softmax'` normalises the K selected logits (`norm_topk_prob=False`: the weights are
  the selected experts' probabilities under the softmax over all E logits, summing to < 1);
  `'sigmoid'` (Llama4) squashes each selected logit on its own, so top-1 weights still carry
  a gradient to the router.
  A token whose logits are not all finite goes to expert `unrouted_id` with weight 0.
  """
  assert score in ("softmax", "sigmoid"), f"router score {score!r}: MoEConfig checks it"
  x = x.astype(jnp.float32)
  num_experts = router_w.shape[-1]
  # A non-finite x makes every logit non-finite (x * 0 is NaN for inf and NaN), so zeroing its
  # row changes no decision; it keeps the router's gradient x^T dlogits free of 0 * NaN.
  x_finite = jnp.all(jnp.isfinite(x), axis=-1)                               # [T]
  logits = jnp.dot(jnp.where(x_finite[:, None], x, 0), router_w.astype(jnp.float32))  # [T, E]
  finite = x_finite & jnp.all(jnp.isfinite(logits), axis=-1)
  # Logits of 0 for non-finite tokens keep every quantity below finite, and their gradient
  # exactly 0 (a select, not a product, cuts them off).
  logits = jnp.where(finite[:, None], logits, 0)
  top_logits, expert_ids = jax.lax.top_k(logits, k)  # [T, K]
  if score == "softmax" and not norm_topk_prob:
    weights = jnp.exp(top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
  elif score == "softmax":
    weights = jax.nn.softmax(top_logits, axis=-1)
  else:
    weights = jax.nn.sigmoid(top_logits)
  expert_ids = jnp.where(finite[:, None], expert_ids.astype(jnp.int32),
                         unrouted_id(num_experts))
  return Routing(expert_ids, jnp.where(finite[:, None], weights, 0),
                 jax.nn.softmax(logits, axis=-1), jax.nn.logsumexp(logits, axis=-1), finite)


def tokens_per_expert(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """Routed rows per expert `[E]` int32 from `expert_ids [T, K]`; rows of id `unrouted_id`
  (non-finite tokens) are not counted."""
  return jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1, mode="drop")


def nonfinite_tokens(routing: Routing) -> jax.Array:
  """Tokens routed nowhere because their logits are not all finite (int32 scalar)."""
  return jnp.sum(~routing.finite, dtype=jnp.int32)


def nan_where_unrouted(y: jax.Array, expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """A branch's output `y [T, D]` with NaN rows for the tokens routed nowhere (`expert_ids
  [T, K]` of `unrouted_id`): a non-finite token's output is NaN, whatever its rows (never
  sent) came back as. The select passes no cotangent to those rows.

  The layer applies it to each branch's own output (the capped path's; a fallback rung's,
  after its chunks), inside the branch. Compiled for TPU, once after the fallback's switch it
  kept another `[T, D]` float32 buffer alive beside the switch's output (Maverick on v5p: the
  fallback step 1.037x the capped one), and once per chunk it cost the adaptive fallback's
  rungs one more each (docs/aot-memory.md)."""
  routed = expert_ids[:, 0] < unrouted_id(num_experts)  # a token's K rows go nowhere together
  return jnp.where(routed[:, None], y, jnp.nan)


def _finite_mean(values: jax.Array, finite: jax.Array) -> jax.Array:
  """Mean of `values [T, ...]` over the finite tokens (`finite [T]`); 0 if there are none."""
  count = jnp.maximum(jnp.sum(finite), 1).astype(jnp.float32)
  mask = finite.reshape(finite.shape + (1,) * (values.ndim - 1))
  return jnp.sum(jnp.where(mask, values, 0), axis=0) / count


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
  """Switch-style loss of one shard: E * sum_e (fraction of rows to e) * (mean prob of e),
  over its finite tokens.

  Equals 1 when routing is uniform. Computed once from the full router output, never per
  chunk, so the capped and the fallback branches report the same value.
  """
  counts = tokens_per_expert(routing.expert_ids, num_experts).astype(jnp.float32)
  rows = jnp.maximum(jnp.sum(counts), 1)  # the finite tokens' T * K rows
  mean_prob = _finite_mean(routing.probs, routing.finite)
  return num_experts * jnp.sum(counts / rows * mean_prob)


def router_z_loss(routing: Routing) -> jax.Array:
  """ST-MoE router z-loss of one shard: mean over finite tokens of logsumexp(logits)^2.

  Keeps router logits small, so their float32 softmax and top-k stay well conditioned.
  """
  return _finite_mean(jnp.square(routing.log_norm), routing.finite)


def router_entropy(routing: Routing) -> jax.Array:
  """Mean over finite tokens of the entropy (nats) of the router's softmax over all E experts.

  log(E) when every token is undecided; near 0 when each token is sure of its experts.
  """
  return _finite_mean(jnp.sum(entr(routing.probs), axis=-1), routing.finite)
