"""Device meshes for the MoE layer and the checks that need one.

The batch dimension is sharded over every mesh axis in mesh order; expert weights over the
expert axis (and `fsdp` on their embedding dimension when the mesh has that axis).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from moe_hk.config import DTYPES, MoEConfig

AXES = ("data", "fsdp", "expert")  # make_mesh's axes, in mesh order
FSDP_AXIS = "fsdp"


def make_mesh(data: int = 1, fsdp: int = 1, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Creates the mesh the MoE layer runs on: axes `('data', 'fsdp', 'expert')`.

  The axes are `Auto` (what `shard_map` expects; `jax.make_mesh` defaults to `Explicit`). The
  layer shards the batch over all three axes, expert weights over `expert` and their
  embedding dimension over `fsdp`. Any mesh that has `MoEConfig.expert_axis` works too, e.g.
  `jax.sharding.Mesh(devices, ('data', 'expert'))`.

  Args:
    data: Size of the `data` axis (pure data parallelism).
    fsdp: Size of the `fsdp` axis (data parallelism with weights sharded on D).
    expert: Size of the `expert` axis: P, the expert-parallel degree. It must divide
      `MoEConfig.num_experts` (checked when the layer first sees the mesh).
    devices: The devices, `data * fsdp * expert` of them, in mesh order (the last axis
      fastest); all of `jax.devices()` by default.

  Returns:
    A `jax.sharding.Mesh` of shape `(data, fsdp, expert)`.

  Raises:
    ValueError: An axis size is not a positive integer, or the sizes' product is not the
      number of devices.
  """
  sizes = dict(zip(AXES, (data, fsdp, expert)))
  devices = list(jax.devices() if devices is None else devices)
  check_device_count(sizes, len(devices))
  grid = np.asarray(devices, dtype=object).reshape(data, fsdp, expert)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def check_device_count(sizes: Mapping[str, int], devices: int) -> None:
  """Checks the axis sizes `{axis: size}` are positive integers whose product is `devices`."""
  for name, size in sizes.items():
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(f"mesh axis {name}={size!r}: axis sizes must be positive integers.")
  want = int(np.prod(list(sizes.values())))
  if want != devices:
    shape = ", ".join(f"{k}={v}" for k, v in sizes.items())
    raise ValueError(f"the mesh ({shape}) needs {want} devices; there are {devices}.")


def batch_spec(mesh: Mesh) -> P:
  """Batch dim sharded over all mesh axes in mesh order."""
  return P(tuple(mesh.axis_names))


def expert_weight_spec(mesh: Mesh, config: MoEConfig, embedding_dim: int) -> P:
  """Spec of a `[E, ...]` expert weight whose `embedding_dim` is sharded over fsdp if present."""
  spec = [config.expert_axis, None, None]
  if FSDP_AXIS in mesh.axis_names and FSDP_AXIS != config.expert_axis:
    spec[embedding_dim] = FSDP_AXIS
  return P(*spec)


def check_layer(config: MoEConfig, mesh: Mesh, x_shape: Sequence[int], x_dtype) -> None:
  """Checks that a layer of `config` can run on `mesh` with input `x [B, S, D]`.

  `moe_hk.moe_forward` and `moe_hk.MoELayer` call it before they trace anything; a caller that
  builds a whole step can call it once, up front, with the input's shape and dtype.

  Args:
    config: The layer's settings (already validated on their own by `MoEConfig`).
    mesh: The mesh the layer runs on.
    x_shape: Shape of the layer's global input, `(B, S, D)`.
    x_dtype: Dtype of the layer's input.

  Raises:
    ValueError: In one line naming the value: the mesh has no `config.expert_axis`, its size
      does not divide `num_experts`, the `fsdp` axis does not divide `emb_dim`, x is not
      `[B, S, emb_dim]` float32 or bfloat16, or B is not divisible by the mesh's devices.
  """
  check_axes(config, dict(mesh.shape))
  check_input(config, mesh, x_shape, x_dtype)


def check_axes(config: MoEConfig, sizes: Mapping[str, int]) -> None:
  """Checks a mesh of axis sizes `{axis: size}` fits the layer: the expert axis exists and
  divides the experts, and the fsdp axis (if any) divides the width."""
  if config.expert_axis not in sizes:
    raise ValueError(
        f"MoEConfig.expert_axis={config.expert_axis!r} is not an axis of the mesh "
        f"(axes: {', '.join(sizes)}).")
  shards = sizes[config.expert_axis]
  if config.num_experts % shards:
    raise ValueError(
        f"MoEConfig.num_experts={config.num_experts} must be divisible by the size of mesh "
        f"axis {config.expert_axis!r} ({shards}).")
  if FSDP_AXIS in sizes and config.emb_dim % sizes[FSDP_AXIS]:
    raise ValueError(
        f"MoEConfig.emb_dim={config.emb_dim} must be divisible by the size of mesh axis "
        f"'{FSDP_AXIS}' ({sizes[FSDP_AXIS]}).")


def check_input(config: MoEConfig, mesh: Mesh, shape: Sequence[int], dtype) -> None:
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
