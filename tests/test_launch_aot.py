"""`launch.aot`: the launcher's train step compiled for TPU topologies and CPU meshes."""
import pytest

import moe_hk
from launch import aot
from launch.steps import abstract_inputs, make_steps
from launch.configs import tiny
from tests.helpers import require_libtpu, user_precision


@pytest.mark.parametrize("topology,devices", [("v5p-16", 8), ("v5p:2x2x2", 8), ("cpu:8", 8)])
def test_topology_devices(topology, devices):
  found = aot.topology_devices(topology)
  assert len(found) == devices
  assert found[0].platform == ("cpu" if topology.startswith("cpu") else "tpu")


@pytest.mark.parametrize("topology,message", [
    ("v5p-6", r"v5p-N needs N in \[8, 16, 32"),
    ("tpu-big", "must be 'v5p-N', 'v5p:AxBxC' or 'cpu:N'"),
    ("cpu:64", "only 8 CPU devices"),
])
def test_bad_topology_names_the_valid_forms(topology, message):
  with pytest.raises(ValueError, match=message):
    aot.topology_devices(topology)


@pytest.mark.slow
def test_train_step_compiles_for_v5p_with_its_memory():
  """The tiny model's full train step (the scan fallback) compiles for a v5p slice through
  `launch.aot`, with the compiler's memory figures. (The scan's memory below the unrolled
  chunk loop's, on a v5p topology and a CPU mesh: tests/test_fallback_memory.py.)"""
  require_libtpu()
  with user_precision():
    row = aot.compile_variant(tiny.get_config(), aot.topology_devices("v5p-16"),
                              "fallback_scan")
  assert row["compiled"], row
  assert row["argument_bytes"] > 0 and row["temp_bytes"] > 0, row
  assert row["alias_bytes"] > 0, row  # the state is donated: the new one reuses its buffers


@pytest.mark.slow
def test_train_step_with_splash_attention_compiles_for_v5p():
  """The launcher's step (tiny model at a sequence splash tiles, 128) with
  `attention_impl='splash'` compiles for a v5p slice: the forward and backward kernels are
  Mosaic custom calls in the compiled program. On a CPU mesh 'splash' is refused."""
  require_libtpu()
  config = tiny.get_config()
  config.attention_impl, config.data.seq_len = "splash", 128
  devices = aot.topology_devices("v5p-16")
  mesh = moe_hk.make_mesh(**config.mesh, devices=devices)
  steps = make_steps(config, mesh)
  with user_precision():
    hlo = steps.train.lower(*abstract_inputs(config, steps)).compile().as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 3  # forward, dq, dkv
  with pytest.raises(ValueError, match=r"config.attention_impl='splash' runs only on tpu"):
    make_steps(config, moe_hk.make_mesh(**config.mesh))


def test_variant_configs_differ_only_in_the_moe_layers():
  base = tiny.get_config()
  worst = aot.variant_config(base, "worst_case")
  assert worst.moe.ragged_buffer_factor == -1 and worst.moe.moe_dropless_fallback == "none"
  adaptive = aot.variant_config(base, "fallback_adaptive")
  assert adaptive.moe.moe_dropless_fallback == "layer"
  assert adaptive.moe.dropless_fallback_chunking == "adaptive"
  assert adaptive.moe.ragged_buffer_factor == base.moe.ragged_buffer_factor
  assert base.moe.moe_dropless_fallback == "layer"  # the config passed in is left alone
  assert adaptive.emb_dim == base.emb_dim and adaptive.mesh == base.mesh
  step = aot.variant_config(base, "step")
  assert step.moe.moe_dropless_fallback == "step"
  assert step.moe.use_ring_of_experts == base.moe.use_ring_of_experts  # the config's path
