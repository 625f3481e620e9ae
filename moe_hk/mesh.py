"""Device meshes for the MoE layer and the checks that need one.

The batch dimension is sharded over every mesh axis in mesh order; expert weights over the
expert axis (and `fsdp` on their embedding dimension when the mesh has that axis).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from moe_hk.config import DTYPES, MoEConfig

FSDP_AXIS = "fsdp"


def make_mesh(data: int = 1, fsdp: int = 1, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh with axes ('data', 'fsdp', 'expert') and Auto axis types (what shard_map expects).

  `devices` defaults to all local devices; their count must equal data * fsdp * expert.
  """
  sizes = {"data": data, "fsdp": fsdp, "expert": expert}
  for name, size in sizes.items():
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"make_mesh({name}={size!r}): axis sizes must be positive integers.")
  devices = list(jax.devices() if devices is None else devices)
  want = data * fsdp * expert
  if len(devices) != want:
    raise ValueError(
        f"make_mesh(data={data}, fsdp={fsdp}, expert={expert}) needs {want} devices, "
        f"got {len(devices)}.")
  grid = np.asarray(devices, dtype=object).reshape(data, fsdp, expert)
  return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * 3)


def batch_spec(mesh: Mesh) -> P:
  """Batch dim sharded over all mesh axes in mesh order."""
  return P(tuple(mesh.axis_names))


def expert_weight_spec(mesh: Mesh, config: MoEConfig, embedding_dim: int) -> P:
  """Spec of a `[E, ...]` expert weight whose `embedding_dim` is sharded over fsdp if present."""
  spec = [config.expert_axis, None, None]
  if FSDP_AXIS in mesh.axis_names and FSDP_AXIS != config.expert_axis:
    spec[embedding_dim] = FSDP_AXIS
  return P(*spec)


def validate_mesh(config: MoEConfig, mesh: Mesh) -> None:
  """Checks the expert axis exists and divides the experts."""
  if config.expert_axis not in mesh.axis_names:
    raise ValueError(
        f"MoEConfig.expert_axis={config.expert_axis!r} is not an axis of the mesh "
        f"(axes: {mesh.axis_names}).")
  shards = mesh.shape[config.expert_axis]
  if config.num_experts % shards:
    raise ValueError(
        f"MoEConfig.num_experts={config.num_experts} must be divisible by the size of mesh "
        f"axis {config.expert_axis!r} ({shards}).")
  if FSDP_AXIS in mesh.axis_names and config.emb_dim % mesh.shape[FSDP_AXIS]:
    raise ValueError(
        f"MoEConfig.emb_dim={config.emb_dim} must be divisible by the size of mesh axis "
        f"'{FSDP_AXIS}' ({mesh.shape[FSDP_AXIS]}).")


def validate_input(config: MoEConfig, mesh: Mesh, shape: tuple[int, ...], dtype) -> None:
  """Checks x is `[B, S, D]` float32 or bfloat16, with D = emb_dim and B divisible by the
  device count."""
  if jnp.dtype(dtype).name not in DTYPES:
    raise ValueError(f"MoE input dtype {jnp.dtype(dtype).name} is not supported: the layer "
                     f"takes {' or '.join(DTYPES)} input only.")
  if len(shape) != 3:
    raise ValueError(f"MoE input must be [batch, seq, emb_dim]; got shape {tuple(shape)}.")
  batch, _, width = shape
  if width != config.emb_dim:
    raise ValueError(
        f"MoE input width {width} (shape {tuple(shape)}) must equal MoEConfig.emb_dim="
        f"{config.emb_dim}.")
  if batch % mesh.size:
    raise ValueError(
        f"MoE input batch {batch} must be divisible by the {mesh.size} devices of the mesh "
        f"{dict(mesh.shape)} (the batch is sharded over every mesh axis).")
