"""`launch.aot`'s parts: the launcher's train step compiled for TPU topologies and CPU meshes
(`launch.compiling`)."""
import dataclasses
import importlib.util
import math
import os
import textwrap

import jax
import jax.numpy as jnp
import pytest

import moe_hk
from launch import aot
from launch.compiling import topology as topology_lib, variants
from launch.compiling.program_key import program_key
from launch.setup.errors import UserError
from launch.configs import tiny
from launch.model.train_step import abstract_inputs, make_steps
from tests.helpers import (CompileAsked, forbid_compiles, require_libtpu, settings_of, tiny_config,
                           user_precision)


@pytest.mark.parametrize("topology,devices", [("v5p-16", 8), ("v5p:2x2x2", 8), ("cpu:8", 8)])
def test_topology_devices(topology, devices):
  found = topology_lib.topology_devices(topology)
  assert len(found) == devices
  assert found[0].platform == ("cpu" if topology.startswith("cpu") else "tpu")


@pytest.mark.parametrize("topology,message", [
    ("v5p-6", r"v5p-N needs N in \[8, 16, 32"),
    ("tpu-big", "must be 'v5p-N', 'v5p:AxBxC', 'v5e:AxB' or 'cpu:N'"),
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
  settings, devices = settings_of(tiny.get_config()), topology_lib.topology_devices("v5p-16")
  with user_precision():
    row = variants.compile_variant(settings, devices, "fallback_scan")
  assert row["compiled"], row
  # The arguments are the state's and the batch's shards (by hand from their shardings; TPU
  # tiles pad small arrays, so the compiler's figures are at least these); the state is
  # donated, so the new one is written over it (aliased): only the batch is not.
  steps = make_steps(settings, moe_hk.make_mesh(**settings.mesh, devices=devices))
  state, batch = abstract_inputs(settings.config, steps)
  shard = lambda a: math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
  state_bytes = sum(map(shard, jax.tree.leaves(state)))
  batch_bytes = sum(map(shard, jax.tree.leaves(batch)))
  assert row["argument_bytes"] >= state_bytes + batch_bytes, row
  assert row["alias_bytes"] >= state_bytes, row
  assert batch_bytes <= row["argument_bytes"] - row["alias_bytes"] < state_bytes, row
  assert row["total_bytes"] == (row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
                                - row["alias_bytes"]), row
  assert 0 < row["temp_bytes"] < 64 * 2**20, row  # the tiny model: activations, not GiB


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
  assert step.step_fallback
  for variant in (adaptive, step):  # the rest is the config's: its factor, its path
    assert dataclasses.replace(variant, moe_dropless_fallback=base.moe_dropless_fallback,
                               dropless_fallback_chunking=base.dropless_fallback_chunking) == base


def test_the_default_variant_is_the_one_the_config_trains():
  """`launch.aot` without --variants compiles the config's own variant (the pre-flight
  check of docs/tpu-pod.md): each trainable variant's layer maps back to it."""
  base = settings_of(tiny.get_config()).layer
  for variant in variants.VARIANTS[:-1]:  # the unrolled loop is a measurement, never trained
    assert variants.trained_variant(variants.variant_layer(base, variant)) == variant
  from launch.configs import maverick
  assert variants.trained_variant(settings_of(maverick.get_config(), 128).layer) == (
      "fallback_scan")


@pytest.mark.slow
def test_variants_compile_at_once_in_their_order_and_are_reused(monkeypatch):
  """`launch.aot --jobs=2`: two variants of the tiny step (the tests' grouped matmul) compile
  at once, on two threads, and come back in the order asked, each its own program: the naive
  chunk loop that one thread traces in (a context variable) holds more than the other's scan.
  On a CPU mesh: two v5p compiles on threads of a test worker crashed libtpu once (a
  segmentation fault, jax 0.10.2). `--reuse`: a row whose program key is this run's comes back
  as it was, with nothing compiled; a program the rows do not hold compiles."""
  settings, devices = settings_of(tiny_config()), topology_lib.topology_devices("cpu:8")
  rows = aot.compile_variants(settings, devices, ["fallback_unrolled", "fallback_scan"], jobs=2)
  assert [r["variant"] for r in rows] == ["fallback_unrolled", "fallback_scan"]
  assert all(r["compiled"] and r["flops"] > 0 for r in rows)
  assert rows[0]["total_bytes"] > rows[1]["total_bytes"]
  assert rows[0]["program"] != rows[1]["program"]

  forbid_compiles(monkeypatch)
  known = {r["program"]: r for r in rows}
  [again] = aot.compile_variants(settings, devices, ["fallback_scan"], jobs=1, known=known)
  assert again == {**rows[1], "reused": True}
  with pytest.raises(CompileAsked):
    aot.compile_variants(settings, devices, ["capped"], jobs=1, known=known)


def test_reuse_refuses_a_file_that_is_not_a_results_file(tmp_path):
  path = tmp_path / "notes.json"
  path.write_text('{"rows": []}')
  with pytest.raises(UserError, match=rf"^--reuse={path}: not a results file of launch.aot "):
    aot.known_rows(str(path))
  with pytest.raises(UserError, match=r"No such file"):
    aot.known_rows(str(tmp_path / "absent.json"))


def test_reuse_of_rows_without_program_keys_says_so(tmp_path, capsys):
  path = tmp_path / "old.json"
  path.write_text('{"results": [{"variant": "capped", "total_bytes": 1}]}')
  assert aot.known_rows(str(path)) == {}
  assert "no row records its program" in capsys.readouterr().err


# One Pallas kernel, written to two folders: `x * FACTOR`.
_KERNEL = textwrap.dedent("""
    import jax
    from jax.experimental import pallas as pl

    def scale(x):
      def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * FACTOR
      return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    """)


def _lowered_kernel(folder, factor: int, device: jax.Device) -> jax.stages.Lowered:
  """The kernel `x * factor` from `folder/kernel.py`, lowered for `device`, on [8, 128]."""
  os.makedirs(folder)
  path = os.path.join(folder, "kernel.py")
  with open(path, "w") as f:
    f.write(_KERNEL.replace("FACTOR", str(factor)))
  spec = importlib.util.spec_from_file_location(f"kernel_{os.path.basename(folder)}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.SingleDeviceSharding(device))
  return jax.jit(module.scale).lower(x)


def test_a_program_key_is_the_programs_not_its_folders(tmp_path):
  """A Pallas TPU kernel's bytecode carries the source paths of its frames, so one kernel
  lowered from two folders (two checkouts, two venvs) prints two programs; their key is one,
  and another kernel's is another."""
  require_libtpu()
  devices = topology_lib.topology_devices("v5p-16")
  here = _lowered_kernel(tmp_path / "a", 2, devices[0])
  there = _lowered_kernel(tmp_path / "checkout_b", 2, devices[0])
  other = _lowered_kernel(tmp_path / "c", 3, devices[0])
  assert here.as_text() != there.as_text()
  assert program_key(here, devices) == program_key(there, devices)
  assert program_key(other, devices) != program_key(here, devices)


def test_a_program_key_moves_with_what_reaches_the_compiler(monkeypatch):
  """The key moves with an XLA flag (XLA_FLAGS or LIBTPU_INIT_ARGS), a compile option of
  jax's and the devices; not with the simulated device count or a dump folder."""
  devices = jax.devices()
  lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((8,), jnp.float32))
  key = program_key(lowered, devices)
  flags = os.environ["XLA_FLAGS"]
  monkeypatch.setenv("XLA_FLAGS", flags.replace("device_count=8", "device_count=4") +
                     " --xla_dump_to=/tmp/dumps --xla_dump_hlo_as_text")
  assert program_key(lowered, devices) == key
  monkeypatch.setenv("XLA_FLAGS", flags + " --xla_cpu_enable_fast_math=true")
  assert program_key(lowered, devices) != key
  monkeypatch.setenv("XLA_FLAGS", flags)
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=false")
  assert program_key(lowered, devices) != key
  monkeypatch.delenv("LIBTPU_INIT_ARGS")
  level = jax.config.values["jax_optimization_level"]
  jax.config.update("jax_optimization_level", "O1")
  try:
    assert program_key(lowered, devices) != key
  finally:
    jax.config.update("jax_optimization_level", level)
  assert program_key(lowered, devices[:1]) != key
  assert program_key(lowered, devices) == key


def test_variants_compile_on_threads_at_the_callers_precision(monkeypatch):
  """`compile_variants` hands each variant to a thread of its pool and reads the matmul
  precision the caller compiles at there too (jax's contexts hold for one thread only; on
  another, the suite's 'highest' would be back)."""
  seen = []
  monkeypatch.setattr(aot, "compile_variant", lambda settings, devices, variant, known: seen.append(
      (variant, jax.config.jax_default_matmul_precision)) or {"variant": variant})
  with user_precision():
    rows = aot.compile_variants(None, None, ["capped", "step"], jobs=2)
  assert [r["variant"] for r in rows] == ["capped", "step"]
  assert sorted(seen) == [("capped", "default"), ("step", "default")]
