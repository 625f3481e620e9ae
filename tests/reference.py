"""An independent dense MoE for tests: every expert on every token, then select.

Written without the library's routing, planning or all-to-all code; the receive buffer's size
comes from `moe_hk.buffer_size` (the one place it is computed, held to hand-worked sizes in
tests/test_config.py). `keep_mask` implements
the drop order of docs/design.md with plain loops over shards, receivers, senders and experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def reference_routing(router_w, x, k: int, score: str):
  """Top-k expert ids `[B, S, K]` (descending logit, lower id first on ties) and weights."""
  logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router_w.astype(jnp.float32))
  ids = jnp.argsort(-jax.lax.stop_gradient(logits), axis=-1, stable=True)[..., :k]
  chosen = jnp.take_along_axis(logits, ids, axis=-1)
  weights = jax.nn.softmax(chosen, axis=-1) if score == "softmax" else jax.nn.sigmoid(chosen)
  return ids, weights, logits


def _every_expert(x, wi_0, wi_1, wo):
  """`[B, S, E, D]`: every expert's SwiGLU of every token of `x [B, S, D]`."""
  h = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, wi_0)) * jnp.einsum("bsd,edf->bsef", x, wi_1)
  return jnp.einsum("bsef,efd->bsed", h, wo)


def reference_moe(params, x, *, k: int, score: str = "softmax", keep=None,
                  weights_on: str = "output"):
  """`y[t] = sum_k keep * weight * SwiGLU_{e_k}(x[t])` (`weights_on='output'`), or
  `sum_k keep * SwiGLU_{e_k}(weight * x[t])` ('input', Llama 4); params = (router_w, wi_0,
  wi_1, wo)."""
  router_w, wi_0, wi_1, wo = params
  ids, weights, _ = reference_routing(router_w, x, k, score)
  if weights_on == "output":
    chosen = jnp.take_along_axis(_every_expert(x, wi_0, wi_1, wo), ids[..., None], axis=2)
  else:  # the k-th choice's expert runs on the token scaled by the k-th weight
    chosen = jnp.stack([
        jnp.take_along_axis(_every_expert(x * weights[..., j, None], wi_0, wi_1, wo),
                            ids[..., j, None, None], axis=2)[:, :, 0]
        for j in range(k)], axis=2)                                 # [B, S, K, D]
  if keep is not None:
    chosen = chosen * keep[..., None]
  if weights_on == "input":
    return jnp.sum(chosen, axis=2)
  return jnp.einsum("bsk,bskd->bsd", weights, chosen)


def reference_lb_loss(logits, ids, num_devices: int, num_experts: int) -> float:
  """Switch loss per batch shard (E * fraction routed * mean prob), averaged over shards."""
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  ids = np.asarray(ids)
  losses = []
  for p, e in zip(np.split(probs, num_devices), np.split(ids, num_devices)):
    fraction = np.bincount(e.reshape(-1), minlength=num_experts) / e.size
    losses.append(num_experts * np.sum(fraction * p.reshape(-1, num_experts).mean(0)))
  return float(np.mean(losses))


def keep_mask(ids, *, num_devices: int, shards: int, num_experts: int, rows: int) -> np.ndarray:
  """Which routed rows `[B, S, K]` survive a receive buffer of `rows` rows.

  The batch is split into `num_devices` consecutive shards; consecutive groups of `shards`
  of them form one expert group. Receiver j takes sender 0's rows for its experts first, then
  sender 1's, ...; within a sender, by local expert, then by flattened (b, s, k) position.
  """
  ids = np.asarray(ids)
  per_shard = ids.reshape(num_devices, -1)
  keep = np.zeros(per_shard.shape, bool)
  local = num_experts // shards
  for group in range(num_devices // shards):
    for receiver in range(shards):
      budget = rows
      for sender in range(shards):
        shard = group * shards + sender
        budget = _keep_in_order(keep[shard], per_shard[shard],
                                range(receiver * local, (receiver + 1) * local), budget)
  return keep.reshape(ids.shape)


def _keep_in_order(keep_row, id_row, experts, budget: int) -> int:
  """Marks rows of `id_row` routed to `experts`, expert by expert and then by position, while
  `budget` lasts; returns the budget left."""
  for expert in experts:
    for position in np.flatnonzero(id_row == expert):
      if budget > 0:
        keep_row[position] = True
        budget -= 1
  return budget


def traffic(ids, *, num_devices: int, shards: int, num_experts: int) -> np.ndarray:
  """`[groups, P, P]` rows each sender routes to each receiver's experts."""
  local = num_experts // shards
  per_shard = np.asarray(ids).reshape(num_devices // shards, shards, -1)
  out = np.zeros((num_devices // shards, shards, shards), int)
  for g in range(out.shape[0]):
    for i in range(shards):
      out[g, i] = np.bincount(per_shard[g, i] // local, minlength=shards)
  return out


def ring_keep_mask(ids, *, num_devices: int, shards: int, num_experts: int,
                   rows: int) -> np.ndarray:
  """Ring-of-experts drop order: each shard fills its buffer expert by expert, and within one
  expert by position in the gathered batch (shard-major, then (b, s, k))."""
  ids = np.asarray(ids)
  per_group = ids.reshape(num_devices // shards, -1)  # gathered batch of each expert group
  keep = np.zeros(per_group.shape, bool)
  local = num_experts // shards
  for group in range(per_group.shape[0]):
    for receiver in range(shards):
      _keep_in_order(keep[group], per_group[group],
                     range(receiver * local, (receiver + 1) * local), rows)
  return keep.reshape(ids.shape)
