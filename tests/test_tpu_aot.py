"""The native path (jax.lax.ragged_all_to_all with ragged_dot or the megablox kernels)
compiles for a TPU topology, with the receive buffer the config asks for.

This machine has no TPU; the matching libtpu wheel (installed by `make test`) lets XLA compile
for a v5p topology ahead of time.
"""
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import moe_hk
from launch.compiling import topology
from launch.model import memory
from moe_hk import mesh as mesh_lib
from tests.helpers import require_libtpu, user_precision

# The compiles are cached for the module: its tests share one worker (tests/conftest.py
# WORKER_GROUPS). TPU compiles are long: `make test-fast` skips the module.
pytestmark = pytest.mark.slow

# 4 expert shards of a v5p 2x2x1 slice, 8 experts, top-2, width 128, 8 x 512 tokens: T = 1024
# tokens and N = 2048 routed rows per shard; the worst-case buffer P * T * min(K, L) = 8192.
EXPERTS, K, EMB, MLP, BATCH, SEQ, SHARDS = 8, 2, 128, 256, 8, 512, 4
BUFFER_ROWS = {-1: 8192, 1.0: 2048}


@pytest.fixture(scope="module", autouse=True)
def _libtpu():
  require_libtpu()


def _mesh():
  return moe_hk.make_mesh(expert=SHARDS, devices=topology.tpu_topology_devices("v5p:2x2x1"))


def _loss_and_inputs(config: moe_hk.MoEConfig, seq: int = SEQ):
  """The layer's loss `sum(y ** 2) + lb_loss` on the v5p:2x2x1 mesh and its abstract inputs
  (parameters, `[BATCH, seq]` tokens), sharded as the layer wants them."""
  mesh = _mesh()
  specs = moe_hk.param_specs(config, mesh)
  params = moe_hk.MoEParams(jnp.zeros((EMB, EXPERTS)), jnp.zeros((EXPERTS, EMB, MLP)),
                            jnp.zeros((EXPERTS, EMB, MLP)), jnp.zeros((EXPERTS, MLP, EMB)))
  params = memory.abstract_like(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  x = jax.ShapeDtypeStruct((BATCH, seq, EMB), jnp.float32,
                           sharding=NamedSharding(mesh, mesh_lib.batch_spec(mesh)))

  def loss(p, xx):
    y, stats = moe_hk.moe_forward(p, xx, config=config, mesh=mesh)
    return jnp.sum(y ** 2) + stats.lb_loss
  return loss, params, x


@functools.lru_cache(maxsize=None)
def _compiled(config: moe_hk.MoEConfig, seq: int = SEQ):
  """The layer's value-and-grad step on `[BATCH, seq]` tokens, compiled for v5p:2x2x1."""
  loss, params, x = _loss_and_inputs(config, seq)
  with user_precision():
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()


def _config(factor, **kw):
  return moe_hk.MoEConfig(num_experts=EXPERTS, num_experts_per_tok=K, emb_dim=EMB, mlp_dim=MLP,
                          ragged_buffer_factor=factor, moe_dropless_fallback="none", **kw)


@pytest.mark.parametrize("factor", [-1, 1.0])
def test_native_path_compiles_for_v5p_with_the_configured_buffer(factor):
  """Dispatch and combine are ragged all-to-alls (forward and their transposes), the experts
  ragged_dots, and the dispatch lands in a receive buffer of the config's rows: the worst
  case, or factor x balanced."""
  assert moe_hk.mesh_forward.resolve_backends(_config(factor), _mesh()) == (
      "native", "ragged_dot", False)
  hlo = _compiled(_config(factor)).as_text()
  assert hlo.count("ragged-all-to-all") >= 4
  assert "ragged_dot_general" in hlo
  # Output rows of every ragged all-to-all (newer libtpus split it into -start and -done):
  # the receive buffer's, and N = 2048 where the combine returns rows to their senders.
  rows = {int(r) for r in re.findall(
      r"= f32\[(\d+),1,128\][^ ]* ragged-all-to-all(?:-done)?\(", hlo)}
  assert max(rows) == BUFFER_ROWS[factor] and min(rows) == 2048, (factor, rows)


@pytest.mark.parametrize("fallback", ["none", "layer"])
def test_native_path_backward_sums_no_shards_rows(fallback):
  """The receive buffer holds each shard's own rows, so the backward sends each shard's
  cotangent of them back to their senders and sums none of it over the mesh. Typed
  replicated (a `jnp.zeros` buffer made inside shard_map, whose type the collective's result
  takes), the buffer's `[R, D]` cotangent was psummed over every mesh axis first: every
  sender got the sum of all shards' cotangents."""
  loss, params, x = _loss_and_inputs(_config(1.0).replace(moe_dropless_fallback=fallback))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
  assert re.findall(r"psum", jaxpr), "the control: the router's gradient is summed"
  summed_rows = re.findall(rf"f32\[(\d+),{EMB}\](?:{{[^}}]*}})? = psum", jaxpr)
  assert not summed_rows, summed_rows


def test_capped_buffer_needs_less_tpu_memory_than_worst_case():
  worst = memory.total_memory_bytes(_compiled(_config(-1)))
  capped = memory.total_memory_bytes(_compiled(_config(1.0)))
  assert capped < worst, (capped, worst)


@pytest.mark.parametrize("fallback", ["none", "layer"])
def test_megablox_kernels_compile_for_v5p(fallback):
  """gmm_impl='megablox' lowers to Mosaic custom calls (compiled, not interpreted), with no
  ragged_dot left, on the capped path and inside the chunked fallback, in bfloat16."""
  config = _config(1.0, gmm_impl="megablox", dtype="bfloat16").replace(
      moe_dropless_fallback=fallback)
  assert moe_hk.mesh_forward.resolve_backends(config, _mesh()) == ("native", "megablox", False)
  hlo = _compiled(config, seq=64).as_text()
  assert "tpu_custom_call" in hlo
  assert "ragged_dot" not in hlo
