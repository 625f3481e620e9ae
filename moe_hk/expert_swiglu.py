"""The SwiGLU expert MLP over rows grouped by expert, built from one grouped matmul, with the
three matmul outputs named so that a remat policy can keep them.

Shapes: M grouped rows, D model width, F expert width, G local experts.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

# The name of each expert matmul's output (`jax.ad_checkpoint.checkpoint_name`): a policy
# that saves it (the launcher's `remat_policy='save_matmuls'`) keeps the three `[M, F]`,
# `[M, F]`, `[M, D]` products instead of running them again in the backward. Outside a remat
# that saves it, and inside the fallback's chunks (rematerialised with nothing saved), the
# name changes nothing.
EXPERT_MATMUL = "expert_matmul"

GroupedMatmul = Callable[[jax.Array, jax.Array], jax.Array]  # (rows [M, K], w [G, K, N]) -> [M, N]


def swiglu(mm: GroupedMatmul, x: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array
           ) -> jax.Array:
  """`silu(mm(x, wi_0)) * mm(x, wi_1)`, cast to x's dtype, times `wo` by `mm`: x `[M, D]`,
  wi_0 / wi_1 `[G, D, F]`, wo `[G, F, D]` -> `[M, D]` as `mm` returns it (a backend masks its
  padding rows after)."""
  product = lambda rows, w: checkpoint_name(mm(rows, w), EXPERT_MATMUL)
  h = jax.nn.silu(product(x, wi_0)) * product(x, wi_1)  # [M, F]
  return product(h.astype(x.dtype), wo)
