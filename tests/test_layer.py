"""The capped and worst-case layer against the dense reference: outputs, gradients, stats."""
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from moe_hk import buffer_size
from tests import reference
from tests.moe_inputs import outputs_and_grads, reference_outputs_and_grads, skewed_inputs
from tests.tree_close import assert_trees_close

BATCH, SEQ, WIDTH, HIDDEN = 16, 8, 16, 32
NUM_DEVICES = 8

# (expert shards P, top-k K, experts per shard multiple, buffer factor, grouped matmul): a
# pairwise cover of P in {2, 4, 8} x K in {1, 2, 4} x E in {1, 2, 4} x P x factor in
# {-1, 0.5, 1, 2}, each value of each with both CPU backends (B: the default `blocked`,
# R: XLA's `ragged_dot`, the quicker to compile).
B, R = "blocked", "ragged_dot"
GRID = [
    (1, 2, 2, 0.5, R), (1, 1, 2, -1, B),  # one expert shard: the exchange is a local copy
    (2, 1, 1, -1, B), (2, 2, 2, 0.5, B), (2, 4, 4, 1.0, B), (2, 1, 4, 2.0, R),
    (4, 1, 1, 0.5, B), (4, 2, 2, 1.0, B), (4, 4, 1, 2.0, B), (4, 2, 4, -1, R),
    (8, 1, 1, 1.0, B), (8, 2, 1, 2.0, R), (8, 4, 2, 0.5, R), (8, 1, 2, -1, R), (8, 4, 1, 1.0, R),
]


def _setup(shards, k, mult, factor, **overrides):
  """Mesh, config, params and x; no fallback: the capped layer's drops are the subject."""
  mesh = moe_hk.make_mesh(data=NUM_DEVICES // shards, expert=shards)
  config = moe_hk.MoEConfig(num_experts=shards * mult, num_experts_per_tok=k, emb_dim=WIDTH,
                            mlp_dim=HIDDEN, ragged_buffer_factor=factor, gmm_block_rows=8,
                            load_balance_loss_weight=0.1, router_z_loss_weight=1e-3,
                            moe_dropless_fallback="none", **overrides)
  params, x = skewed_inputs(config, BATCH, SEQ, skew=4.0, seed=shards * 100 + k * 10 + mult)
  return mesh, config, params, x


RING_GRID = [(2, 2, 2, 0.5, B), (4, 1, 1, 1.0, R), (8, 2, 1, 2.0, B), (8, 4, 2, -1, R),
             (4, 2, 4, 0.5, R)]


def _assert_layer_matches_reference(shards, k, mult, factor, **overrides):
  """Checks the layer's outputs, gradients (x and every parameter) and stats against the dense
  reference with the §3 (or ring) drop order; returns the rows the reference drops and the
  layer's gradients."""
  mesh, config, params, x = _setup(shards, k, mult, factor, **overrides)
  num_experts = config.num_experts
  tokens = BATCH // NUM_DEVICES * SEQ
  rows = buffer_size.buffer_rows(shards, tokens, k, num_experts // shards, factor)
  worst = buffer_size.worst_case_rows(shards, tokens, k, num_experts // shards)
  ids, _, logits = reference.reference_routing(params.router_w, x, k, config.router_score)
  mask_fn = reference.ring_keep_mask if config.use_ring_of_experts else reference.keep_mask
  keep = mask_fn(ids, num_devices=NUM_DEVICES, shards=shards, num_experts=num_experts, rows=rows)
  cot = jax.random.normal(jax.random.key(7), x.shape)

  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)
  y, stats, grads = jax.jit(functools.partial(outputs_and_grads, layer))(params, x, cot)
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x, cot, jnp.asarray(keep), k=k,
                                                    score=config.router_score,
                                                    weights_on=config.router_weights_on)
  assert_trees_close(y, y_ref, what="y")
  assert_trees_close(grads, grads_ref, what="grad")

  dropped = int((~keep).sum())
  if rows < worst:
    assert dropped > 0, "the skewed router should overflow a capped buffer"
  else:
    assert dropped == 0
  assert int(stats.dropped_rows) == dropped
  assert int(stats.would_drop_rows) == dropped
  assert int(stats.fallback) == 0
  colsum = reference.traffic(ids, num_devices=NUM_DEVICES, shards=shards,
                             num_experts=num_experts).sum(axis=1)
  np.testing.assert_allclose(stats.required_factor, colsum.max() / (tokens * k), rtol=1e-6)
  np.testing.assert_array_equal(stats.tokens_per_expert,
                                np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts))
  lb = reference.reference_lb_loss(logits, ids, NUM_DEVICES, num_experts) * 0.1
  np.testing.assert_allclose(stats.lb_loss, lb, rtol=1e-5)
  z = np.mean(np.square(jax.nn.logsumexp(np.asarray(logits, np.float64), axis=-1))) * 1e-3
  np.testing.assert_allclose(stats.z_loss, z, rtol=1e-5)
  return dropped, grads


# `make test-fast` runs one capped case per path with each backend and the worst case; the rest
# of the grid is marked slow.
_FAST = {(False, 2, 2, 2, 0.5, B), (False, 4, 2, 4, -1, R), (True, 4, 1, 1, 1.0, R),
         (False, 1, 2, 2, 0.5, R)}


@pytest.mark.parametrize("ring,shards,k,mult,factor,gmm", [
    pytest.param(*case, marks=() if case in _FAST else pytest.mark.slow)
    for case in [(False, *g) for g in GRID] + [(True, *g) for g in RING_GRID]])
def test_layer_matches_dense_reference(ring, shards, k, mult, factor, gmm):
  _assert_layer_matches_reference(shards, k, mult, factor, use_ring_of_experts=ring,
                                  gmm_impl=gmm)


# (ring, P, K, experts per shard multiple, factor): Llama4's top-1, capped (drops rows) on both
# paths and the worst case.
SIGMOID_CASES = [(False, 4, 1, 2, 0.5), (False, 8, 1, 1, -1), (True, 4, 1, 2, 0.5)]


@pytest.mark.parametrize("ring,shards,k,mult,factor", SIGMOID_CASES)
def test_sigmoid_router_matches_dense_reference(ring, shards, k, mult, factor):
  """float32, outputs and all gradients: with the sigmoid score the router gets a gradient
  from y even at top-1 (softmax over one logit is constant)."""
  dropped, (param_grads, _) = _assert_layer_matches_reference(
      shards, k, mult, factor, router_score="sigmoid", use_ring_of_experts=ring)
  assert (dropped > 0) == (factor != -1)
  assert np.linalg.norm(param_grads.router_w) > 0


# (ring, P, K, experts per shard multiple, factor): the router's sigmoid scores on each routed
# expert's input (Llama 4), capped so that rows drop, on both paths; top-2 shows the K inputs
# scaled apart.
INPUT_WEIGHT_CASES = [(False, 4, 1, 2, 0.5), (False, 2, 2, 2, 0.5), (True, 4, 2, 1, 0.5)]


@pytest.mark.parametrize("ring,shards,k,mult,factor", INPUT_WEIGHT_CASES)
def test_router_weights_on_the_input_match_dense_reference(ring, shards, k, mult, factor):
  """`router_weights_on='input'`: outputs and every gradient equal the reference that runs
  each chosen expert on the token scaled by its weight; the reference that weighs the outputs
  instead is off by over 1% (SwiGLU is not linear; the skewed router's chosen scores sit near
  1), a thousand times the comparison's tolerance."""
  dropped, (param_grads, _) = _assert_layer_matches_reference(
      shards, k, mult, factor, router_score="sigmoid", router_weights_on="input",
      use_ring_of_experts=ring, gmm_impl=R)
  assert dropped > 0 and np.linalg.norm(param_grads.router_w) > 0
  _, config, params, x = _setup(shards, k, mult, factor, router_score="sigmoid")
  on_input, on_output = (reference.reference_moe(tuple(params), x, k=k, score="sigmoid",
                                                 weights_on=where)
                         for where in ("input", "output"))
  assert np.linalg.norm(on_input - on_output) > 1e-2 * np.linalg.norm(on_output)


def test_ragged_dot_backend_matches_dense_reference():
  """gmm_impl='ragged_dot' on the CPU mesh (XLA:CPU runs it as a masked dense product), with a
  capped buffer that drops rows."""
  mesh, config, params, x = _setup(4, 2, 2, 0.5, gmm_impl="ragged_dot")
  jaxpr = lambda c: str(jax.make_jaxpr(functools.partial(moe_hk.moe_forward, config=c,
                                                         mesh=mesh))(params, x))
  assert "ragged_dot" in jaxpr(config)
  assert "ragged_dot" not in jaxpr(config.replace(gmm_impl="blocked"))  # the check can fail
  dropped, _ = _assert_layer_matches_reference(4, 2, 2, 0.5, gmm_impl="ragged_dot")
  assert dropped > 0


@pytest.mark.parametrize("ring", [False, True], ids=["all_to_all", "ring"])
def test_megablox_backend_matches_dense_reference(ring):
  """gmm_impl='megablox' (jax's Pallas TPU kernels, interpreted on the CPU mesh; the layer's
  shard_map runs without its vma check for them) with a capped buffer that drops rows:
  outputs and every gradient, the router's included."""
  mesh, config, params, x = _setup(4, 2, 2, 0.5, gmm_impl="megablox", use_ring_of_experts=ring)
  jaxpr = str(jax.make_jaxpr(functools.partial(moe_hk.moe_forward, config=config,
                                               mesh=mesh))(params, x))
  assert "pallas_call" in jaxpr
  dropped, _ = _assert_layer_matches_reference(4, 2, 2, 0.5, gmm_impl="megablox",
                                               use_ring_of_experts=ring)
  assert dropped > 0


def test_megablox_is_refused_on_a_gpu_mesh():
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=WIDTH,
                            mlp_dim=HIDDEN, gmm_impl="megablox")
  mesh = moe_hk.make_mesh(data=4, expert=2)
  gpu = type("GpuDevice", (), {"platform": "gpu"})()
  fake = type("Mesh", (), {"devices": np.array([gpu])})()
  with pytest.raises(ValueError, match=r"gmm_impl='megablox' .*TPU .*not on a gpu mesh"):
    moe_hk.mesh_forward.resolve_backends(config, fake)
  assert moe_hk.mesh_forward.resolve_backends(config, mesh).interpret  # CPU: the interpreter


def test_capped_differs_from_dropless_when_rows_drop():
  """Control: the drop really changes the output, so the equalities above are not vacuous."""
  mesh, config, params, x = _setup(4, 2, 2, 0.5)
  capped, stats = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(
      params, x)
  dropless, _ = jax.jit(functools.partial(
      moe_hk.moe_forward, config=config.replace(ragged_buffer_factor=-1), mesh=mesh))(params, x)
  assert int(stats.dropped_rows) > 0
  err = np.linalg.norm(capped - dropless) / np.linalg.norm(dropless)
  assert err > 1e-2, f"capped and dropless outputs agree ({err:.2g}) although rows were dropped"


def test_sigmoid_router_and_bfloat16_compute():
  mesh, config, params, x = _setup(4, 1, 2, -1, router_score="sigmoid", dtype="bfloat16")
  y, _ = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(params, x)
  y_ref = reference.reference_moe(tuple(params), x, k=1, score="sigmoid")
  assert y.dtype == jnp.float32
  assert_trees_close(y, y_ref, rtol=2e-2, what="bf16 y")  # bf16 matmuls: stated looser bound.


def test_plain_two_axis_mesh():
  """Any mesh with the expert axis works, e.g. Mesh(devices, ('data', 'expert'))."""
  devices = np.asarray(jax.devices()).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("data", "expert"))
  _, config, params, x = _setup(4, 2, 1, -1)
  y, _ = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(params, x)
  assert_trees_close(y, reference.reference_moe(tuple(params), x, k=2), what="y")


def test_fsdp_axis_shards_expert_embedding():
  mesh = moe_hk.make_mesh(data=1, fsdp=2, expert=4)
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=WIDTH,
                            mlp_dim=HIDDEN, ragged_buffer_factor=1.0, moe_dropless_fallback="none")
  params, x = skewed_inputs(config, BATCH, SEQ, skew=4.0, seed=3)
  specs = moe_hk.param_specs(config, mesh)
  assert specs.wi_0 == jax.sharding.PartitionSpec("expert", "fsdp", None)
  assert specs.wo == jax.sharding.PartitionSpec("expert", None, "fsdp")
  ids, _, _ = reference.reference_routing(params.router_w, x, 2, "softmax")
  keep = reference.keep_mask(ids, num_devices=8, shards=4, num_experts=8, rows=2 * 8 * 2)
  cot = jax.random.normal(jax.random.key(1), x.shape)
  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)
  y, _, grads = jax.jit(functools.partial(outputs_and_grads, layer))(params, x, cot)
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x, cot, jnp.asarray(keep), k=2)
  assert_trees_close(y, y_ref, what="y")
  assert_trees_close(grads, grads_ref, what="grad")


def test_haiku_module_params_state_and_sharding():
  mesh, config, _, x = _setup(4, 2, 2, 1.0)
  model = hk.transform_with_state(lambda x: moe_hk.MoELayer(config, mesh, name="moe")(x))
  params, state = jax.jit(model.init)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, params) == {
      "moe/router": {"w": (WIDTH, 8)},
      "moe": {"wi_0": (8, WIDTH, HIDDEN), "wi_1": (8, WIDTH, HIDDEN), "wo": (8, HIDDEN, WIDTH)}}
  assert params["moe"]["wi_0"].sharding.spec == jax.sharding.PartitionSpec("expert")
  y, state = jax.jit(model.apply)(params, state, None, x)
  p = moe_hk.MoEParams(params["moe/router"]["w"], params["moe"]["wi_0"], params["moe"]["wi_1"],
                       params["moe"]["wo"])
  # Both compiled, so the same program: bitwise equal.
  y_pure, stats = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(p, x)
  assert_trees_close(y, y_pure, rtol=0, what="module vs pure")
  assert_trees_close(state["moe"]["stats"], stats, rtol=0, what="stats")

  stacked = hk.transform(lambda x: moe_hk.MoELayer(config, mesh, name="moe")(x, return_stats=True))
  y2, stats2 = jax.jit(stacked.apply)(params, None, x)
  assert_trees_close((y2, stats2), (y_pure, stats), rtol=0, what="return_stats")


def test_router_z_loss_gradient_matches_reference():
  """The weighted z-loss is differentiable and reaches the router like the reference's."""
  mesh, config, params, x = _setup(4, 2, 2, 1.0)
  def z_of(router_w):
    p = params._replace(router_w=router_w)
    return moe_hk.moe_forward(p, x, config=config, mesh=mesh)[1].z_loss
  def z_ref(router_w):
    logits = jnp.einsum("bsd,de->bse", x, router_w)
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))) * 1e-3
  assert_trees_close(jax.jit(jax.grad(z_of))(params.router_w), jax.grad(z_ref)(params.router_w),
                     what="d z_loss / d router_w")
