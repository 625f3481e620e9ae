"""Step mode: a step that overflows trains as the dropless model from its first overflowing MoE
layer on, in one pass, with its state donated, on both paths."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import moe_hk
from moe_hk.step_mode import any_overflow, overflowed
from tests import reference
from tests.moe_inputs import skewed_inputs
from tests.tree_close import assert_trees_close, relative_error

K = 2


def _two_layers(config, mesh):
  """(params pair, x, cot) -> (sum(y * cot), stats pair): two MoE layers with a residual, the
  second fed the step-mode flag of the first (in 'step' mode)."""
  step_mode = config.step_fallback
  layer = functools.partial(moe_hk.moe_forward, config=config, mesh=mesh)

  def loss(params, x, cot):
    flag = jnp.zeros((), bool) if step_mode else None
    h, first = layer(params[0], x, after_overflow=flag)
    y, second = layer(params[1], x + h,
                      after_overflow=overflowed(flag, first) if step_mode else None)
    return jnp.sum(y * cot), (first, second)
  return loss


def _dense_loss(params, x, cot):
  h = reference.reference_moe(tuple(params[0]), x, k=K)
  return jnp.sum(reference.reference_moe(tuple(params[1]), x + h, k=K) * cot), None


def _sgd(params, gradients):
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, gradients)


# XLA's ragged_dot: the quickest grouped matmul to compile (the backends are
# tests/test_grouped_matmul.py's subject).
GMM = "ragged_dot"


def _config(ring: bool, mode: str) -> moe_hk.MoEConfig:
  return moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=K, emb_dim=16, mlp_dim=32,
                          ragged_buffer_factor=2.0, use_ring_of_experts=ring,
                          moe_dropless_fallback=mode, gmm_impl=GMM)


def _mesh():
  return moe_hk.make_mesh(data=2, expert=4)


def _shardings(config, mesh):
  specs = moe_hk.param_specs(config, mesh)
  return tuple(jax.tree.map(lambda s: NamedSharding(mesh, s), specs) for _ in range(2))


@functools.lru_cache(maxsize=None)
def _step(ring: bool):
  """The step-mode train step `(params pair, x, cot) -> (new params, stats, dropless)`: one
  pass, the update in place on the donated params. Compiled once per path for every case."""
  config, mesh = _config(ring, "step"), _mesh()
  shardings = _shardings(config, mesh)

  def step(params, x, cot):
    (_, stats), gradients = jax.value_and_grad(_two_layers(config, mesh), has_aux=True)(
        params, x, cot)
    return _sgd(params, gradients), stats, any_overflow(stats)
  return jax.jit(step, in_shardings=(shardings, None, None),
                 out_shardings=(shardings, None, None), donate_argnums=(0,))


@functools.lru_cache(maxsize=None)
def _capped_grad(ring: bool):
  """Gradients of the capped model without a fallback ('none'): the control."""
  return jax.jit(jax.grad(_two_layers(_config(ring, "none"), _mesh()), has_aux=True))


_dense_grad = jax.jit(jax.grad(_dense_loss, has_aux=True))


# (skew of layer 0's router, of layer 1's): which layers overflow their capped buffers.
CASES = {"first": (4.0, 0.0), "second": (0.0, 4.0), "neither": (0.0, 0.0)}


@pytest.mark.parametrize("ring", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["all_to_all", "ring"])  # `make test-fast`: the ring's
@pytest.mark.parametrize("case", list(CASES))
def test_step_mode_is_dropless_from_the_first_overflow(ring, case):
  config = _config(ring, "step")
  skews = CASES[case]
  p0, x = skewed_inputs(config, 16, 16, skew=skews[0], seed=2)
  p1, _ = skewed_inputs(config, 16, 16, skew=skews[1], seed=2)  # same hot direction as x
  params = (p0, p1)
  cot = jax.random.normal(jax.random.key(0), x.shape)

  reference_params = _sgd(params, _dense_grad(params, x, cot)[0])
  capped_grads, capped_stats = _capped_grad(ring)(params, x, cot)
  capped_params = _sgd(params, capped_grads)
  donated = jax.device_put(params, _shardings(config, _mesh()))
  new_params, stats, dropless = _step(ring)(donated, x, cot)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))  # the state was donated

  drops = [int(s.would_drop_rows) for s in stats]
  assert [d > 0 for d in drops] == {"first": [True, False], "second": [False, True],
                                    "neither": [False, False]}[case], drops
  assert bool(dropless) == (case != "neither")
  # Dropless from the first overflowing layer on, whatever the later layers' own traffic.
  assert [int(s.fallback) for s in stats] == {"first": [1, 1], "second": [0, 1],
                                              "neither": [0, 0]}[case]
  assert all(int(s.dropped_rows) == 0 for s in stats)
  assert_trees_close(new_params, reference_params, what="step-mode update")
  if case != "neither":  # control: the capped model drops rows and its update diverges
    assert sum(int(s.dropped_rows) for s in capped_stats) > 0
    assert max(relative_error(capped_params[i].wo, reference_params[i].wo) for i in (0, 1)) > 1e-3


def test_after_overflow_needs_step_mode():
  mesh = moe_hk.make_mesh(data=2, expert=4)
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=K, emb_dim=16, mlp_dim=32,
                            ragged_buffer_factor=2.0, moe_dropless_fallback="layer")
  params, x = skewed_inputs(config, 16, 16, skew=0.0)
  with pytest.raises(ValueError, match=r"after_overflow is only for moe_dropless_fallback='step', "
                                       r"not 'layer'"):
    moe_hk.moe_forward(params, x, config=config, mesh=mesh, after_overflow=jnp.ones((), bool))


def test_any_overflow_needs_stats():
  with pytest.raises(ValueError, match="no MoEStats"):
    any_overflow({"loss": jnp.zeros(())})
