"""The dropless fallback: chunk rule, chunked dropless path, and a switch that is cheap under grad.

Shapes: B local batch, S sequence, D model width, E experts, K experts per token, P expert
shards, n chunks.

When a capped buffer would overflow, the layer reruns dropless over n chunks of its tokens, each
with the worst-case buffer of its T / n tokens, which is no larger than the capped buffer. The
chunks run in a `lax.scan` whose body is `jax.checkpoint(nothing_saveable)`: the backward
recomputes one chunk at a time and the weights' gradients accumulate in the scan carry, in the
form the weights are stored (each chunk gathers its experts: `moe_hk.shard_forward`).

Adaptive chunking: n is sized for the worst case, whose n chunks hold as many buffer rows in
all as the worst-case buffer, whatever the overflow. A chunk's cost follows its buffer rows (an
accelerator's grouped matmul runs over the whole buffer), so an overflow that needs 1.2x the
capped buffer should cost about 1.2 capped layers, not the worst case. `traffic_ladder` lists
rungs (chunk count, rows per chunk) whose totals grow by ~1.26x from 1.26 capped buffers to
the fixed rung; `chunk_counts` and `rung_overflows` find from the routing which of them every
chunk fits, and `switch_with_recompute` runs the capped path (index 0) or the first rung that
fits. A rung below its chunks' worst case runs only when their actual traffic fits, so it
drops nothing either; no chunk's buffer is larger than the fixed rung's.

Why `switch_with_recompute` and not a bare `lax.switch` (or `lax.cond`): under autodiff a
switch returns the residuals of *every* branch (each branch outputs zeros for the others'), so
the step would hold the capped path's and the chunked paths' residuals at once, and a
`jax.checkpoint` around the whole switch does not change that. Its backward is the VJP of a
switch whose branches are each checkpointed saving nothing: their residuals are their inputs,
the same for every branch, so the backward's switch recomputes the taken branch alone. The
whole is a `custom_vjp` that keeps only the switch's inputs and index, so that an enclosing
remat policy cannot reach into the branches: a policy that saves matmul outputs (the
launcher's 'save_matmuls') would otherwise keep every chunk's, which is what the chunks exist
to avoid (the 4-layer v5p step of `benchmarks.fallback_memory --remat=save_matmuls`: 2.46x
capped without it, 0.44x with it). Under remat 'full' the two forms hold the same (1.02x); a
`custom_vjp` whose backward switched over the branches' own VJPs held 1.09x (docs/aot-memory.md).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from moe_hk.buffer_size import worst_case_rows
from moe_hk.dispatch_plan import chunk_receiver_rows
from moe_hk.routing import tokens_per_expert

# loop(body, n): runs body(i) for chunk i = 0 .. n - 1 (each `[T / n, ...]`) and stacks the
# results `[n, T / n, ...]`. The layer runs `scan_chunks`; a measurement may trace it with the
# naive `unrolled_chunks` instead (`chunk_loop`).
ChunkLoop = Callable[[Callable[[jax.Array], jax.Array], int], jax.Array]
_CHUNK_LOOP: contextvars.ContextVar[ChunkLoop | None] = contextvars.ContextVar(
    "moe_hk_chunk_loop", default=None)


@contextlib.contextmanager
def chunk_loop(loop: ChunkLoop | None) -> Iterator[None]:
  """For measurements only: MoE layers traced inside the block run their fallback chunks with
  `loop` (`unrolled_chunks`, the naive form the scan is measured against; None: the layer's
  own `scan_chunks`). It acts where the layer is traced, so lower a freshly built function
  inside the block: one traced before keeps the loop it was traced with."""
  token = _CHUNK_LOOP.set(loop)
  try:
    yield
  finally:
    _CHUNK_LOOP.reset(token)


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
  need = chunk_rows(seq) / rows
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
  """The naive chunk loop (a `ChunkLoop`): a Python loop, so every chunk's residuals stay
  alive until the backward. Never a mode users pick: `launch.aot` and the benchmarks measure
  `scan_chunks` against it (`chunk_loop`)."""
  return jnp.stack([body(i) for i in range(num_chunks)])


def token_chunks(a: jax.Array, n: int) -> jax.Array:
  """`[B, S, ...]` -> `[n, B * S / n, ...]`: n contiguous blocks of the (b, s)-ordered tokens."""
  return a.reshape(n, a.shape[0] * a.shape[1] // n, *a.shape[2:])


def chunked_dropless(chunk_fn: Callable[..., jax.Array], x: jax.Array,
                     per_token: Sequence[jax.Array], num_chunks: int) -> jax.Array:
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
  loop = _CHUNK_LOOP.get() or scan_chunks
  return loop(body, num_chunks).reshape(x.shape[:2] + (-1,))


class Rung(NamedTuple):
  """One way to run the dropless fallback: n chunks of T / n tokens, one after another."""
  chunks: int  # n, dividing the local sequence length (1: the capped layer itself).
  rows: int    # Receive-buffer rows of every chunk; never more than the capped buffer's R.


# Neighbouring rungs of the adaptive ladder hold this factor more buffer rows in all: ten
# rungs per decade (Renard's R10 series), so the rung that runs holds at most ~1.26x the rows
# its busiest chunks need.
LADDER_GROWTH = 10 ** 0.1
# At most this many rungs below the fixed one: totals up to 10 ** 0.6 = 3.98 capped buffers;
# a larger overflow (required factor 4x the configured one) runs the fixed rung. Each rung is
# a compiled switch branch: on a v5p topology one 1024-wide layer compiled in 21 s with fixed
# chunking and 219 s with six rungs (benchmarks/fallback_memory.py, jax 0.10).
LADDER_RUNGS = 6


def fixed_rung(*, capped_rows: int, worst_rows: int, max_chunks: int) -> Rung:
  """The fixed fallback: `max_chunks` chunks, each with its tokens' worst-case buffer
  (`worst_rows / max_chunks`, which fits the capped buffer): it fits whatever the routing."""
  return Rung(max_chunks, min(capped_rows, worst_rows // max_chunks))


def traffic_ladder(*, seq: int, capped_rows: int, worst_rows: int, max_chunks: int
                   ) -> tuple[Rung, ...]:
  """The adaptive fallback's rungs: buffer totals of g, g^2, ... capped buffers (g =
  `LADDER_GROWTH`, at most `LADDER_RUNGS` of them), each split over the fewest chunks that keep
  a chunk's buffer within the fixed rung's, then `fixed_rung`.

  Rung i has n_i chunks (the smallest divisor of `seq` >= g^i R / r, r the fixed rung's rows
  per chunk, at most `max_chunks`) of ceil(g^i R / n_i) <= r rows: no rung's chunk buffer is
  larger than the fixed fallback's, so the chunk count the user sizes for memory
  (`dropless_fallback_num_chunks`) bounds every rung (the TPU compiler does not overlap a
  branch's buffers with the capped path's: Maverick, README). Totals stop one step short of
  the fixed rung's (the worst case, `worst_rows`); a rung whose chunks could never overflow is
  left out. Example: R = 6144, worst 32768 (8 shards, top-2, 16 experts, factor 1.5, 2,048
  tokens), `max_chunks` 8 (r = 4096), seq 256: (2, 3868), (4, 2435), (4, 3065), (4, 3859),
  (8, 2429), (8, 3058), (8, 4096): totals 1.26, 1.58, 2.00, 2.51, 3.16, 3.98 and 5.33 capped
  buffers.
  """
  fixed = fixed_rung(capped_rows=capped_rows, worst_rows=worst_rows, max_chunks=max_chunks)
  rungs = []
  for i in range(1, LADDER_RUNGS + 1):
    total = LADDER_GROWTH ** i * capped_rows
    if total * LADDER_GROWTH > worst_rows:
      break
    # max_chunks divides seq and total / fixed.rows < max_chunks (total < worst_rows / g).
    chunks = next(n for n in range(math.ceil(total / fixed.rows), max_chunks + 1)
                  if seq % n == 0)
    rows = math.ceil(total / chunks)
    if rows < worst_rows // chunks:
      rungs.append(Rung(chunks, rows))
  return (*rungs, fixed)


def chunk_counts(expert_ids: jax.Array, num_chunks: int, num_experts: int) -> jax.Array:
  """Routed rows per expert in each `token_chunks` chunk: `expert_ids [B, S, K]` -> `[n, E]`."""
  return jax.vmap(tokens_per_expert, in_axes=(0, None))(token_chunks(expert_ids, num_chunks),
                                                        num_experts)


def finest_chunks(rungs: Sequence[Rung]) -> int:
  """The chunk count every rung's chunks are unions of: the lcm of their counts (it divides
  the sequence length, as each count does)."""
  return math.lcm(*(r.chunks for r in rungs))


def rung_overflows(fine_counts: jax.Array, rungs: Sequence[Rung]) -> jax.Array:
  """`[len(rungs)]` bool: whether some chunk of `rungs[r]` sends some receiver more than its
  buffer's rows, from `fine_counts [P, f, E]`: every sender's `chunk_counts` in the
  `finest_chunks(rungs)` = f chunks, all-gathered over the expert axis."""
  return jnp.stack([jnp.max(chunk_receiver_rows(fine_counts, r.chunks)) > r.rows
                    for r in rungs])


def first_fit(overflows: jax.Array) -> jax.Array:
  """Index of the first rung that does not overflow (int32 scalar); the last one always fits."""
  return jnp.argmin(overflows).astype(jnp.int32)


def switch_with_recompute(index: jax.Array, branches: Sequence[Callable], operands, aux):
  """`lax.switch(index, branches, operands, aux)` whose backward recomputes the taken branch.

  Under autodiff it keeps its inputs and the index for the backward, nothing of any branch,
  whatever an enclosing remat policy would save; the backward is the VJP of a switch over the
  branches each `jax.checkpoint`ed saving nothing (it recomputes the taken branch and runs its
  transpose). `operands` is a pytree of differentiable arrays, `aux` one of non-differentiable
  ones (integers); every branch takes `(operands, aux)`. Everything traced must come in
  through these arguments: a custom_vjp may not close over tracers.
  """
  return _opaque_switch(tuple(branches), jnp.asarray(index, jnp.int32), operands, aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _opaque_switch(branches, index, operands, aux):
  return jax.lax.switch(index, branches, operands, aux)


def _opaque_switch_fwd(branches, index, operands, aux):
  return _opaque_switch(branches, index, operands, aux), (index, operands, aux)


def _opaque_switch_bwd(branches, residuals, cotangent):
  index, operands, aux = residuals
  saving_nothing = [jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
                    for fn in branches]
  _, vjp = jax.vjp(lambda ops: jax.lax.switch(index, saving_nothing, ops, aux), operands)
  return None, vjp(cotangent)[0], None


_opaque_switch.defvjp(_opaque_switch_fwd, _opaque_switch_bwd)


def cond_with_recompute(pred: jax.Array, true_fn, false_fn, operands, aux):
  """`lax.cond(pred, true_fn, false_fn, operands, aux)` whose VJP recomputes the taken branch:
  `switch_with_recompute` over `(false_fn, true_fn)`."""
  return switch_with_recompute(jnp.asarray(pred, jnp.bool_), (false_fn, true_fn), operands, aux)

