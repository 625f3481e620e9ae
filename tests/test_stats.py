"""The layer's telemetry fields against numpy computed from the reference routing: which
receiving expert shards overflowed and by how much, and the router's entropy."""
import functools

import jax
import numpy as np
import pytest

import moe_hk
from moe_hk import buffer_size
from tests import reference
from tests.moe_inputs import skewed_inputs

# Fixed chunking and XLA's ragged_dot: the telemetry, not the chunking or the grouped matmul, is
# the subject (one compiled fallback branch, the quickest backend to compile).
BASE = dict(num_experts=8, num_experts_per_tok=2, emb_dim=16, mlp_dim=32, gmm_impl="ragged_dot",
            dropless_fallback_chunking="fixed")


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("mesh_shape,factor,fallback", [
    (dict(data=2, expert=4), 1.25, "none"),
    (dict(data=1, expert=8), 1.5, "layer"),
])
def test_receiver_overflow_rows_and_router_entropy(mesh_shape, factor, fallback, ring):
  config = moe_hk.MoEConfig(**BASE, ragged_buffer_factor=factor, moe_dropless_fallback=fallback,
                            use_ring_of_experts=ring)
  mesh = moe_hk.make_mesh(**mesh_shape)
  batch, seq = 16, 8
  # Rows of two batch shards only are skewed: the expert groups' overflows differ.
  params, x = skewed_inputs(config, batch, seq, skew=4.0, seed=3, hot=[5, 6],
                            hot_rows=slice(0, 4))
  _, stats = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(params, x)

  shards, devices = mesh.shape["expert"], mesh.size
  ids, _, logits = reference.reference_routing(params.router_w, x, 2, "softmax")
  received = reference.traffic(ids, num_devices=devices, shards=shards,
                               num_experts=8).sum(axis=1)                  # [groups, P]
  rows = buffer_size.buffer_rows(shards, batch // devices * seq, 2, 8 // shards, factor)
  expected = np.maximum(received - rows, 0).sum(axis=0)                      # [P]
  np.testing.assert_array_equal(stats.receiver_overflow_rows, expected)
  assert expected.sum() > 0 and (expected == 0).any()  # some receivers overflow, not all
  assert int(stats.receiver_overflow_rows.sum()) == int(stats.would_drop_rows)

  probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
  entropy = -np.sum(probs * np.log(probs), axis=-1).mean()
  np.testing.assert_allclose(stats.router_entropy, entropy, rtol=1e-5)


@pytest.mark.parametrize("record", [True, False])
def test_routed_rows_per_device_in_mesh_order(record):
  """With `record_traffic` the stats hold every device's rows per expert, devices in mesh
  order (expert axis fastest), so consecutive groups of P devices are the expert groups."""
  config = moe_hk.MoEConfig(**BASE, ragged_buffer_factor=1.25, moe_dropless_fallback="none",
                            record_traffic=record)
  mesh = moe_hk.make_mesh(data=2, fsdp=1, expert=4)
  params, x = skewed_inputs(config, 16, 8, skew=4.0, seed=5, hot=[1], hot_rows=slice(0, 2))
  _, stats = jax.jit(functools.partial(moe_hk.moe_forward, config=config, mesh=mesh))(params, x)
  if not record:
    assert stats.routed_rows_per_device.shape == (0, 8)
    return
  ids, _, _ = reference.reference_routing(params.router_w, x, 2, "softmax")
  per_device = np.asarray(ids).reshape(8, -1)  # the batch is split over devices in mesh order
  expected = np.stack([np.bincount(d, minlength=8) for d in per_device])
  np.testing.assert_array_equal(stats.routed_rows_per_device, expected)
  np.testing.assert_array_equal(stats.routed_rows_per_device.sum(axis=0), stats.tokens_per_expert)
