"""Callback-aggregated layer metrics equal what the step returns (unrolled and stacked layers)."""
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import metrics
import moe_hk
from moe_hk import events as events_lib
from tests.helpers import BASE, LAYER_CONFIGS, MESH_SHAPE, unrolled_model
from tests.moe_inputs import skewed_inputs


@pytest.fixture
def events():
  received = []
  events_lib.add_sink(received.append)
  yield received
  events_lib.remove_sink(received.append)


def _aggregate(events, step):
  jax.effects_barrier()
  aggregator = metrics.Aggregator()
  for e in events:
    aggregator(e)
  return aggregator.finish_step(step)


def _assert_record_matches(record, stats):
  assert record.fallback == bool(stats.fallback)
  np.testing.assert_allclose(record.required_factor, stats.required_factor, rtol=1e-6)
  assert record.would_drop_rows == int(stats.would_drop_rows)
  assert record.dropped_rows == int(stats.dropped_rows)
  np.testing.assert_array_equal(record.tokens_per_expert, stats.tokens_per_expert)
  assert record.nonfinite_tokens == int(stats.nonfinite_tokens) == 0
  assert record.processes == frozenset({0})  # one process: its first device reports


def test_unrolled_layers_under_grad_with_remat(events):
  mesh = moe_hk.make_mesh(**MESH_SHAPE)
  _, x = skewed_inputs(moe_hk.MoEConfig(**BASE), 16, 16, skew=3.0, seed=1)
  model = unrolled_model(mesh)
  params, state = jax.jit(model.init)(jax.random.key(0), x, 0)
  jax.effects_barrier()
  assert not events, "init must not emit layer events"

  def loss(p, s, xx, step):
    y, new_state = model.apply(p, s, None, xx, step)
    return jnp.mean(y ** 2), new_state
  _, state = jax.jit(jax.grad(loss, has_aux=True))(params, state, x, 5)
  step_metrics = _aggregate(events, 5)
  # One reporting device, and a second pass for the rematerialised forward.
  assert len(events) == 2 * len(LAYER_CONFIGS)
  assert sorted(step_metrics.layers) == [0, 1, 2]
  for i in range(len(LAYER_CONFIGS)):
    _assert_record_matches(step_metrics.layers[i], state[f"moe_{i}"]["stats"])
  assert [r.fallback for r in step_metrics.layers.values()] == [True, False, False]
  assert step_metrics.layers[0].would_drop_rows > 0 and step_metrics.layers[1].dropped_rows > 0
  assert step_metrics.fallback_layers == 1
  assert {e.name for e in events if e.layer == 0} == {events_lib.FALLBACK_EVENT}
  assert {e.name for e in events if e.layer == 1} == {events_lib.STEP_STATS_EVENT}


# The stacked layers' routing (x shared): layers 0 and 2 send every token to the two experts of
# one expert shard (required factor about 4), layer 1 is not skewed (about 1.7). A buffer of
# twice the balanced rows then overflows in layers 0 and 2 only.
STACK_FACTOR = 2.0
STACK_ROUTING = [dict(skew=8.0, hot=[0, 1]), dict(skew=0.0), dict(skew=8.0, hot=[2, 3])]
STACK_OVERFLOWS = [True, False, True]


def _stacked_params(config):
  """The three layers' `skewed_inputs` parameters in `hk.layer_stack`'s layout (apply fails on
  a missing name), and x."""
  layers = [skewed_inputs(config, 16, 16, seed=2, **routing) for routing in STACK_ROUTING]
  p = moe_hk.MoEParams(*(jnp.stack(leaves) for leaves in zip(*(p for p, _ in layers))))
  scope = "__layer_stack_with_per_layer/moe"
  params = {scope: dict(wi_0=p.wi_0, wi_1=p.wi_1, wo=p.wo), f"{scope}/router": dict(w=p.router_w)}
  return params, layers[0][1]


@pytest.mark.slow
@pytest.mark.parametrize("mode,remat", [("layer", True), ("layer", False), ("none", True)])
def test_stacked_layers_return_stats_as_outputs(events, mode, remat):
  """hk.layer_stack under grad, layers 0 and 2 overflowing. (Capped-only layers in a stack
  without remat are left out: there JAX moves the layer's forward into the backward scan and
  drops its callbacks, jax-ml/jax#28738; the README says so.)"""
  mesh = moe_hk.make_mesh(**MESH_SHAPE)
  config = moe_hk.MoEConfig(**BASE, ragged_buffer_factor=STACK_FACTOR,
                            moe_dropless_fallback=mode)
  num_layers = len(STACK_ROUTING)

  def forward(x, step):
    def block(x_, layer_index):
      y, stats = moe_hk.MoELayer(config, mesh, name="moe")(
          x_, step=step, layer_index=layer_index, return_stats=True)
      return x_ + y, stats
    stack = hk.layer_stack(num_layers, with_per_layer_inputs=True)(
        hk.remat(block) if remat else block)
    return stack(x, jnp.arange(num_layers))
  model = hk.transform(forward)
  params, x = _stacked_params(config)

  def loss(p, xx, step):
    y, stats = model.apply(p, None, xx, step)
    return jnp.mean(y ** 2), stats
  _, stats = jax.jit(jax.grad(loss, has_aux=True))(params, x, 9)
  fell_back = [o and mode == "layer" for o in STACK_OVERFLOWS]
  # The returned stats: which layers overflowed, fell back, dropped.
  assert (np.asarray(stats.would_drop_rows) > 0).tolist() == STACK_OVERFLOWS
  assert (np.asarray(stats.required_factor) > STACK_FACTOR).tolist() == STACK_OVERFLOWS
  assert np.asarray(stats.fallback).tolist() == [int(f) for f in fell_back]
  assert (np.asarray(stats.dropped_rows) > 0).tolist() == [
      o and not f for o, f in zip(STACK_OVERFLOWS, fell_back)]
  # The callback route: one record per layer, equal to the returned stats.
  step_metrics = _aggregate(events, 9)
  assert sorted(step_metrics.layers) == list(range(num_layers))
  for i in range(num_layers):
    _assert_record_matches(step_metrics.layers[i], jax.tree.map(lambda a: a[i], stats))
  assert [r.fallback for r in step_metrics.layers.values()] == fell_back
  assert step_metrics.fallback_layers == sum(fell_back)
  for i, f in enumerate(fell_back):
    name = events_lib.FALLBACK_EVENT if f else events_lib.STEP_STATS_EVENT
    assert {e.name for e in events if e.layer == i} == {name}, i
  if mode == "none":
    assert step_metrics.dropped_rows_fraction > 0


def test_no_events_without_step_or_with_logging_off(events):
  mesh = moe_hk.make_mesh(**MESH_SHAPE)
  config = moe_hk.MoEConfig(**BASE, ragged_buffer_factor=0.5, moe_dropless_fallback="none")
  params, x = skewed_inputs(config, 16, 16, skew=3.0, seed=4)
  _, stats = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(params, x)
  quiet = config.replace(stream_step_stats=False)
  jax.jit(functools.partial(moe_hk.moe_forward, config=quiet, mesh=mesh, step=1))(params, x)
  jax.effects_barrier()
  assert not events
  jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh, step=1))(params, x)
  jax.effects_barrier()
  assert len(events) == 1 and events[0].step == 1 and events[0].layer == 0
  assert int(stats.dropped_rows) == int(events[0].stats.dropped_rows) > 0


def test_stacked_fallback_events_one_callback_for_the_layers_that_fell_back(events):
  """`emit_stacked_fallback_events` (the launcher's model) under jit: nothing when no layer
  fell back, else one `FALLBACK_EVENT` per layer that did, holding that layer's row of every
  field (ints and floats, scalars and vectors)."""
  layers, experts = 3, 4
  shapes = dict(tokens_per_expert=(experts,), receiver_overflow_rows=(2,),
                routed_rows_per_device=(8, experts))
  floats = {"required_factor", "lb_loss", "z_loss", "router_entropy"}
  rng = np.random.default_rng(0)
  filled = moe_hk.MoEStats(**{
      name: (jnp.asarray(rng.normal(size=(layers, *shapes.get(name, ()))), jnp.float32)
             if name in floats else
             jnp.asarray(rng.integers(1, 100, (layers, *shapes.get(name, ()))), jnp.int32))
      for name in moe_hk.MoEStats._fields})
  emit = jax.jit(lambda s, step: events_lib.emit_stacked_fallback_events(s, step=step,
                                                                         process=0))
  emit(filled._replace(fallback=jnp.zeros(layers, jnp.int32)), jnp.int32(3))
  jax.effects_barrier()
  assert not events
  two_fell_back = filled._replace(fallback=jnp.asarray([1, 0, 1], jnp.int32))
  emit(two_fell_back, jnp.int32(4))
  jax.effects_barrier()
  assert [(e.name, e.step, e.layer, e.process) for e in events] == [
      (events_lib.FALLBACK_EVENT, 4, 0, 0), (events_lib.FALLBACK_EVENT, 4, 2, 0)]
  for e in events:
    for name, value in zip(moe_hk.MoEStats._fields, e.stats):
      np.testing.assert_array_equal(value, np.asarray(getattr(two_fell_back, name))[e.layer],
                                    err_msg=name)
