"""Step mode: an overflowing step is discarded and replayed on the chunked dropless path."""

import jax
import jax.numpy as jnp
import pytest

import moe_hk
from moe_hk.step_replay import StepWithReplay, any_overflow
from tests.moe_inputs import skewed_inputs
from tests.tree_close import assert_trees_close, relative_error


def _sgd_step(config, mesh, cot, **kw):
  """One SGD step on the layer's params; returns (new params, stats)."""
  def loss(params, x):
    y, stats = moe_hk.moe_forward(params, x, config=config, mesh=mesh, **kw)
    return jnp.sum(y * cot) + stats.lb_loss, stats
  @jax.jit
  def step(params, x):
    grads, stats = jax.grad(loss, has_aux=True)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), stats
  return step


@pytest.mark.parametrize("skew,overflows", [(4.0, True), (0.0, False)])
def test_step_mode_replays_only_overflowing_steps(skew, overflows):
  mesh = moe_hk.make_mesh(data=2, expert=4)
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=16, mlp_dim=32,
                            ragged_buffer_factor=2.0, use_ring_of_experts=True,
                            moe_dropless_fallback="step", gmm_block_rows=8)
  params, x = skewed_inputs(config, 16, 16, skew=skew, seed=2)
  cot = jax.random.normal(jax.random.key(0), x.shape)
  capped = _sgd_step(config, mesh, cot)
  stepper = StepWithReplay(capped, _sgd_step(config.for_step_replay(), mesh, cot))

  (new_params, stats), replayed = stepper(params, x)
  assert replayed == overflows and stepper.replays == int(overflows)
  dropless_params, _ = _sgd_step(config, mesh, cot, force_dropless=True)(params, x)
  capped_params, capped_stats = capped(params, x)
  assert bool(any_overflow(capped_stats)) == overflows
  if overflows:
    assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
    assert int(capped_stats.dropped_rows) > 0
    assert relative_error(capped_params.wo, dropless_params.wo) > 1e-3  # control
    assert_trees_close(new_params, dropless_params, what="replayed update")
  else:
    assert_trees_close(new_params, capped_params, rtol=0, what="unreplayed update")
    assert int(stats.fallback) == 0


def test_any_overflow_needs_stats():
  with pytest.raises(ValueError, match="no MoEStats"):
    any_overflow({"loss": jnp.zeros(())})
