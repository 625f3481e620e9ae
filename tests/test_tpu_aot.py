"""The native path (jax.lax.ragged_all_to_all with ragged_dot or the megablox kernels)
compiles for a TPU topology.

This machine has no TPU; the matching libtpu wheel (installed by `make test`) lets XLA compile
for a v5p topology ahead of time.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import moe_hk
from moe_hk import aot, mesh as mesh_lib

pytest.importorskip("libtpu", reason="needs the libtpu wheel matching jax (jax[tpu])")


def _compile_value_and_grad(config, mesh, batch=8, seq=64):
  specs = moe_hk.param_specs(config, mesh)
  e, d, f = config.num_experts, config.emb_dim, config.mlp_dim
  params = moe_hk.MoEParams(jnp.zeros((d, e)), jnp.zeros((e, d, f)), jnp.zeros((e, d, f)),
                            jnp.zeros((e, f, d)))
  params = aot.abstract_like(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  x = jax.ShapeDtypeStruct((batch, seq, d), jnp.float32,
                           sharding=NamedSharding(mesh, mesh_lib.batch_spec(mesh)))

  def loss(p, xx):
    y, stats = moe_hk.moe_forward(p, xx, config=config, mesh=mesh)
    return jnp.sum(y ** 2) + stats.lb_loss
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()


@pytest.mark.parametrize("factor", [-1, 1.0])
def test_native_path_compiles_for_v5p(factor):
  mesh = moe_hk.make_mesh(expert=4, devices=aot.tpu_topology_devices("v5p:2x2x1"))
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=128, mlp_dim=256,
                            ragged_buffer_factor=factor)
  assert moe_hk.sharded.resolve_backends(config, mesh) == ("native", "ragged_dot", False)
  compiled = _compile_value_and_grad(config, mesh)
  hlo = compiled.as_text()
  # Dispatch and combine forward, and their transposes in the backward.
  assert hlo.count("ragged-all-to-all") >= 4
  assert "ragged_dot_general" in hlo
  assert aot.total_memory_bytes(compiled) > 0


def test_capped_buffer_needs_less_tpu_memory_than_worst_case():
  mesh = moe_hk.make_mesh(expert=4, devices=aot.tpu_topology_devices("v5p:2x2x1"))
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=128, mlp_dim=256)
  worst = aot.total_memory_bytes(_compile_value_and_grad(config, mesh, seq=512))
  capped = aot.total_memory_bytes(
      _compile_value_and_grad(config.replace(ragged_buffer_factor=1.0), mesh, seq=512))
  assert capped < worst, (capped, worst)


@pytest.mark.parametrize("fallback", ["none", "layer"])
def test_megablox_kernels_compile_for_v5p(fallback):
  """gmm_impl='megablox' lowers to Mosaic custom calls (compiled, not interpreted), with no
  ragged_dot left, on the capped path and inside the chunked fallback, in bfloat16."""
  mesh = moe_hk.make_mesh(expert=4, devices=aot.tpu_topology_devices("v5p:2x2x1"))
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=128, mlp_dim=256,
                            ragged_buffer_factor=1.0, gmm_impl="megablox", dtype="bfloat16",
                            moe_dropless_fallback=fallback)
  assert moe_hk.sharded.resolve_backends(config, mesh) == ("native", "megablox", False)
  hlo = _compile_value_and_grad(config, mesh).as_text()
  assert "tpu_custom_call" in hlo
  assert "ragged_dot" not in hlo
