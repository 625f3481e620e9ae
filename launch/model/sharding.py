"""Where the train state lives on the mesh: parameters and optimizer state, FSDP style.

Expert weights follow the MoE layer (`moe_hk.param_specs`: experts over the expert axis, the
embedding dimension over fsdp), with any leading layer-stack axes unsharded. Every other
weight matrix is split along its largest dimension that divides evenly over the fsdp and
expert axes together (the expert axis is data parallelism for dense layers), else over fsdp
alone, else replicated; vectors (norm scales) are replicated. Adam's moments mirror the
parameters; scalars are replicated.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import moe_hk
from moe_hk.mesh import FSDP_AXIS

EXPERT_PARAMS = ("wi_0", "wi_1", "wo")


def dense_spec(shape: tuple[int, ...], mesh: Mesh, axes_options: tuple[tuple[str, ...], ...],
               stacked: int = 0) -> P:
  """Spec splitting the largest dim of `shape` (after `stacked` leading axes) that one of
  `axes_options` (tried in order) divides; replicated if none does or the leaf is a vector."""
  if len(shape) - stacked < 2:
    return P()
  dims = sorted(range(stacked, len(shape)), key=lambda d: -shape[d])
  for axes in axes_options:
    size = math.prod(mesh.shape[a] for a in axes)
    if size == 1:
      continue
    for d in dims:
      if shape[d] % size == 0:
        return P(*([None] * d), axes if len(axes) > 1 else axes[0])
  return P()


def param_specs(params: Any, mesh: Mesh, moe_config: moe_hk.MoEConfig) -> Any:
  """PartitionSpecs for a Haiku params tree (arrays or ShapeDtypeStructs) of the model."""
  moe_specs = moe_hk.param_specs(moe_config, mesh)
  present = lambda axes: tuple(a for a in axes if a in mesh.axis_names)
  options = tuple(o for o in (present((FSDP_AXIS, moe_config.expert_axis)), present((FSDP_AXIS,)))
                  if o)

  def spec(module: str, name: str, shape: tuple[int, ...]) -> P:
    if module.endswith("/moe") and name in EXPERT_PARAMS:
      base = getattr(moe_specs, name)
      return P(*([None] * (len(shape) - 3)), *base)
    if module.endswith("/moe/router"):
      return P()
    stacked = 1 if "/groups/" in module else 0
    return dense_spec(shape, mesh, options, stacked)

  return {module: {name: spec(module, name, tuple(leaf.shape)) for name, leaf in leaves.items()}
          for module, leaves in params.items()}


def state_shardings(state_shapes: Any, mesh: Mesh, moe_config: moe_hk.MoEConfig,
                    tx: optax.GradientTransformation) -> Any:
  """NamedShardings for a `TrainState(step, params, opt_state, spikes)` of ShapeDtypeStructs
  (the step and the spike window replicated)."""
  named = lambda spec: NamedSharding(mesh, spec)
  params = jax.tree.map(named, param_specs(state_shapes.params, mesh, moe_config),
                        is_leaf=lambda s: isinstance(s, P))
  opt_state = optax.tree_map_params(tx, lambda _, sharding: sharding, state_shapes.opt_state,
                                    params, transform_non_params=lambda _: named(P()))
  spikes = jax.tree.map(lambda _: named(P()), state_shapes.spikes)
  return type(state_shapes)(named(P()), params, opt_state, spikes)
