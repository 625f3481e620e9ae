"""The dropless fallback: chunk rule, chunked dropless path, and a cond that is cheap under grad.

Shapes: B local batch, S sequence, D model width, K experts per token, n chunks.

When a capped buffer would overflow, the layer reruns dropless over n sequence chunks, each
with the worst-case buffer of its T / n tokens, which is no larger than the capped buffer. The
chunks run in a `lax.scan` whose body is `jax.checkpoint(nothing_saveable)`: the backward
recomputes one chunk at a time and the weights' gradients accumulate in the scan carry.

Why `cond_with_recompute` and not `lax.cond`: under autodiff a `lax.cond` returns the
residuals of *both* branches (each branch outputs zeros for the other's), so the step would
hold the capped path's and the chunked path's residuals at once; `jax.checkpoint` around the
cond does not change that. `cond_with_recompute` saves only its inputs and the predicate;
its backward is a `lax.cond` over the two branches' VJPs, each recomputing its own forward, so
only the taken branch's residuals ever exist. Under an outer remat (how MoE layers train) the
forward's recompute is dead code that XLA removes, so the extra forward costs nothing there.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from moe_hk.dispatch_plan import worst_case_rows

# chunk_loop(body, xs): runs body(*chunk) for each chunk of the stacked `xs` [n, ...] and
# stacks the results. `scan_chunks` is the only one the library uses.
ChunkLoop = Callable[[Callable[..., jax.Array], Sequence[jax.Array]], jax.Array]


def fallback_num_chunks(*, batch: int, seq: int, k: int, shards: int, local_experts: int,
                        rows: int, requested: int = 0) -> int:
  """Sequence chunks n for the fallback: the smallest divisor of `seq` whose chunk's worst-case
  buffer `shards * batch * (seq / n) * min(k, local_experts)` fits the capped `rows`.

  `requested > 0` checks that count instead. Raises `ValueError` naming the numbers when
  no divisor fits (or the requested count does not divide or fit).
  """
  def chunk_rows(n):
    return worst_case_rows(shards, batch * (seq // n), k, local_experts)

  if requested:
    if seq % requested or chunk_rows(requested) > rows:
      raise ValueError(
          f"dropless_fallback_num_chunks={requested} must divide the local sequence length "
          f"{seq} and give chunks whose worst-case buffer ({shards} shards x {batch} x "
          f"seq/{requested} tokens x min(K={k}, L={local_experts}) = "
          f"{chunk_rows(requested) if seq % requested == 0 else 'n/a'} rows) fits the capped "
          f"buffer of {rows} rows.")
    return requested
  for n in range(1, seq + 1):
    if seq % n == 0 and chunk_rows(n) <= rows:
      return n
  need = shards * batch * min(k, local_experts) / rows
  raise ValueError(
      f"no dropless fallback fits: the capped buffer holds {rows} rows, but even chunks of one "
      f"position need {chunk_rows(seq)} ({shards} shards x batch {batch} x min(K={k}, "
      f"L={local_experts})); chunking the sequence of {seq} would need {need:.3g} x {seq} "
      f"chunks. Raise ragged_buffer_factor, lower the per-device batch, or use "
      f"moe_dropless_fallback='none'.")


def scan_chunks(body: Callable[..., jax.Array], xs: Sequence[jax.Array]) -> jax.Array:
  """Runs `body` over chunks in a `lax.scan` with a `nothing_saveable` checkpointed body."""
  body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  return jax.lax.scan(lambda carry, chunk: (carry, body(*chunk)), None, tuple(xs))[1]


def split_chunks(a: jax.Array, n: int) -> jax.Array:
  """`[B, S, ...]` -> `[n, B * S / n, ...]`: n sequence chunks, each flattened to tokens."""
  b, s = a.shape[:2]
  chunks = a.reshape(b, n, s // n, *a.shape[2:]).swapaxes(0, 1)
  return chunks.reshape(n, b * (s // n), *a.shape[2:])


def merge_chunks(a: jax.Array, batch: int) -> jax.Array:
  """Inverse of `split_chunks`: `[n, B * S / n, ...]` -> `[B, S, ...]`."""
  n, tokens = a.shape[:2]
  per = tokens // batch
  return a.reshape(n, batch, per, *a.shape[2:]).swapaxes(0, 1).reshape(
      batch, n * per, *a.shape[2:])


def chunked_dropless(chunk_fn: Callable[..., jax.Array], x: jax.Array,
                     per_token: Sequence[jax.Array], num_chunks: int,
                     chunk_loop: ChunkLoop = scan_chunks) -> jax.Array:
  """Runs `chunk_fn(x_chunk [T/n, D], *per_token_chunks) -> [T/n, D]` over sequence chunks.

  x `[B, S, D]`; each of `per_token` is `[B, S, ...]` (e.g. expert ids and weights).
  Returns `[B, S, D]`.
  """
  xs = [split_chunks(a, num_chunks) for a in (x, *per_token)]
  return merge_chunks(chunk_loop(chunk_fn, xs), x.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cond_recompute(true_fn, false_fn, pred, operands, aux):
  return jax.lax.cond(pred, true_fn, false_fn, operands, aux)


def _cond_recompute_fwd(true_fn, false_fn, pred, operands, aux):
  return _cond_recompute(true_fn, false_fn, pred, operands, aux), (pred, operands, aux)


def _cond_recompute_bwd(true_fn, false_fn, residuals, cotangent):
  pred, operands, aux = residuals
  def vjp_of(fn):
    return lambda ops, aux_, ct: jax.vjp(lambda o: fn(o, aux_), ops)[1](ct)[0]
  d_operands = jax.lax.cond(pred, vjp_of(true_fn), vjp_of(false_fn), operands, aux, cotangent)
  return None, d_operands, None


_cond_recompute.defvjp(_cond_recompute_fwd, _cond_recompute_bwd)


def cond_with_recompute(pred: jax.Array, true_fn, false_fn, operands, aux):
  """`lax.cond(pred, true_fn, false_fn, operands, aux)` whose VJP recomputes the taken branch.

  `operands` is a pytree of differentiable arrays, `aux` one of non-differentiable ones
  (integers); both functions take `(operands, aux)`. Everything traced must come in through
  these arguments: a custom_vjp may not close over tracers.
  """
  return _cond_recompute(true_fn, false_fn, jnp.asarray(pred, jnp.bool_), operands, aux)
