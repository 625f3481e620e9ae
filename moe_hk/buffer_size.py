"""How many rows each expert shard's receive buffer holds: integer arithmetic, no jax.

The one place the buffer is sized. The layer (`moe_hk.dispatch_plan`, `moe_hk.fallback`), the
host-only planner (`launch.planning`, which may not import jax), the launcher and the tests'
reference all use it. Shapes per expert-parallel shard: P shards on the expert axis, T local
tokens, K experts per token, L = E / P local experts, N = T * K routed rows (the balanced
receive size).
"""
from __future__ import annotations

import math

WORST_CASE = -1  # the ragged_buffer_factor that asks for the worst-case buffer


def worst_case_rows(num_shards: int, tokens: int, k: int, local_experts: int) -> int:
  """The largest receive count any shard can see: every token of every shard sends min(K, L)
  of its rows to it."""
  return num_shards * tokens * min(k, local_experts)


def worst_case_factor(num_experts: int, k: int, expert_shards: int) -> float:
  """The factor whose buffer is the worst case, min(P, E / K): `worst_case_rows` over N."""
  return min(expert_shards, num_experts / k)


def factor_in_force(factor: float, worst_case: float) -> float:
  """The buffer factor `factor` stands for: itself, or `worst_case` for `WORST_CASE` (-1)."""
  return worst_case if factor == WORST_CASE else float(factor)


def buffer_rows(num_shards: int, tokens: int, k: int, local_experts: int, factor: float) -> int:
  """Receive-buffer rows R: floor(N x `factor`) capped at the worst case; `WORST_CASE` (-1)
  is the worst case. ValueError when the buffer would hold no row."""
  worst = worst_case_rows(num_shards, tokens, k, local_experts)
  if factor == WORST_CASE:
    return worst
  rows = min(math.floor(tokens * k * factor), worst)
  if rows < 1:
    raise ValueError(
        f"ragged_buffer_factor={factor:g} leaves a receive buffer of {rows} rows for "
        f"{tokens * k} routed rows per shard; it must be >= {1 / (tokens * k):.6g}.")
  return rows
