"""Grouped SwiGLU experts (blocked and ragged_dot) against a per-row dense reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_hk import grouped_matmul
from tests.tree_close import assert_trees_close


def _dense_reference(x, wi_0, wi_1, wo, group_sizes):
  """Each row times its own group's weights; rows past the groups give zero."""
  ends = np.cumsum(group_sizes)
  group = np.searchsorted(ends, np.arange(x.shape[0]), side="right")
  valid = group < len(group_sizes)
  g = np.minimum(group, len(group_sizes) - 1)
  h = jax.nn.silu(jnp.einsum("md,mdf->mf", x, wi_0[g])) * jnp.einsum("md,mdf->mf", x, wi_1[g])
  return jnp.einsum("mf,mfd->md", h, wo[g]) * valid[:, None]


@pytest.mark.parametrize("impl,block_rows", [
    ("blocked", 1), ("blocked", 3), ("blocked", 8), ("blocked", 128), ("ragged_dot", 0)])
@pytest.mark.parametrize("group_sizes", [[5, 0, 7, 2], [0, 0, 0, 0], [20, 0, 0, 0], [1, 1, 1, 13]])
def test_expert_mlp_matches_per_row_reference(impl, block_rows, group_sizes):
  rng = np.random.default_rng(sum(group_sizes))
  rows, d, f, g = 24, 6, 10, len(group_sizes)  # 24 > sum: trailing padding rows.
  x, wi_0, wi_1, wo = (jnp.asarray(rng.normal(size=s), jnp.float32)
                       for s in [(rows, d), (g, d, f), (g, d, f), (g, f, d)])
  sizes = jnp.asarray(group_sizes, jnp.int32)
  cot = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
  mlp = functools.partial(grouped_matmul.expert_mlp, impl=impl, block_rows=max(block_rows, 1))

  def value_and_grads(fn):
    loss = lambda *a: jnp.sum(fn(*a, sizes) * cot)
    return fn(x, wi_0, wi_1, wo, sizes), jax.grad(loss, argnums=(0, 1, 2, 3))(x, wi_0, wi_1, wo)

  y, grads = jax.jit(lambda: value_and_grads(mlp))()
  y_ref, grads_ref = value_and_grads(_dense_reference)
  assert_trees_close(y, y_ref, what="y")
  for name, a, b in zip(["dx", "dwi_0", "dwi_1", "dwo"], grads, grads_ref):
    if np.linalg.norm(b) == 0:
      np.testing.assert_array_equal(a, 0, err_msg=name)  # an empty group gets a zero gradient
    else:
      assert_trees_close(a, b, what=name)
  np.testing.assert_array_equal(np.asarray(y)[sum(group_sizes):], 0)  # padding rows are zero


def test_block_layout_wastes_less_than_a_block_per_group():
  sizes = jnp.array([5, 0, 7, 2], jnp.int32)
  layout = grouped_matmul.block_layout(sizes, num_rows=16, block_rows=4)
  # ceil(5/4) + 0 + ceil(7/4) + ceil(2/4) = 5 blocks used; the static bound is cdiv(16 + 12, 4).
  assert layout.block_group.shape == (7,)
  np.testing.assert_array_equal(layout.block_group[:5], [0, 0, 2, 2, 3])
  np.testing.assert_array_equal(np.asarray(layout.valid).sum(), 14)
  np.testing.assert_array_equal(layout.slot[:14], [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 16, 17])
  np.testing.assert_array_equal(layout.slot[14:], [28, 28])  # padding rows point past the end


@pytest.mark.parametrize("block_rows", [1, 4, 64])
def test_blocked_grouped_matmul_single_product(block_rows):
  rng = np.random.default_rng(block_rows)
  sizes = np.array([3, 0, 9, 4])
  lhs = jnp.asarray(rng.normal(size=(20, 5)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(4, 5, 7)), jnp.float32)
  group = np.minimum(np.searchsorted(np.cumsum(sizes), np.arange(20), side="right"), 3)
  want = jnp.einsum("mk,mkn->mn", lhs, rhs[group]) * (np.arange(20) < sizes.sum())[:, None]
  got = jax.jit(grouped_matmul.blocked_grouped_matmul, static_argnums=3)(
      lhs, rhs, jnp.asarray(sizes), block_rows)
  assert_trees_close(got, want, what="blocked gmm")
