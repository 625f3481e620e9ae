"""`launch.compiling.flops`: matmul FLOPs of a traced program, loops at their trip counts; the
model FLOPs and peak behind the MFU (`launch.run.throughput`)."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import moe_hk
from launch.compiling import flops
from launch.configs import tiny
from launch.model.train_step import make_steps
from launch.run import throughput
from launch.setup import settings as settings_lib
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
  """Forward and the two backward matmuls (dx, dw); rematerialised, the forward again. Under
  `grad` alone the rematerialised forward's output is dead (the loss is not returned): only
  the recompute and the backward run."""
  x, w = _spec(8, 16), _spec(16, 32)
  layer = lambda x, w: jnp.tanh(x @ w)  # its backward needs the forward's output
  one = 2 * 8 * 16 * 32
  for fn, matmuls in ((layer, 3), (jax.checkpoint(layer), 4)):
    step = jax.value_and_grad(lambda x, w, fn=fn: jnp.sum(fn(x, w)), argnums=(0, 1))
    assert flops.matmul_flops(step, x, w) == matmuls * one
  grad = jax.grad(lambda x, w: jnp.sum(jax.checkpoint(layer)(x, w)), argnums=(0, 1))
  assert flops.matmul_flops(grad, x, w) == 3 * one


def test_a_matmul_nothing_uses_is_not_counted():
  """Dead code, which XLA removes: a VJP's unused primal output (the fallback's backward
  recomputes its branch with `jax.vjp`), or a product computed and dropped."""
  x, w = _spec(8, 16), _spec(16, 32)
  one = 2 * 8 * 16 * 32
  assert flops.matmul_flops(lambda x, w: (x @ w, x)[1], x, w) == 0
  # x @ w's primal (unused) and its two cotangent matmuls of which only dx is returned.
  dx = lambda x, w: jax.vjp(lambda x: x @ w, x)[1](jnp.ones((8, 32)))[0]
  assert flops.matmul_flops(dx, x, w) == one
  # Control: returned, the primal counts.
  both = lambda x, w: (lambda out, pull: (out, pull(jnp.ones((8, 32)))))(*jax.vjp(
      lambda x: x @ w, x))
  assert flops.matmul_flops(both, x, w) == 2 * one


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
  step = jax.value_and_grad(lambda x, w, s: jnp.sum(jax.lax.ragged_dot(x, w, s)),
                            argnums=(0, 1))
  assert flops.matmul_flops(step, x, w, sizes) == 3 * 2 * 64 * 16 * 32


def test_megablox_kernels_count_their_cost_estimate():
  """The Pallas grouped matmuls state 2 x rows x K x N: the SwiGLU's three in the forward, and
  under value_and_grad three input-gradient and three weight-gradient kernels more."""
  x, wi, wo = _spec(64, 16), _spec(4, 16, 32), _spec(4, 32, 16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  mlp = lambda x, wi_0, wi_1, wo, sizes: megablox.expert_mlp(x, wi_0, wi_1, wo, sizes, True)
  one = 2 * 64 * 16 * 32
  assert flops.matmul_flops(mlp, x, wi, wi, wo, sizes) == 3 * one
  step = jax.value_and_grad(lambda *a: jnp.sum(mlp(*a)), argnums=(0, 1, 2, 3))
  assert flops.matmul_flops(step, x, wi, wi, wo, sizes) == 9 * one


def test_the_model_flops_behind_mfu_are_the_hand_count_of_the_tiny_model():
  """`throughput.model_flops` of the tiny config, counted by hand: 6 x active parameters x
  tokens, plus attention's score and value matmuls (causal: half the S x S pairs)."""
  c = tiny.get_config()
  settings = settings_lib.build(c, jax.device_count())
  mesh = moe_hk.make_mesh(**settings.mesh)
  params = jax.eval_shape(make_steps(settings, mesh).init, jax.random.key(0)).params
  d, e, k, v = c.emb_dim, c.moe.num_experts, c.moe.num_experts_per_tok, c.vocab_size
  attention = d * c.num_heads * c.head_dim * 2 + d * c.num_kv_heads * c.head_dim * 2  # q o, k v
  norms = 2 * d                                                       # attention and MLP norms
  dense_block = attention + norms + 3 * d * c.mlp_dim
  routed = 3 * e * d * c.moe.mlp_dim
  moe_block = attention + norms + d * e + routed                     # router and the experts
  total = v * d + dense_block + moe_block + d                         # embedding, final norm
  assert (c.num_layers, c.moe_every, c.shared_expert) == (2, 2, False)  # one dense+MoE group
  active = total - routed + routed * k / e
  tokens = c.data.batch_size * c.data.seq_len
  causal_attention = 12 * c.num_layers * c.num_heads * c.head_dim * c.data.seq_len / 2 * tokens
  assert (total, active, tokens) == (70048, 33184, 256)
  hand = 6 * active * tokens + causal_attention
  assert throughput.model_flops(params, c, settings.layer) == hand == 54_116_352
  # MFU: that many FLOPs a step, over the time and the devices, against the peak.
  per_device, mfu = throughput.mfu(hand, 0.5, 8, peak=989.0)
  assert per_device == pytest.approx(hand / 0.5 / 8 / 1e12) and mfu == per_device / 989.0
  assert throughput.mfu(hand, 0.5, 8, peak=None)[1] is None


@pytest.mark.parametrize("kind,platform,override,peak", [
    ("TPU v5p", "tpu", 0.0, 459.0), ("TPU v5 lite", "tpu", 0.0, 197.0),
    ("TPU v4", "tpu", 0.0, 275.0), ("TPU v6 lite", "tpu", 0.0, 918.0),
    ("NVIDIA H200", "gpu", 0.0, 989.0), ("NVIDIA H100 80GB HBM3", "gpu", 0.0, 989.0),
    ("cpu", "cpu", 0.0, None), ("NVIDIA A100-SXM4-40GB", "gpu", 0.0, None),
    ("cpu", "cpu", 123.0, 123.0)])
def test_peak_tflops_by_device_kind(kind, platform, override, peak):
  assert throughput.peak_tflops(kind, platform, override) == peak
