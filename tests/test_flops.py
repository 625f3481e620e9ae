"""`launch.planning.flops`: matmul FLOPs of a traced program, loops at their trip counts."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import moe_hk
from launch.planning import flops
from moe_hk import megablox


def _spec(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_one_matmul_and_a_scan_of_them():
  x, w = _spec(8, 16), _spec(16, 32)
  assert flops.matmul_flops(jnp.dot, x, w) == 2 * 8 * 16 * 32
  stacked = _spec(5, 8, 16)
  scanned = lambda xs, w: jax.lax.scan(lambda c, x: (c, x @ w), None, xs)[1]
  assert flops.matmul_flops(scanned, stacked, w) == 5 * 2 * 8 * 16 * 32


def test_grad_of_a_rematerialised_matmul_counts_the_recompute():
  """Forward and the two backward matmuls (dx, dw); rematerialised, the forward again."""
  x, w = _spec(8, 16), _spec(16, 32)
  layer = lambda x, w: jnp.tanh(x @ w)  # its backward needs the forward's output
  one = 2 * 8 * 16 * 32
  for fn, matmuls in ((layer, 3), (jax.checkpoint(layer), 4)):
    grad = jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w)), argnums=(0, 1))
    assert flops.matmul_flops(grad, x, w) == matmuls * one


def test_shard_map_body_counts_once_per_device_and_cond_its_first_branch():
  mesh = moe_hk.make_mesh(data=8)
  local = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("data"), P()),
                        out_specs=P("data"))
  x, w = _spec(64, 16), _spec(16, 32)
  assert flops.matmul_flops(local, x, w) == 2 * 64 * 16 * 32  # 8 devices x 8 rows each
  # Branch 0 (false) is one matmul, the other three.
  branchy = lambda p, x, w: jax.lax.cond(p, lambda: (x @ w) @ (w.T @ w), lambda: x @ w)
  assert flops.matmul_flops(branchy, jax.ShapeDtypeStruct((), bool), x, w) == 2 * 64 * 16 * 32


def test_ragged_dot_counts_each_row_against_one_group():
  x, w = _spec(64, 16), _spec(4, 16, 32)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  assert flops.matmul_flops(jax.lax.ragged_dot, x, w, sizes) == 2 * 64 * 16 * 32
  # Its input gradient ([M, N] x [G, K, N]) and weight gradient ([M, K] x [M, N] -> [G, K, N]).
  grad = jax.grad(lambda x, w, s: jnp.sum(jax.lax.ragged_dot(x, w, s)), argnums=(0, 1))
  assert flops.matmul_flops(grad, x, w, sizes) == 3 * 2 * 64 * 16 * 32


def test_megablox_kernels_count_their_cost_estimate():
  """The Pallas grouped matmuls state 2 x rows x K x N: the SwiGLU's three in the forward, and
  under grad three input-gradient and three weight-gradient kernels more."""
  x, wi, wo = _spec(64, 16), _spec(4, 16, 32), _spec(4, 32, 16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  mlp = lambda x, wi_0, wi_1, wo, sizes: megablox.expert_mlp(x, wi_0, wi_1, wo, sizes, True)
  one = 2 * 64 * 16 * 32
  assert flops.matmul_flops(mlp, x, wi, wi, wo, sizes) == 3 * one
  grad = jax.grad(lambda *a: jnp.sum(mlp(*a)), argnums=(0, 1, 2, 3))
  assert flops.matmul_flops(grad, x, wi, wi, wo, sizes) == 9 * one
