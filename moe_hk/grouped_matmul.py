"""Grouped matmuls and the SwiGLU expert MLP over rows grouped by expert.

Shapes: M rows grouped by expert (group g holds `group_sizes[g]` consecutive rows, rows past
`sum(group_sizes)` are padding), G groups (local experts), D model width, F expert width,
b rows per block, NB blocks.

`ragged_dot` is the accelerator backend. On XLA:CPU `ragged_dot` is a masked dense product
that pays G times the useful FLOPs, so the `blocked` backend instead lays each group out in
whole blocks of b rows (at most G - 1 extra blocks of padding in all) and loops over blocks,
multiplying each by its own expert's weights.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_hk.vma import sum_to_axes_of, vary_like


def _cdiv(a, b):
  return (a + b - 1) // b


class BlockLayout(NamedTuple):
  """Where each row goes when groups are padded to whole blocks of b rows."""
  source: jax.Array       # [NB * b] int32 row feeding each padded slot (clipped when empty).
  valid: jax.Array        # [NB * b] bool, slot holds a real row.
  block_group: jax.Array  # [NB] int32 group of each block (clipped to G - 1 for empty blocks).
  slot: jax.Array         # [M] int32 padded slot of each row; NB * b for padding rows.


def block_layout(group_sizes: jax.Array, num_rows: int, block_rows: int) -> BlockLayout:
  """Padded block layout of `num_rows` rows in `G = len(group_sizes)` groups."""
  num_groups = group_sizes.shape[0]
  # Each group wastes at most b - 1 rows, so this many blocks always suffice.
  num_blocks = _cdiv(num_rows + num_groups * (block_rows - 1), block_rows)
  group_sizes = group_sizes.astype(jnp.int32)
  blocks = _cdiv(group_sizes, block_rows)
  block_end = jnp.cumsum(blocks)
  block_start = block_end - blocks
  row_end = jnp.cumsum(group_sizes)
  row_start = row_end - group_sizes

  block_group = jnp.searchsorted(block_end, jnp.arange(num_blocks), side="right")  # [NB]
  slot_ids = jnp.arange(num_blocks * block_rows, dtype=jnp.int32)
  slot_group = jnp.repeat(block_group, block_rows, total_repeat_length=num_blocks * block_rows)
  group = jnp.minimum(slot_group, num_groups - 1)
  in_group = slot_ids - block_start[group] * block_rows
  valid = (slot_group < num_groups) & (in_group < group_sizes[group])
  source = jnp.where(valid, row_start[group] + in_group, 0)

  rows = jnp.arange(num_rows, dtype=jnp.int32)
  row_group = jnp.minimum(jnp.searchsorted(row_end, rows, side="right"), num_groups - 1)
  slot = jnp.where(rows < row_end[-1],
                   block_start[row_group] * block_rows + rows - row_start[row_group],
                   num_blocks * block_rows)
  return BlockLayout(source, valid, jnp.minimum(block_group, num_groups - 1).astype(jnp.int32),
                     slot.astype(jnp.int32))


@jax.custom_vjp
def block_matmul(x: jax.Array, w: jax.Array, block_group: jax.Array) -> jax.Array:
  """`y[n] = x[n] @ w[block_group[n]]` for `x [NB, b, K]`, `w [G, K, N]` -> `[NB, b, N]`."""
  def body(_, xs):
    x_blk, g = xs
    return None, jnp.dot(x_blk, w[g])
  return jax.lax.scan(body, None, (x, block_group))[1]


def _block_matmul_fwd(x, w, block_group):
  return block_matmul(x, w, block_group), (x, w, block_group)


def _block_matmul_bwd(res, dy):
  # Hand-written so the weight gradient accumulates in place per block; autodiff of the scan
  # would add a full [G, K, N] cotangent on every iteration.
  x, w, block_group = res
  dx = block_matmul(dy, jnp.swapaxes(w, 1, 2), block_group)

  def body(dw, xs):
    x_blk, dy_blk, g = xs
    return dw.at[g].add(jnp.dot(x_blk.T, dy_blk, preferred_element_type=jnp.float32)), None
  dw0 = vary_like(jnp.zeros(w.shape, jnp.float32), x, dy, block_group)
  dw = jax.lax.scan(body, dw0, (x, dy, block_group))[0]
  return sum_to_axes_of(dx, x), sum_to_axes_of(dw, w).astype(w.dtype), None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def _swiglu(h0: jax.Array, h1: jax.Array) -> jax.Array:
  return jax.nn.silu(h0) * h1


def _to_blocks(x: jax.Array, layout: BlockLayout, block_rows: int) -> jax.Array:
  """Grouped rows `[M, K]` -> zero-padded blocks `[NB, b, K]`."""
  padded = jnp.where(layout.valid[:, None], x[layout.source], 0)
  return padded.reshape(-1, block_rows, x.shape[-1])


def _from_blocks(y: jax.Array, layout: BlockLayout) -> jax.Array:
  """Blocks `[NB, b, N]` -> rows `[M, N]`; padding rows get 0."""
  return jnp.take(y.reshape(-1, y.shape[-1]), layout.slot, axis=0, mode="fill", fill_value=0)


def blocked_grouped_matmul(lhs, rhs, group_sizes, block_rows: int) -> jax.Array:
  """`lhs [M, K]` grouped rows times `rhs [G, K, N]` -> `[M, N]` (padding rows give 0)."""
  layout = block_layout(group_sizes, lhs.shape[0], block_rows)
  return _from_blocks(block_matmul(_to_blocks(lhs, layout, block_rows), rhs, layout.block_group),
                      layout)


def blocked_expert_mlp(x, wi_0, wi_1, wo, group_sizes, block_rows: int) -> jax.Array:
  """SwiGLU experts on grouped rows `x [M, D]` -> `[M, D]`; one layout for all three matmuls."""
  layout = block_layout(group_sizes, x.shape[0], block_rows)
  blocks = _to_blocks(x, layout, block_rows)                  # [NB, b, D]
  h = _swiglu(block_matmul(blocks, wi_0, layout.block_group),
              block_matmul(blocks, wi_1, layout.block_group))  # [NB, b, F]
  return _from_blocks(block_matmul(h, wo, layout.block_group), layout)


def ragged_dot_expert_mlp(x, wi_0, wi_1, wo, group_sizes) -> jax.Array:
  """SwiGLU experts with `jax.lax.ragged_dot`; rows past the groups are zeroed explicitly."""
  group_sizes = group_sizes.astype(jnp.int32)
  h = _swiglu(jax.lax.ragged_dot(x, wi_0, group_sizes), jax.lax.ragged_dot(x, wi_1, group_sizes))
  y = jax.lax.ragged_dot(h, wo, group_sizes)
  in_group = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(in_group[:, None], y, 0)


def expert_mlp(x: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array,
               group_sizes: jax.Array, impl: str, block_rows: int = 128) -> jax.Array:
  """`silu(x @ wi_0[g]) * (x @ wi_1[g]) @ wo[g]` per row of group g.

  x `[M, D]`, wi_0/wi_1 `[G, D, F]`, wo `[G, F, D]`, group_sizes `[G]` -> `[M, D]` in x's dtype.
  """
  if impl == "ragged_dot":
    return ragged_dot_expert_mlp(x, wi_0, wi_1, wo, group_sizes)
  if impl == "blocked":
    return blocked_expert_mlp(x, wi_0, wi_1, wo, group_sizes, block_rows)
  raise ValueError(f"gmm_impl={impl!r} must be 'ragged_dot' or 'blocked' here.")
