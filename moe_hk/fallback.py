"""The dropless fallback: chunk rule, chunked dropless path, and a switch that is cheap under grad.

Shapes: B local batch, S sequence, D model width, E experts, K experts per token, P expert
shards, n chunks.

When a capped buffer would overflow, the layer reruns dropless over n chunks of its tokens, each
with the worst-case buffer of its T / n tokens, which is no larger than the capped buffer. The
chunks run in a `lax.scan` whose body is `jax.checkpoint(nothing_saveable)`: the backward
recomputes one chunk at a time and the weights' gradients accumulate in the scan carry.

Adaptive chunking: n is sized for the worst case, but a mild overflow usually fits in far
fewer chunks. `chunk_ladder` lists the counts to choose from, `chunk_counts` and
`rung_overflows` find from the routing which of them actually fit the capped buffer, and
`switch_with_recompute` runs the capped path (index 0) or one of the chunked rungs. A rung
with fewer than n chunks keeps the capped buffer and runs only when its chunks' actual
traffic fits it, so it drops nothing either.

Why `switch_with_recompute` and not `lax.switch` (or `lax.cond`): under autodiff they return
the residuals of *every* branch (each branch outputs zeros for the others'), so the step would
hold the capped path's and the chunked paths' residuals at once; `jax.checkpoint` around them
does not change that. `switch_with_recompute` saves only its inputs and the branch index; its
backward is a `lax.switch` over the branches' VJPs, each recomputing its own forward, so only
the taken branch's residuals ever exist. Under an outer remat (how MoE layers train) the
forward's recompute is dead code that XLA removes, so the extra forward costs nothing there.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from moe_hk.dispatch_plan import chunk_receiver_rows, worst_case_rows
from moe_hk.routing import tokens_per_expert

# chunk_loop(body, n): runs body(i) for chunk i = 0 .. n - 1 (each `[T / n, ...]`) and stacks
# the results `[n, T / n, ...]`. `scan_chunks` is the only one the library uses.
ChunkLoop = Callable[[Callable[[jax.Array], jax.Array], int], jax.Array]


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


def scan_chunks(body: Callable[[jax.Array], jax.Array], num_chunks: int) -> jax.Array:
  """Runs `body(i)` over chunk indices in a `lax.scan` with a `nothing_saveable` checkpointed
  body."""
  body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  return jax.lax.scan(lambda carry, i: (carry, body(i)), None, jnp.arange(num_chunks))[1]


def unrolled_chunks(body: Callable[[jax.Array], jax.Array], num_chunks: int) -> jax.Array:
  """The naive chunk loop `scan_chunks` is measured against (never a mode users pick): a
  Python loop, so every chunk's residuals stay alive until the backward."""
  return jnp.stack([body(i) for i in range(num_chunks)])


def token_chunks(a: jax.Array, n: int) -> jax.Array:
  """`[B, S, ...]` -> `[n, B * S / n, ...]`: n contiguous blocks of the (b, s)-ordered tokens."""
  return a.reshape(n, a.shape[0] * a.shape[1] // n, *a.shape[2:])


def chunked_dropless(chunk_fn: Callable[..., jax.Array], x: jax.Array,
                     per_token: Sequence[jax.Array], num_chunks: int,
                     chunk_loop: ChunkLoop = scan_chunks) -> jax.Array:
  """Runs `chunk_fn(x_chunk [T/n, D], *per_token_chunks) -> [T/n, D]` over n chunks.

  x `[B, S, D]`; each of `per_token` is `[B, S, ...]` (e.g. expert ids and weights). Chunk i is
  the i-th block of T / n tokens in (b, s) order (a sequence chunk when B = 1), sliced inside
  the loop body: no stacked `[n, ...]` copy of the inputs exists, which the TPU compiler would
  keep alive through the backward (and pad to 128 lanes for K-wide ids). Returns `[B, S, D]`.
  """
  tokens = x.shape[0] * x.shape[1]
  per = tokens // num_chunks
  flat = [a.reshape(tokens, *a.shape[2:]) for a in (x, *per_token)]
  def body(i):
    return chunk_fn(*[jax.lax.dynamic_slice_in_dim(a, i * per, per) for a in flat])
  return chunk_loop(body, num_chunks).reshape(x.shape[:2] + (-1,))


def chunk_ladder(max_chunks: int) -> tuple[int, ...]:
  """Chunk counts the adaptive fallback chooses from, fewest first: the smallest divisor
  p > 1 of `max_chunks`, then `max_chunks` (8 -> (2, 8); 12 -> (2, 12); 9 -> (3, 9); 7 -> (7,)).

  p divides `max_chunks`, so p's chunks are unions of the finest ones, and when p fits the
  buffer so does `max_chunks`: the first fitting rung is well defined on every device. Why
  not every divisor: each rung is a switch branch, compiled, and the TPU compiler of jax 0.12
  does not share all buffers between branches. One layer on v5p (benchmarks/fallback_memory,
  n = 8): fixed chunking 56.8 MiB, rungs (2, 8) 60.3, rungs (2, 4, 8) 63.3. A mild overflow,
  which this is for, fits in p chunks.
  """
  smallest = next((d for d in range(2, max_chunks) if max_chunks % d == 0), max_chunks)
  return (smallest,) if smallest == max_chunks else (smallest, max_chunks)


def chunk_counts(expert_ids: jax.Array, num_chunks: int, num_experts: int) -> jax.Array:
  """Routed rows per expert in each `token_chunks` chunk: `expert_ids [B, S, K]` -> `[n, E]`."""
  return jax.vmap(tokens_per_expert, in_axes=(0, None))(token_chunks(expert_ids, num_chunks),
                                                        num_experts)


def rung_overflows(fine_counts: jax.Array, rungs: Sequence[int], rows: int) -> jax.Array:
  """`[len(rungs)]` bool: whether some receiver gets more than `rows` rows from some chunk when
  the layer runs in `rungs[r]` chunks, from the all-gathered `fine_counts [P, n, E]` of every
  sender's n finest chunks (each rung divides n). A rung of 1 is the unchunked capped layer."""
  return jnp.stack([jnp.max(chunk_receiver_rows(fine_counts, n)) > rows for n in rungs])


def first_fit(overflows: jax.Array) -> jax.Array:
  """Index of the first rung that does not overflow (int32 scalar); the last one always fits."""
  return jnp.argmin(overflows).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _switch_recompute(branches, index, operands, aux):
  return jax.lax.switch(index, branches, operands, aux)


def _switch_recompute_fwd(branches, index, operands, aux):
  return _switch_recompute(branches, index, operands, aux), (index, operands, aux)


def _switch_recompute_bwd(branches, residuals, cotangent):
  index, operands, aux = residuals
  def vjp_of(fn):
    return lambda ops, aux_, ct: jax.vjp(lambda o: fn(o, aux_), ops)[1](ct)[0]
  d_operands = jax.lax.switch(index, [vjp_of(fn) for fn in branches], operands, aux, cotangent)
  return None, d_operands, None


_switch_recompute.defvjp(_switch_recompute_fwd, _switch_recompute_bwd)


def switch_with_recompute(index: jax.Array, branches: Sequence[Callable], operands, aux):
  """`lax.switch(index, branches, operands, aux)` whose VJP recomputes the taken branch.

  `operands` is a pytree of differentiable arrays, `aux` one of non-differentiable ones
  (integers); every branch takes `(operands, aux)`. Everything traced must come in through
  these arguments: a custom_vjp may not close over tracers.
  """
  return _switch_recompute(tuple(branches), jnp.asarray(index, jnp.int32), operands, aux)


def cond_with_recompute(pred: jax.Array, true_fn, false_fn, operands, aux):
  """`lax.cond(pred, true_fn, false_fn, operands, aux)` whose VJP recomputes the taken branch:
  `switch_with_recompute` over `(false_fn, true_fn)`."""
  return switch_with_recompute(jnp.asarray(pred, jnp.bool_), (false_fn, true_fn), operands, aux)
