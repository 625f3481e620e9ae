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
from moe_hk.layer_call import LayerCall
from moe_hk.mesh_forward import MoEParams, forward_after_check, param_specs
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
  """Expert-parallel SwiGLU Mixture-of-Experts layer: `x [B, S, D]` -> `y [B, S, D]`.

  Each token goes to its top-K of E experts (`MoEConfig.router_score` weights), each expert a
  SwiGLU MLP `silu(x @ wi_0) * (x @ wi_1) @ wo`; the output is the weighted sum of the K
  experts' outputs. The experts are sharded over the mesh's expert axis, the batch over every
  mesh axis, and rows travel to their experts through a ragged all-to-all (or a ring of
  experts) into a receive buffer of `MoEConfig.ragged_buffer_factor` balanced loads; when a
  buffer would overflow, `MoEConfig.moe_dropless_fallback` reruns the layer dropless over
  token chunks (the default) instead of dropping rows.

  Parameters (float32, created at `init` with their sharding): `router/w [D, E]`,
  `wi_0 [E, D, F]`, `wi_1 [E, D, F]`, `wo [E, F, D]`. Each call's `MoEStats` go to Haiku state
  under `stats` (use `hk.transform_with_state`), or come back beside `y` with
  `return_stats=True` (for `hk.layer_stack`, which refuses state). `moe_hk.moe_forward` is
  the same layer as a pure function of its parameters.

  Example::

    mesh = moe_hk.make_mesh(data=2, expert=4)
    config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=512,
                              mlp_dim=1024, ragged_buffer_factor=1.5)
    model = hk.transform_with_state(lambda x: moe_hk.MoELayer(config, mesh, name="moe")(x))
    params, state = model.init(rng, x)              # x: [B, S, 512], B divisible by 8
    y, state = model.apply(params, state, None, x)  # state["moe"]["stats"]: MoEStats
  """

  def __init__(self, config: MoEConfig, mesh: Mesh, name: str | None = None):
    """Constructs the MoE layer.

    Args:
      config: The layer's settings (`MoEConfig`).
      mesh: The device mesh to run on; it must have the axis `config.expert_axis`, whose
        size divides `config.num_experts` (`make_mesh` builds one).
      name: Name of the module.
    """
    super().__init__(name=name)
    self.config = config
    self.mesh = mesh

  def __call__(self, x: jax.Array, *, step: jax.Array | None = None,
               layer_index: jax.Array | None = None, return_stats: bool = False,
               force_dropless: bool = False, after_overflow: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, MoEStats]:
    """Runs the MoE layer on `x`.

    Args:
      x: Input `[B, S, D]`, float32 or bfloat16, D = `config.emb_dim`, B divisible by the
        mesh's device count.
      step: Optional int32 scalar (may be traced): the training step. Given, the layer calls
        back to the host with `moe_hk.events.LayerEvent`s for it (see `MoEConfig`'s
        `emit_fallback_events` and `stream_step_stats`); none during `init`. `x -> y` alone
        needs no step.
      layer_index: Optional int32 scalar (may be traced): the 0-based ordinal of this layer
        among the model's MoE layers, labelling those events (0 if None).
      return_stats: Return `(y, stats)` and touch no Haiku state (for `hk.layer_stack`).
      force_dropless: Run the worst-case buffer: no truncation, no overflow check, no
        fallback.
      after_overflow: Optional bool scalar, `moe_dropless_fallback='step'` only: an earlier
        MoE layer of this step overflowed (`moe_hk.step_mode`), so this layer runs the
        chunked dropless path.

    Returns:
      `y [B, S, D]` in x's dtype (NaN rows for tokens whose router logits are not finite);
      `(y, stats)` with `return_stats=True`, else the step's `MoEStats` are stored as the
      Haiku state `stats`.

    Raises:
      ValueError: Before any parameter is created, when the mesh or input does not fit
        (`moe_hk.mesh.check_layer`); when tracing, for a buffer or fallback that cannot be
        built (see `moe_hk.moe_forward`).
    """
    # Before any parameter exists: a mesh that does not fit must fail with the project's
    # ValueError, not with jax's sharding errors from the initializers.
    mesh_lib.check_layer(self.config, self.mesh, x.shape, x.dtype)
    params = _get_params(self.config, self.mesh)
    call = LayerCall(None if hk.running_init() else step, layer_index, force_dropless,
                     after_overflow)
    y, stats = forward_after_check(params, x, config=self.config, mesh=self.mesh, call=call)
    if return_stats:
      return y, stats
    hk.set_state("stats", stats)
    return y
