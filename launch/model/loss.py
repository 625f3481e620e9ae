"""Next-token cross-entropy over a large vocabulary, with its gradient made in the forward pass.

Shapes: B batch, S sequence, D model width, V vocabulary, c a chunk of positions.

The loss is the last thing the step computes, so the gradient of its logits is known as soon as
they are: `softmax(logits) - onehot(target)`. `cross_entropy` forms the gradients of `hidden`
and of the output projection right there, chunk by chunk, and keeps them for the backward,
which only scales them by the loss's cotangent. Autodiff of the same loss either keeps every
chunk's `[B, c, V]` float32 logits for the backward or, chunked under a checkpoint, computes
each chunk's logits a second time there: three matmuls of `[B, c, D] x [D, V]` a chunk here,
where the checkpointed scan needs four.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def logits(hidden: jax.Array, embeddings: jax.Array) -> jax.Array:
  """`hidden [B, S, D] @ embeddings [V, D].T`: float32 logits `[B, S, V]`, the matmul in
  hidden's dtype."""
  return jnp.einsum("bsd,vd->bsv", hidden, embeddings.astype(hidden.dtype),
                    preferred_element_type=jnp.float32)


def cross_entropy(hidden: jax.Array, embeddings: jax.Array, targets: jax.Array,
                  chunk: int = 0) -> jax.Array:
  """Mean next-token cross-entropy of `hidden [B, S, D]` against `targets [B, S]` int, with
  logits `logits(hidden, embeddings [V, D])`.

  `chunk` > 0 takes `chunk` positions at a time in a scan, so that no `[B, S, V]` array exists
  (a large vocabulary at a long sequence would not fit); 0 takes the sequence in one piece.
  Differentiable in `hidden` and `embeddings` (module docstring: their gradients are made in
  the forward pass, the backward scales them).
  """
  seq = hidden.shape[1]
  chunk = chunk or seq
  if seq % chunk:
    raise ValueError(f"loss_chunk={chunk} must divide the sequence length {seq}.")
  return _mean_loss(chunk, hidden, embeddings, targets)


def _chunk(hidden: jax.Array, embeddings: jax.Array, targets: jax.Array, grads: bool):
  """One chunk, `hidden [B, c, D]`, `targets [B, c]`: the summed loss (float32 scalar) and,
  with `grads`, its gradients: `[B, c, D]` in hidden's dtype and `[V, D]` float32."""
  scores = logits(hidden, embeddings)                              # [B, c, V] float32
  log_z = jax.nn.logsumexp(scores, axis=-1)
  picked = jnp.take_along_axis(scores, targets[..., None], axis=-1)[..., 0]
  total = jnp.sum(log_z - picked)
  if not grads:
    return total, None, None
  vocab = embeddings.shape[0]
  d_scores = (jnp.exp(scores - log_z[..., None]) -
              jax.nn.one_hot(targets, vocab, dtype=scores.dtype)).astype(hidden.dtype)
  d_hidden = jnp.einsum("bsv,vd->bsd", d_scores, embeddings.astype(hidden.dtype),
                        preferred_element_type=jnp.float32).astype(hidden.dtype)
  d_embeddings = jnp.einsum("bsv,bsd->vd", d_scores, hidden, preferred_element_type=jnp.float32)
  return total, d_hidden, d_embeddings


def _summed(chunk: int, hidden: jax.Array, embeddings: jax.Array, targets: jax.Array,
            grads: bool):
  """`_chunk` over the sequence in chunks of `chunk` positions: the summed loss and, with
  `grads`, its gradients `[B, S, D]` and `[V, D]` float32 (else None, None)."""
  batch, seq = targets.shape
  if chunk == seq:
    return _chunk(hidden, embeddings, targets, grads)
  split = lambda a: a.reshape(batch, seq // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)

  def body(carry, xs):
    total, d_embeddings = carry
    part, d_hidden, d_part = _chunk(xs[0], embeddings, xs[1], grads)
    return (total + part, d_embeddings if d_part is None else d_embeddings + d_part), d_hidden

  start = (jnp.zeros((), jnp.float32),
           jnp.zeros(embeddings.shape, jnp.float32) if grads else None)
  (total, d_embeddings), d_hidden = jax.lax.scan(body, start, (split(hidden), split(targets)))
  if grads:
    d_hidden = d_hidden.swapaxes(0, 1).reshape(hidden.shape)
  return total, d_hidden, d_embeddings


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mean_loss(chunk: int, hidden: jax.Array, embeddings: jax.Array, targets: jax.Array
               ) -> jax.Array:
  return _summed(chunk, hidden, embeddings, targets, grads=False)[0] / targets.size


def _mean_loss_forward(chunk, hidden, embeddings, targets):
  total, d_hidden, d_embeddings = _summed(chunk, hidden, embeddings, targets, grads=True)
  return total / targets.size, (d_hidden, d_embeddings.astype(embeddings.dtype))


def _mean_loss_backward(chunk, residuals, cotangent):
  """The kept gradients of the summed loss times `cotangent / (B x S)`; targets have none."""
  del chunk
  d_hidden, d_embeddings = residuals
  scale = cotangent / (d_hidden.shape[0] * d_hidden.shape[1])
  return ((scale * d_hidden).astype(d_hidden.dtype),
          (scale * d_embeddings).astype(d_embeddings.dtype), None)


_mean_loss.defvjp(_mean_loss_forward, _mean_loss_backward)
