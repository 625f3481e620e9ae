"""`MoELayer`: the thin Haiku module over `moe_forward`.

Parameters are created here, outside any shard_map / scan / cond, and handed to pure functions.
"""
from __future__ import annotations

import math

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from moe_hk import mesh as mesh_lib
from moe_hk.config import MoEConfig
from moe_hk.sharded import MoEParams, forward_checked, param_specs
from moe_hk.stats import MoEStats


def _sharded_init(stddev: float, mesh: Mesh, spec) -> hk.initializers.Initializer:
  """Truncated-normal initializer whose output is placed with `spec` on `mesh`."""
  init = hk.initializers.TruncatedNormal(stddev=stddev)
  sharding = NamedSharding(mesh, spec)
  return lambda shape, dtype: jax.lax.with_sharding_constraint(init(shape, dtype), sharding)


def _get_params(config: MoEConfig, mesh: Mesh) -> MoEParams:
  """Fetches (creating at init) `router/w`, `wi_0`, `wi_1`, `wo` in the current module."""
  c = config
  specs = param_specs(c, mesh)
  fan_in_d, fan_in_f = 1 / math.sqrt(c.emb_dim), 1 / math.sqrt(c.mlp_dim)
  with hk.name_scope("router"):
    router_w = hk.get_parameter("w", (c.emb_dim, c.num_experts), jnp.float32,
                                init=_sharded_init(fan_in_d, mesh, specs.router_w))
  expert_shape = (c.num_experts, c.emb_dim, c.mlp_dim)
  wi_0 = hk.get_parameter("wi_0", expert_shape, jnp.float32,
                          init=_sharded_init(fan_in_d, mesh, specs.wi_0))
  wi_1 = hk.get_parameter("wi_1", expert_shape, jnp.float32,
                          init=_sharded_init(fan_in_d, mesh, specs.wi_1))
  wo = hk.get_parameter("wo", (c.num_experts, c.mlp_dim, c.emb_dim), jnp.float32,
                        init=_sharded_init(fan_in_f, mesh, specs.wo))
  return MoEParams(router_w, wi_0, wi_1, wo)


class MoELayer(hk.Module):
  """Expert-parallel SwiGLU MoE layer: `x [B, S, D]` -> `y [B, S, D]`.

  Parameters: `router/w [D, E]`, `wi_0 [E, D, F]`, `wi_1 [E, D, F]`, `wo [E, F, D]` (float32),
  expert weights sharded over `config.expert_axis`. By default the step's `MoEStats` go to
  Haiku state under `stats` (use `hk.transform_with_state`); `return_stats=True` returns
  `(y, stats)` instead and touches no state, for `hk.layer_stack`, which refuses state.
  """

  def __init__(self, config: MoEConfig, mesh: Mesh, name: str | None = None):
    super().__init__(name=name)
    self.config = config
    self.mesh = mesh

  def __call__(self, x: jax.Array, *, step: jax.Array | None = None,
               layer_index: jax.Array | None = None, return_stats: bool = False,
               force_dropless: bool = False, after_overflow: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, MoEStats]:
    """`step` and `layer_index` (optional, may be traced) only label the metric events the
    layer streams to the host (none without `step`, none during `init`); `force_dropless`
    uses the worst-case buffer (no truncation, no fallback); `after_overflow` ('step' mode:
    an earlier MoE layer of the step overflowed, see `moe_hk.step_mode`) runs the chunked
    dropless path."""
    # Before any parameter exists: a mesh that does not fit must fail with the project's
    # ValueError, not with jax's sharding errors from the initializers.
    mesh_lib.validate_mesh(self.config, self.mesh)
    mesh_lib.validate_input(self.config, self.mesh, x.shape, x.dtype)
    params = _get_params(self.config, self.mesh)
    y, stats = forward_checked(params, x, config=self.config, mesh=self.mesh,
                               step=None if hk.running_init() else step,
                               layer_index=layer_index, force_dropless=force_dropless,
                               after_overflow=after_overflow)
    if return_stats:
      return y, stats
    hk.set_state("stats", stats)
    return y
