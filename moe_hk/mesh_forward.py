"""The MoE layer over a whole mesh: backend choice, shard_map, stats reduction, events.

Shapes: B global batch, S sequence, D model width, F expert width, E experts.

`moe_forward` checks the mesh and input (`moe_hk.mesh.check_layer`) and runs
`forward_after_check`; `MoELayer` makes the check itself, before it creates its parameters.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moe_hk import casting, mesh as mesh_lib
from moe_hk.config import MoEConfig
from moe_hk.events import emit_layer_event
from moe_hk.expert_types import Backends, ExpertWeights
from moe_hk.layer_call import LayerCall
from moe_hk.shard_forward import moe_shard, size
from moe_hk.stats import MoEStats, reduce_stats


class MoEParams(NamedTuple):
  """The layer's parameters (float32), global shapes."""
  router_w: jax.Array  # [D, E]
  wi_0: jax.Array      # [E, D, F]
  wi_1: jax.Array      # [E, D, F]
  wo: jax.Array        # [E, F, D]


def param_specs(config: MoEConfig, mesh: Mesh) -> MoEParams:
  """Partition specs: router replicated, experts over the expert axis (D over fsdp if present)."""
  return MoEParams(
      router_w=P(),
      wi_0=mesh_lib.expert_weight_spec(mesh, config, embedding_dim=1),
      wi_1=mesh_lib.expert_weight_spec(mesh, config, embedding_dim=1),
      wo=mesh_lib.expert_weight_spec(mesh, config, embedding_dim=2))


def mesh_platform(mesh: Mesh) -> str:
  return mesh.devices.flat[0].platform


def resolve_backends(config: MoEConfig, mesh: Mesh) -> Backends:
  """Concrete all-to-all and grouped-matmul backends for the mesh's platform."""
  return backends_on(config, mesh_platform(mesh))


def backends_on(config: MoEConfig, platform: str) -> Backends:
  """Concrete all-to-all and grouped-matmul backends on `platform` ('cpu', 'tpu', 'gpu');
  a backend the platform cannot run is a ValueError naming it (a launcher checks this before
  it traces anything)."""
  if config.a2a_impl == "native" and platform == "cpu":
    raise ValueError(
        "MoEConfig.a2a_impl='native' cannot run on a CPU mesh: XLA:CPU has no "
        "ragged-all-to-all; use 'emulated' or 'auto'.")
  a2a = config.a2a_impl if config.a2a_impl != "auto" else (
      "emulated" if platform == "cpu" else "native")
  # 'auto': the backend measured fastest on the platform (on GPU by benchmarks/gpu_native.py:
  # XLA:GPU's ragged_dot is several times slower than the blocked loop, so only TPU gets it).
  # tokamax's GPU kernels take bfloat16 only (float32 would run XLA's ragged_dot inside it),
  # so the GPU pick applies to bfloat16 layers and float32 ones keep 'blocked'.
  gpu_bfloat16 = "blocked"
  auto = {"tpu": "ragged_dot",
          "gpu": gpu_bfloat16 if config.compute_dtype == jnp.bfloat16 else "blocked"}
  gmm = config.gmm_impl if config.gmm_impl != "auto" else auto.get(platform, "blocked")
  if gmm == "megablox" and platform not in ("tpu", "cpu"):
    raise ValueError(
        f"MoEConfig.gmm_impl='megablox' is a Mosaic TPU kernel: it runs on a TPU mesh (and "
        f"interpreted on a CPU mesh, for tests), not on a {platform} mesh; use 'blocked', "
        "'ragged_dot' or 'auto'.")
  if gmm == "tokamax" and platform == "tpu":
    raise ValueError(
        "MoEConfig.gmm_impl='tokamax' runs tokamax's Mosaic GPU kernels: it runs on a GPU mesh "
        "(and on tokamax's XLA reference on a CPU mesh, for tests), not on a tpu mesh; use "
        "'megablox' (jax's Pallas TPU kernels), 'ragged_dot' or 'auto'.")
  # On a CPU mesh the kernel backends run their stand-ins: megablox in Pallas's interpreter,
  # tokamax on its XLA reference.
  return Backends(a2a, gmm, interpret=gmm in ("megablox", "tokamax") and platform == "cpu")


def gather_experts(experts: ExpertWeights, mesh: Mesh, config: MoEConfig) -> ExpertWeights:
  """The shard's `moe_hk.shard_forward.Gather` (inside shard_map): its stored experts
  (float32, `[L, D / fsdp, F]`) as they run, in the compute dtype (`casting.to_compute_dtype`:
  rounded inside the layer scan, not hoisted out of it), their fsdp-sharded embedding dim
  all-gathered (`gather_in_dtype`) to `[L, D, F]`."""
  specs = param_specs(config, mesh)
  def gather(w, spec):
    if mesh_lib.FSDP_AXIS not in spec:
      return casting.to_compute_dtype(w, config.compute_dtype)
    return gather_in_dtype(w, mesh_lib.FSDP_AXIS, spec.index(mesh_lib.FSDP_AXIS),
                           config.compute_dtype)
  return ExpertWeights(gather(experts.wi_0, specs.wi_0), gather(experts.wi_1, specs.wi_1),
                       gather(experts.wo, specs.wo))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_in_dtype(w: jax.Array, axis: str, dim: int, dtype: jnp.dtype) -> jax.Array:
  """`all_gather(w.astype(dtype), axis, axis=dim, tiled=True)` (inside shard_map): the weight
  travels and is stored in the compute dtype (half of float32 for bfloat16), while its
  gradient is reduce-scattered in w's own dtype (float32 sums, as if gathered in float32)."""
  return jax.lax.all_gather(casting.to_compute_dtype(w, dtype), axis, axis=dim, tiled=True)


def _gather_in_dtype_fwd(w, axis, dim, dtype):
  return gather_in_dtype(w, axis, dim, dtype), jnp.zeros((0,), w.dtype)


def _gather_in_dtype_bwd(axis, dim, dtype, like, cotangent):
  return (jax.lax.psum_scatter(cotangent.astype(like.dtype), axis, scatter_dimension=dim,
                               tiled=True),)


gather_in_dtype.defvjp(_gather_in_dtype_fwd, _gather_in_dtype_bwd)


def moe_forward(params: MoEParams, x: jax.Array, *, config: MoEConfig, mesh: Mesh,
                step: jax.Array | int | None = None, layer_index: jax.Array | int | None = None,
                force_dropless: bool = False,
                after_overflow: jax.Array | bool | None = None
                ) -> tuple[jax.Array, MoEStats]:
  """Runs the MoE layer as a pure function of its parameters: `x` -> `(y, stats)`.

  The expert-parallel SwiGLU MoE layer of `MoELayer`, without Haiku (for `jax.jit`, `jax.grad`
  and scans over stacked parameters). The batch is sharded over every mesh axis and the
  experts over `config.expert_axis`; every device returns the same (global) `stats`. Tokens
  go to their top-K experts through a receive buffer of `config.ragged_buffer_factor`
  balanced loads per expert shard; when one would overflow, `config.moe_dropless_fallback`
  decides whether rows drop or the layer reruns dropless over token chunks.

  Args:
    params: The layer's float32 parameters, global shapes: `router_w [D, E]`,
      `wi_0 [E, D, F]`, `wi_1 [E, D, F]`, `wo [E, F, D]` (`param_specs` gives their sharding).
    x: Input `[B, S, D]`, float32 or bfloat16; B divisible by the mesh's device count.
    config: The layer's settings.
    mesh: The device mesh; it must have the axis `config.expert_axis` (see `make_mesh`).
    step: Optional int32 scalar (may be traced): the training step. Given, the layer calls
      back to the host with `moe_hk.events.LayerEvent`s labelled (step, layer_index or 0,
      process): from the fallback branch (`config.emit_fallback_events`) and, with
      `config.stream_step_stats`, every step. None sends nothing.
    layer_index: Optional int32 scalar (may be traced): the layer's 0-based ordinal among the
      model's MoE layers, for those events.
    force_dropless: Run the worst-case buffer: no truncation, no overflow check, no fallback.
    after_overflow: Optional bool scalar, `moe_dropless_fallback='step'` only: an earlier MoE
      layer of this step overflowed (`moe_hk.step_mode.overflowed` carries it from layer to
      layer), so this layer runs the chunked dropless path too.

  Returns:
    `(y, stats)`: `y [B, S, D]` in x's dtype (NaN rows for tokens whose router logits are not
    finite) and the layer's `MoEStats` for this step, the same on every device.

  Raises:
    ValueError: The mesh or input does not fit the layer (`moe_hk.mesh.check_layer`), the
      buffer factor leaves no row, no fallback chunk count fits the capped buffer,
      `after_overflow` is given outside 'step' mode, or a backend cannot run on the mesh's
      platform. Each in one line naming the value.
  """
  mesh_lib.check_layer(config, mesh, x.shape, x.dtype)
  return forward_after_check(params, x, config=config, mesh=mesh, call=LayerCall(
      step, layer_index, force_dropless, after_overflow))


def forward_after_check(params: MoEParams, x: jax.Array, *, config: MoEConfig, mesh: Mesh,
                        call: LayerCall = LayerCall()) -> tuple[jax.Array, MoEStats]:
  """`moe_forward` once `moe_hk.mesh.check_layer` passed for this mesh and input (`MoELayer`
  checks before it creates its parameters, then calls this); `call` holds the rest of
  `moe_forward`'s arguments."""
  step_mode = config.step_fallback
  if call.after_overflow is not None and not step_mode:
    raise ValueError("after_overflow is only for moe_dropless_fallback='step', not "
                     f"{config.moe_dropless_fallback!r}.")
  after = jnp.asarray(False if call.after_overflow is None else call.after_overflow, bool)
  backends = resolve_backends(config, mesh)
  batch = mesh_lib.batch_spec(mesh)
  axes = tuple(mesh.axis_names)
  stats_specs = MoEStats(*([P()] * len(MoEStats._fields)))
  step, layer_index = call.step, call.layer_index
  # The batch is split over every mesh axis (`batch`): each shard's (B / devices, S, D).
  shard = size((x.shape[0] // mesh.size, *x.shape[1:]), config, mesh.shape[config.expert_axis])
  labels = jnp.asarray([0 if step is None else step, 0 if layer_index is None else layer_index],
                       jnp.int32)

  def shard_fn(x_local, after_local, router_w, wi_0, wi_1, wo):
    # What a shard reads of the call; the flag is the shard's copy of `after`.
    local_call = LayerCall(force_dropless=call.force_dropless,
                           after_overflow=after_local if step_mode else None)
    y, local = moe_shard(x_local, router_w, ExpertWeights(wi_0, wi_1, wo), config=config,
                         backends=backends, mesh_axes=axes, shard=shard, call=local_call,
                         gather=functools.partial(gather_experts, mesh=mesh, config=config))
    return y, reduce_stats(local, mesh, config)

  specs = param_specs(config, mesh)
  # The megablox kernels' pallas_calls declare no varying axes for their outputs, which
  # shard_map's vma check rejects (as with splash attention in launch/model/attention.py).
  fn = jax.shard_map(shard_fn, mesh=mesh, in_specs=(batch, P(), *specs),
                     out_specs=(batch, stats_specs), check_vma=backends.gmm != "megablox")
  y, stats = fn(x, after, *params)
  every_step = config.stream_step_stats
  can_fall_back = not call.force_dropless and shard.builds_fallback
  if step is not None and (every_step or (can_fall_back and config.emit_fallback_events)):
    # Outside shard_map: the stats are replicated, so one callback per step and layer (two
    # when a rematerialised forward is recomputed), not one per device.
    emit_layer_event(stats, step=labels[0], layer=labels[1], process=jax.process_index(),
                     every_step=every_step, can_fall_back=can_fall_back)
  return y, stats
