"""Step mode: one compiled step that replays itself on the chunked dropless path when a layer
overflowed, with its state donated, on both paths."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import moe_hk
from moe_hk.step_replay import any_overflow, grads_with_replay
from tests.moe_inputs import skewed_inputs
from tests.tree_close import assert_trees_close, relative_error


def _loss(config, mesh, cot, **kw):
  """(params, x) -> (sum(y * cot) + lb_loss, MoEStats)."""
  def loss(params, x):
    y, stats = moe_hk.moe_forward(params, x, config=config, mesh=mesh, **kw)
    return jnp.sum(y * cot) + stats.lb_loss, stats
  return loss


def _sgd(params, gradients):
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, gradients)


@pytest.mark.parametrize("ring", [False, True], ids=["all_to_all", "ring"])
@pytest.mark.parametrize("skew,overflows", [(4.0, True), (0.0, False)])
def test_step_mode_replays_only_overflowing_steps(ring, skew, overflows):
  mesh = moe_hk.make_mesh(data=2, expert=4)
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=16, mlp_dim=32,
                            ragged_buffer_factor=2.0, use_ring_of_experts=ring,
                            moe_dropless_fallback="step", gmm_block_rows=8)
  params, x = skewed_inputs(config, 16, 16, skew=skew, seed=2)
  cot = jax.random.normal(jax.random.key(0), x.shape)
  capped = _loss(config, mesh, cot)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), moe_hk.param_specs(config, mesh))

  def step(params, x):  # the update applied once, outside the cond: in place on the donated params
    gradients, stats, replayed = grads_with_replay(
        capped, _loss(config.for_step_replay(), mesh, cot), params, x)
    return _sgd(params, gradients), stats, replayed
  step = jax.jit(step, in_shardings=(shardings, None), out_shardings=(shardings, None, None),
                 donate_argnums=(0,))
  grad = lambda loss: jax.jit(jax.grad(loss, has_aux=True))

  capped_grads, capped_stats = grad(capped)(params, x)
  capped_params = _sgd(params, capped_grads)
  dropless_params = _sgd(params, grad(_loss(config, mesh, cot, force_dropless=True))(params, x)[0])
  donated = jax.device_put(params, shardings)
  new_params, stats, replayed = step(donated, x)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))  # the state was donated
  assert bool(replayed) == overflows == bool(any_overflow(capped_stats))
  if overflows:
    assert int(stats.fallback) == 1 and int(stats.dropped_rows) == 0
    assert int(capped_stats.dropped_rows) > 0
    assert relative_error(capped_params.wo, dropless_params.wo) > 1e-3  # control
    assert_trees_close(new_params, dropless_params, what="replayed update")
  else:
    # The capped update, from another program than the separately jitted one (fusions differ).
    assert_trees_close(new_params, capped_params, what="unreplayed update")
    assert int(stats.fallback) == 0


def test_any_overflow_needs_stats():
  with pytest.raises(ValueError, match="no MoEStats"):
    any_overflow({"loss": jnp.zeros(())})
