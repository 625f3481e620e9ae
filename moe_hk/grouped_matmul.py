"""Grouped matmuls and the SwiGLU expert MLP over rows grouped by expert.

Shapes: M rows grouped by expert (group g holds `group_sizes[g]` consecutive rows, rows past
`sum(group_sizes)` are padding), G groups (local experts), D model width, F expert width,
K / N contracted / output width of one grouped matmul, r rows of one tile, V tile levels.

`ragged_dot` (XLA's) and `megablox` (jax's Pallas TPU kernels, `moe_hk.megablox`) are the TPU
backends; `tokamax` (tokamax's Pallas Mosaic GPU kernels, `moe_hk.tokamax_gmm`) is the GPU
kernel backend. On XLA:CPU `ragged_dot` is a masked dense product that pays G times the useful
FLOPs, so the `blocked` backend loops over groups instead and cuts each group's rows, where
they lie, into tiles of halving size (b, b/2, ... down to about b/8 rows), multiplying each
tile by its group's weights. Only a group's last tile can reach past it (a masked tail, less
than b/8 rows wasted), so nothing is copied into a padded layout, padding rows past the
groups cost nothing, and each group's weights are sliced once, not once per tile. Requires
sum(group_sizes) <= M.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from moe_hk import expert_swiglu, megablox, tokamax_gmm
from moe_hk.vma import sum_to_axes_of, vary_like

# The smallest tile is about block_rows / 8 rows: the masked tail of a group then wastes at
# most an eighth of a block, while tiles stay big enough for the dot to be compute bound.
_HALVINGS = 3


class Level(NamedTuple):
  """One static tile shape of the tiling."""
  rows: int      # r, rows per tile.
  masked: bool   # Tile may reach past its group (the tail level), so rows are masked.


class Tiling(NamedTuple):
  """Where each group's tiles lie; level v tiles rows `start + level_start[g, v]` onwards."""
  group_start: jax.Array  # [G] int32 first row of each group.
  group_end: jax.Array    # [G] int32 one past each group's last row.
  level_start: jax.Array  # [G, V] int32 first row of each level, relative to group_start.
  level_count: jax.Array  # [G, V] int32 tiles at each level.


def tile_levels(block_rows: int, num_rows: int) -> tuple[Level, ...]:
  """Exact levels b, b/2, ... (halving while even, at most `_HALVINGS` times) with
  b = min(block_rows, num_rows), then a masked tail level of the smallest size."""
  rows = [min(block_rows, num_rows)]
  while len(rows) <= _HALVINGS and rows[-1] % 2 == 0:
    rows.append(rows[-1] // 2)
  return tuple(Level(r, False) for r in rows) + (Level(rows[-1], True),)


def tiling(group_sizes: jax.Array, levels: tuple[Level, ...]) -> Tiling:
  """Tiles of `group_sizes [G]`: each exact level covers as many whole tiles as fit in what
  is left of the group; the tail level takes the rest (fewer rows than one tile) if any."""
  sizes = group_sizes.astype(jnp.int32)
  group_end = jnp.cumsum(sizes)
  done = jnp.zeros_like(sizes)
  starts, counts = [], []
  for level in levels:
    count = (sizes > done).astype(jnp.int32) if level.masked else (sizes - done) // level.rows
    starts.append(done)
    counts.append(count)
    done = done + count * level.rows
  return Tiling(group_end - sizes, group_end, jnp.stack(starts, 1), jnp.stack(counts, 1))


class _Tile(NamedTuple):
  offset: jax.Array      # [] int32 first row of the tile's slice (inside [0, M - r]).
  keep: jax.Array | None  # [r, 1] bool rows of the tile's group; None for exact levels.


def _tile(tiles: Tiling, g: jax.Array, v: int, i: jax.Array, level: Level, num_rows: int
          ) -> _Tile:
  """Tile `i` of level `v` of group `g`. A tail tile that would run past row M is slid back,
  and masked to its own group's rows either way."""
  start = tiles.group_start[g] + tiles.level_start[g, v] + i * level.rows
  if not level.masked:
    return _Tile(start, None)
  offset = jnp.minimum(start, num_rows - level.rows)
  rows = offset + jnp.arange(level.rows)
  return _Tile(offset, ((rows >= start) & (rows < tiles.group_end[g]))[:, None])


def _read(x: jax.Array, tile: _Tile, level: Level) -> jax.Array:
  """Rows `x [M, C]` of the tile -> `[r, C]`, rows outside its group zeroed."""
  block = jax.lax.dynamic_slice_in_dim(x, tile.offset, level.rows)
  return block if tile.keep is None else jnp.where(tile.keep, block, 0)


def _write(out: jax.Array, block: jax.Array, tile: _Tile) -> jax.Array:
  """`out [M, C]` with the tile's rows of its group set from `block [r, C]`."""
  if tile.keep is not None:
    old = jax.lax.dynamic_slice_in_dim(out, tile.offset, block.shape[0])
    block = jnp.where(tile.keep, block, old)
  return jax.lax.dynamic_update_slice_in_dim(out, block.astype(out.dtype), tile.offset, 0)


def _for_each_tile(g: jax.Array, tiles: Tiling, levels: tuple[Level, ...], num_rows: int,
                   body: Callable[[_Tile, Level, Any], Any], carry: Any) -> Any:
  """Runs `carry = body(tile, level, carry)` over group g's tiles, level by level."""
  for v, level in enumerate(levels):
    step = lambda i, c, v=v, level=level: body(_tile(tiles, g, v, i, level, num_rows), level, c)
    carry = jax.lax.fori_loop(0, tiles.level_count[g, v], step, carry)
  return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled_matmul(x: jax.Array, w: jax.Array, tiles: Tiling, levels: tuple[Level, ...]
                 ) -> jax.Array:
  """`x [M, K]` grouped rows times `w [G, K, N]` -> `[M, N]`, rows outside the tiles 0."""
  def tile_product(w_g, tile, level, out):
    x_t = jax.lax.dynamic_slice_in_dim(x, tile.offset, level.rows)  # [r, K]; _write masks.
    return _write(out, jnp.dot(x_t, w_g), tile)

  def group(g, out):
    return _for_each_tile(g, tiles, levels, x.shape[0],
                          functools.partial(tile_product, w[g]), out)
  out = vary_like(jnp.zeros((x.shape[0], w.shape[2]), jnp.result_type(x, w)), x, w, *tiles)
  return jax.lax.fori_loop(0, w.shape[0], group, out)


def _tiled_matmul_fwd(x, w, tiles, levels):
  return tiled_matmul(x, w, tiles, levels), (x, w, tiles)


def _tiled_matmul_bwd(levels, res, dy):
  # Hand-written so each group's weight gradient accumulates in one [K, N] carry and is stored
  # once; autodiff of the loops would add a full [G, K, N] cotangent on every tile.
  x, w, tiles = res

  def tile_grads(w_g, tile, level, carry):
    dx, dw_g = carry
    dy_t = _read(dy, tile, level)                                          # [r, N]
    dx = _write(dx, jax.lax.dot_general(dy_t, w_g, (((1,), (1,)), ((), ()))), tile)
    x_t = _read(x, tile, level)  # [r, K], masked too: a non-finite foreign row must not leak.
    return dx, dw_g + jax.lax.dot_general(x_t, dy_t, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

  def group(g, carry):
    dx, dw = carry
    dw_g = vary_like(jnp.zeros(w.shape[1:], jnp.float32), x, w, dy, *tiles)  # [K, N]
    dx, dw_g = _for_each_tile(g, tiles, levels, x.shape[0],
                              functools.partial(tile_grads, w[g]), (dx, dw_g))
    return dx, jax.lax.dynamic_update_index_in_dim(dw, dw_g, g, 0)
  dx = vary_like(jnp.zeros_like(x), x, w, dy, *tiles)
  dw = vary_like(jnp.zeros(w.shape, jnp.float32), x, w, dy, *tiles)
  dx, dw = jax.lax.fori_loop(0, w.shape[0], group, (dx, dw))
  return sum_to_axes_of(dx, x), sum_to_axes_of(dw, w).astype(w.dtype), None


tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def blocked_grouped_matmul(lhs, rhs, group_sizes, block_rows: int) -> jax.Array:
  """`lhs [M, K]` grouped rows times `rhs [G, K, N]` -> `[M, N]` (padding rows give 0)."""
  levels = tile_levels(block_rows, lhs.shape[0])
  return tiled_matmul(lhs, rhs, tiling(group_sizes, levels), levels)


def blocked_expert_mlp(x, wi_0, wi_1, wo, group_sizes, block_rows: int) -> jax.Array:
  """SwiGLU experts on grouped rows `x [M, D]` -> `[M, D]`; one tiling for all three matmuls."""
  levels = tile_levels(block_rows, x.shape[0])
  tiles = tiling(group_sizes, levels)
  return expert_swiglu.swiglu(lambda rows, w: tiled_matmul(rows, w, tiles, levels),
                              x, wi_0, wi_1, wo)


def ragged_dot_expert_mlp(x, wi_0, wi_1, wo, group_sizes) -> jax.Array:
  """SwiGLU experts with `jax.lax.ragged_dot`; rows past the groups are zeroed explicitly."""
  group_sizes = group_sizes.astype(jnp.int32)
  y = expert_swiglu.swiglu(lambda rows, w: jax.lax.ragged_dot(rows, w, group_sizes),
                           x, wi_0, wi_1, wo)
  in_group = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(in_group[:, None], y, 0)


def expert_mlp(x: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array,
               group_sizes: jax.Array, impl: str, block_rows: int = 128,
               interpret: bool = False) -> jax.Array:
  """`silu(x @ wi_0[g]) * (x @ wi_1[g]) @ wo[g]` per row of group g.

  x `[M, D]`, wi_0/wi_1 `[G, D, F]`, wo `[G, F, D]`, group_sizes `[G]` -> `[M, D]` in x's dtype,
  0 past the groups. The gradient of x's rows past the groups is 0, except with 'megablox'
  (undefined). `interpret` (a CPU mesh) runs the 'megablox' kernels in Pallas's interpreter
  and 'tokamax' on its XLA reference implementation (its GPU kernels cannot run on a CPU).
  """
  assert impl in ("ragged_dot", "blocked", "megablox", "tokamax"), (
      f"gmm impl {impl!r}: resolve_backends picks it")
  if impl == "ragged_dot":
    return ragged_dot_expert_mlp(x, wi_0, wi_1, wo, group_sizes)
  if impl == "blocked":
    return blocked_expert_mlp(x, wi_0, wi_1, wo, group_sizes, block_rows)
  if impl == "tokamax":
    return tokamax_gmm.expert_mlp(x, wi_0, wi_1, wo, group_sizes, reference=interpret)
  return megablox.expert_mlp(x, wi_0, wi_1, wo, group_sizes, interpret)
