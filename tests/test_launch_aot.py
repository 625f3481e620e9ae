"""`launch.aot`'s parts: the launcher's train step compiled for TPU topologies and CPU meshes
(`launch.compiling`)."""
import dataclasses

import pytest

import moe_hk
from launch.compiling import topology as topology_lib, variants
from launch.configs import tiny
from launch.training.steps import abstract_inputs, make_steps
from tests.helpers import require_libtpu, settings_of, user_precision


@pytest.mark.parametrize("topology,devices", [("v5p-16", 8), ("v5p:2x2x2", 8), ("cpu:8", 8)])
def test_topology_devices(topology, devices):
  found = topology_lib.topology_devices(topology)
  assert len(found) == devices
  assert found[0].platform == ("cpu" if topology.startswith("cpu") else "tpu")


@pytest.mark.parametrize("topology,message", [
    ("v5p-6", r"v5p-N needs N in \[8, 16, 32"),
    ("tpu-big", "must be 'v5p-N', 'v5p:AxBxC' or 'cpu:N'"),
    ("cpu:64", "only 8 CPU devices"),
])
def test_bad_topology_names_the_valid_forms(topology, message):
  with pytest.raises(ValueError, match=message):
    topology_lib.topology_devices(topology)


@pytest.mark.slow
def test_train_step_compiles_for_v5p_with_its_memory():
  """The tiny model's full train step (the scan fallback) compiles for a v5p slice through
  `launch.aot`, with the compiler's memory figures. (The scan's memory below the unrolled
  chunk loop's, on a v5p topology and a CPU mesh: tests/test_fallback_memory.py.)"""
  require_libtpu()
  with user_precision():
    row = variants.compile_variant(settings_of(tiny.get_config()),
                                   topology_lib.topology_devices("v5p-16"), "fallback_scan")
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
  devices = topology_lib.topology_devices("v5p-16")
  mesh = moe_hk.make_mesh(**config.mesh, devices=devices)
  settings = settings_of(config)
  steps = make_steps(settings, mesh)
  with user_precision():
    hlo = steps.train.lower(*abstract_inputs(config, steps)).compile().as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 3  # forward, dq, dkv
  with pytest.raises(ValueError, match=r"config.attention_impl='splash' runs only on tpu"):
    make_steps(settings, moe_hk.make_mesh(**config.mesh))


def test_variants_differ_only_in_the_moe_layers():
  base = settings_of(tiny.get_config()).layer
  worst = variants.variant_layer(base, "worst_case")
  assert (worst.ragged_buffer_factor, worst.moe_dropless_fallback) == (-1, "none")
  adaptive = variants.variant_layer(base, "fallback_adaptive")
  assert (adaptive.moe_dropless_fallback, adaptive.dropless_fallback_chunking) == (
      "layer", "adaptive")
  step = variants.variant_layer(base, "step")
  assert step.moe_dropless_fallback == "step"
  for variant in (adaptive, step):  # the rest is the config's: its factor, its path
    assert dataclasses.replace(variant, moe_dropless_fallback=base.moe_dropless_fallback,
                               dropless_fallback_chunking=base.dropless_fallback_chunking) == base
