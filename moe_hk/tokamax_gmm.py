"""The `tokamax` grouped-matmul backend: tokamax's `ragged_dot`, Pallas Mosaic GPU kernels.

Shapes: M rows grouped by expert (group g holds `group_sizes[g]` consecutive rows, rows past
`sum(group_sizes)` are padding), G groups, D model width, F expert width, K / N contracted /
output width of one grouped matmul.

`tokamax.ragged_dot_general` has `jax.lax.ragged_dot_general`'s signature plus a choice of
implementation (`implementation`):

* GPU, bfloat16 (or float16): 'mosaic_gpu', the Pallas Mosaic GPU kernels (wgmma on an
  H100 / H200). Both operands must have one dtype, and the result stays in it.
* GPU, float32: 'xla', i.e. XLA's `ragged_dot`. The kernels refuse float32, and casting to
  bfloat16 would quietly turn a float32 layer into a bfloat16 one. XLA's ragged_dot is slow
  on GPU (benchmarks/gpu_native.py), so `gmm_impl='auto'` never picks this backend for a
  float32 layer.
* CPU (`reference=True`, what `resolve_backends` passes on a CPU mesh): 'xla', tokamax's
  reference, so the suite runs this module's wrapper exactly, only the kernels underneath
  differ. The Mosaic GPU kernels cannot run on a CPU.
* TPU: not offered (`resolve_backends` refuses it); `megablox` is the TPU kernel backend.

The backward is this module's, built from the same three products tokamax's own backward
uses (the input gradient is a grouped matmul by the transposed weights, the weight gradient
a product that contracts over each group's rows), because tokamax's custom VJP returns its
kernels' cotangents without the mesh axes they vary over, which the layer's shard_map
(with its vma check) rejects; here they are marked like the blocked backend's (`moe_hk.vma`).

Padding rows. The Mosaic GPU kernels leave the rows past the groups unwritten (whatever the
buffer held, NaN included), in the output and in the input gradient; the weight-gradient
kernel masks the rows outside a group by multiplying (garbage x 0 may be NaN), and reads the
other operand's rows there unmasked. So every product here reads zeros on padding rows, and
its results are selected (`jnp.where`) to 0 there: the output and the input gradient of a
padding row are 0, and nothing from one reaches a weight gradient. The selects are
elementwise passes XLA fuses into their neighbours; the XLA implementation needs none of
them but runs them too, so that the CPU suite tests the wrapper a GPU runs.

tokamax is imported on first use: `import moe_hk` does not pay for it.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from moe_hk import expert_swiglu
from moe_hk.vma import sum_to_axes_of, vary_like

GPU_KERNEL = "mosaic_gpu"  # tokamax's name for its Pallas Mosaic GPU ragged_dot.
REFERENCE = "xla"          # tokamax's XLA implementation: jax.lax.ragged_dot_general.
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)

# The three products, as tokamax's kernels recognise them (lists, as tokamax writes them:
# the kernels compare dimension numbers by value).
_ROWS_BY_GROUP = jax.lax.RaggedDotDimensionNumbers(   # [M, K] x [G, K, N] -> [M, N]
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_ROWS_BY_GROUP_T = jax.lax.RaggedDotDimensionNumbers(  # [M, N] x [G, K, N] -> [M, K]
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_OVER_GROUP_ROWS = jax.lax.RaggedDotDimensionNumbers(  # [M, K] x [M, N] -> [G, K, N]
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def implementation(dtype: Any, reference: bool) -> str:
  """The tokamax implementation for operands of `dtype`: the GPU kernels for bfloat16 and
  float16, XLA's ragged_dot for other dtypes and wherever `reference` (a CPU mesh)."""
  return GPU_KERNEL if not reference and jnp.dtype(dtype) in _KERNEL_DTYPES else REFERENCE


def _in_groups(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`rows [M, C]` with the rows past the groups set to 0 (a select: garbage may be NaN)."""
  valid = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)  # [M]
  return jnp.where(valid[:, None], rows, 0)


def _tokamax():
  """tokamax, imported on first use (a large import).

  tokamax reads its options from absl flags, and parses the command line on the first read
  if nothing has: 0.0.12 (Python 3.11) parses all of it and fails on the host program's own
  arguments (pytest's, argparse's). Outside an absl program nothing parsed them: they are
  marked parsed with their defaults (no validator runs: another module's required flag is not
  the layer's business).
  """
  import tokamax  # noqa: PLC0415
  from absl import flags  # noqa: PLC0415
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def _product(lhs, rhs, group_sizes, dims, out_dtype, impl) -> jax.Array:
  """One tokamax ragged product (forward only: the VJP below is ours), marked as varying
  over the mesh axes its operands vary over (the kernels' outputs carry none)."""
  out = _tokamax().ragged_dot_general(lhs, rhs, group_sizes, dims,
                                      preferred_element_type=out_dtype, implementation=impl)
  return vary_like(out, lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   implementation: Any) -> jax.Array:
  """`lhs [M, K]` grouped rows times `rhs [G, K, N]` -> `[M, N]` in their dtype.

  Args:
    lhs: `[M, K]` rows grouped by group; rows past `sum(group_sizes)` are padding (any value).
    rhs: `[G, K, N]` one matrix per group, in lhs's dtype.
    group_sizes: `[G]` int32 rows per group, `sum(group_sizes) <= M`.
    implementation: what `tokamax.ragged_dot_general` takes: a name (`implementation(...)`
      picks one) or a tuple holding an op with a pinned config (benchmarks).

  Returns:
    `[M, N]`, 0 on the padding rows; the gradient of lhs's padding rows is 0, and they never
    reach rhs's gradient.
  """
  return _grouped_matmul_fwd(lhs, rhs, group_sizes, implementation)[0]


def _grouped_matmul_fwd(lhs, rhs, group_sizes, implementation):
  lhs = _in_groups(lhs, group_sizes)  # also the residual: the weight gradient reads its rows
  out = _product(lhs, rhs, group_sizes, _ROWS_BY_GROUP, None, implementation)  # [M, N]
  return _in_groups(out, group_sizes), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(implementation, res, dy):
  lhs, rhs, group_sizes = res
  dy = _in_groups(dy, group_sizes)                                                  # [M, N]
  dlhs = _product(dy, rhs, group_sizes, _ROWS_BY_GROUP_T, lhs.dtype, implementation)  # [M, K]
  drhs = _product(lhs, dy, group_sizes, _OVER_GROUP_ROWS, rhs.dtype, implementation)  # [G, K, N]
  return (sum_to_axes_of(_in_groups(dlhs, group_sizes), lhs), sum_to_axes_of(drhs, rhs),
          None)


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def expert_mlp(x: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array,
               group_sizes: jax.Array, reference: bool) -> jax.Array:
  """`silu(x @ wi_0[g]) * (x @ wi_1[g]) @ wo[g]` per row of group g, with tokamax.

  x `[M, D]`, wi_0 / wi_1 `[G, D, F]`, wo `[G, F, D]` (all in x's dtype), group_sizes `[G]`
  -> `[M, D]` in x's dtype, 0 past the groups, where x's gradient is 0 too. `reference`
  runs tokamax's XLA implementation (a CPU mesh) instead of its GPU kernels.
  """
  group_sizes = group_sizes.astype(jnp.int32)
  impl = implementation(x.dtype, reference)
  mm = lambda rows, w: grouped_matmul(rows, w, group_sizes, impl)
  return expert_swiglu.swiglu(mm, x, wi_0, wi_1, wo)  # 0 on padding rows
