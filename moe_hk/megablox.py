"""The `megablox` grouped-matmul backend: jax's Pallas TPU grouped matmul kernels.

Shapes: M rows grouped by expert (group g holds `group_sizes[g]` consecutive rows, rows past
`sum(group_sizes)` are padding), G groups, K / N contracted / output width of one matmul.

`jax.experimental.pallas.ops.tpu.megablox` holds a grouped matmul (`gmm`: `[M, K] x [G, K, N]`,
or `[G, N, K]` read transposed) and its weight-gradient form (`tgmm`). They are Mosaic TPU
kernels: on TPU they compile, on CPU they run in Pallas's interpreter (for tests), and they
cannot run on GPU. Unlike XLA's `ragged_dot`, whose backward reads the weights transposed
through a layout copy of the whole `[G, K, N]` stack, `gmm(transpose_rhs=True)` reads them in
place, so the chunked fallback's backward holds no copy of the local experts' weights.

The kernels leave rows past the groups unwritten (whatever the buffer held). `expert_mlp`
zeroes them in its output; their gradient stays undefined, and the layer's paths keep it from
any sender: they gather the rows with those rows cut off (`expert_rows.take_rows`,
`grouped_rows`), or no exchange sends them back (an empty buffer row is no sender's). Masking
the input gradient here costs another buffer-sized array per chunk in the fallback's backward. The
kernels also need M to be a multiple of their row tile; `expert_mlp` pads the rows up to
one once, for all three matmuls.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import jax
import jax.numpy as jnp

from moe_hk import expert_swiglu

# The kernels' public module, `megablox/gmm.py` (its `gmm` and `tgmm`). The package exports
# the custom-VJP `gmm` function under the same name, which hides the module from `import ...
# as` and `from ... import`; `import_module` returns the module itself.
kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

# Tiles, tried largest first. The kernels' default, 128 everywhere, ran the expert matmuls of a
# [32768, 2048] x [8, 2048, 2816] bfloat16 layer at 10.9 TFLOP/s on a v5e chip; (512, 512,
# 512) at 92.9, (512, 1024, 1024) at 113.5 (MaxText's choice), and (1024, 1024, 1024) did not
# fit the kernel's VMEM (docs/tpu-chip.md). Bigger tiles mean fewer grid steps and longer
# matmuls per step, so the rule takes the largest that fit VMEM_BUDGET.
ROW_TILES = (512, 256, 128)
WIDTH_TILES = (1024, 512, 256, 128)
_SUBLANES = 16      # Smallest row tile: the sublane packing of bfloat16 on TPU.
# What one grid step may hold in VMEM: under the 16 MiB that Mosaic scopes by default on
# v5e (the (1024, 1024, 1024) bfloat16 tiling needs 16 MiB by `vmem_bytes`).
VMEM_BUDGET = 12 * 2**20


def row_tile(num_rows: int) -> int:
  """The row tile for `num_rows` rows: the largest of ROW_TILES that pads them by at most an
  eighth (rows are padded up to a multiple of it), or all of them rounded up to _SUBLANES
  when fewer than the smallest tile."""
  if num_rows <= ROW_TILES[-1]:
    return -(-num_rows // _SUBLANES) * _SUBLANES
  return next(t for t in ROW_TILES if t == ROW_TILES[-1] or -num_rows % t <= num_rows // 8)


def vmem_bytes(tiling: tuple[int, int, int], itemsize: int) -> int:
  """VMEM of one grid step of a `(tm, tk, tn)` tiling on operands of `itemsize` bytes: the
  double-buffered lhs, rhs and output tiles and the float32 accumulator."""
  tm, tk, tn = tiling
  return 2 * itemsize * (tm * tk + tk * tn + tm * tn) + 4 * tm * tn


def tiling(rows: int, contracted: int, out: int, itemsize: int) -> tuple[int, int, int]:
  """`(tm, tk, tn)` for `[rows, contracted] x [contracted, out]` on `itemsize`-byte operands,
  `rows` padded to a multiple of `row_tile` (as `expert_mlp` pads them): the largest of
  ROW_TILES dividing `rows` (all of them when fewer), and the largest width tiles (each at
  most its dimension, square first) within VMEM_BUDGET. The kernels mask a partial last tile
  of `contracted` and `out`; the rows must divide."""
  tm = next((t for t in ROW_TILES if rows % t == 0), rows)
  widths = sorted(((min(tk, contracted), min(tn, out)) for tk in WIDTH_TILES
                   for tn in WIDTH_TILES), key=lambda w: (-w[0] * w[1], abs(w[0] - w[1])))
  return next(((tm, tk, tn) for tk, tn in widths
               if vmem_bytes((tm, tk, tn), itemsize) <= VMEM_BUDGET), (tm, 128, 128))


def _precision(lhs: jax.Array, rhs: jax.Array):
  """The matmul precision to trace a kernel under. Mosaic rejects fp32 contract precision
  (what `jax_default_matmul_precision='highest'` asks for) on bfloat16 operands, whose
  products are exact in the kernels' float32 accumulator anyway, so those take the default."""
  both_bf16 = lhs.dtype == rhs.dtype == jnp.bfloat16
  return jax.default_matmul_precision("default") if both_bf16 else contextlib.nullcontext()


def _in_groups(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`y [M, C]` with the rows past the groups set to 0 (a select: garbage there may be NaN)."""
  return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(group_sizes))[:, None], y, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool
                   ) -> jax.Array:
  """`x [M, K]` grouped rows times `w [G, K, N]` -> `[M, N]` in x's dtype; rows past the
  groups are left unwritten (undefined), in the output and in the input gradient.

  M must be a multiple of `row_tile(M)`; group_sizes `[G]` int32. Tiles: `tiling`.
  """
  (m, k), n = x.shape, w.shape[2]
  with _precision(x, w):
    return kernels.gmm(x, w, group_sizes, x.dtype, tiling(m, k, n, x.dtype.itemsize),
                       interpret=interpret)


def _grouped_matmul_fwd(x, w, group_sizes, interpret):
  return grouped_matmul(x, w, group_sizes, interpret), (x, w, group_sizes)


def _grouped_matmul_bwd(interpret, res, dy):
  # jax's own VJP of `gmm` (megablox.ops) does the same, but traces its kernels outside the
  # precision context above.
  x, w, group_sizes = res
  (m, k), n = x.shape, w.shape[2]
  with _precision(dy, w):
    dx = kernels.gmm(dy, w, group_sizes, x.dtype, tiling(m, n, k, dy.dtype.itemsize),
                     transpose_rhs=True, interpret=interpret)             # [M, K]
  with _precision(x, dy):  # tgmm selects each group's rows: padding rows never enter dw
    dw = kernels.tgmm(x.swapaxes(0, 1), dy, group_sizes, w.dtype,
                      tiling(m, k, n, x.dtype.itemsize), num_actual_groups=w.shape[0],
                      interpret=interpret)                                # [G, K, N]
  return dx, dw, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def expert_mlp(x: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array,
               group_sizes: jax.Array, interpret: bool) -> jax.Array:
  """SwiGLU experts on grouped rows `x [M, D]` -> `[M, D]` in x's dtype (padding rows 0);
  weights `[G, D, F]`, `[G, D, F]`, `[G, F, D]` in x's dtype. The gradient of x's padding
  rows is undefined (it may be NaN); inside, the padding rows stay undefined too (each row's
  result depends on that row alone), so no `[M, F]` intermediate is masked.
  """
  group_sizes = group_sizes.astype(jnp.int32)
  rows = x.shape[0]
  pad = -rows % row_tile(rows)
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
  mm = lambda rows_in, w: grouped_matmul(rows_in, w, group_sizes, interpret)
  return _in_groups(expert_swiglu.swiglu(mm, x, wi_0, wi_1, wo), group_sizes)[:rows]
