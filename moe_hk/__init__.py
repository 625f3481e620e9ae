"""moe-hk: a Haiku MoE layer for expert-parallel JAX training that never silently drops tokens.

The names below load on first use, so the jax-free `moe_hk.buffer_size` imports without jax
(the host-only planner uses it).
"""
from __future__ import annotations

import importlib

_HOMES = {"MoEConfig": "moe_hk.config", "MoELayer": "moe_hk.layer",
          "check_layer": "moe_hk.mesh", "make_mesh": "moe_hk.mesh",
          "MoEParams": "moe_hk.mesh_forward", "moe_forward": "moe_hk.mesh_forward",
          "param_specs": "moe_hk.mesh_forward", "MoEStats": "moe_hk.stats",
          "EXPERT_MATMUL": "moe_hk.expert_swiglu"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
  """`moe_hk.MoELayer` and the other public names, imported from their modules; a submodule
  (`moe_hk.routing`) once imported."""
  if name in _HOMES:
    return getattr(importlib.import_module(_HOMES[name]), name)
  try:
    return importlib.import_module(f"moe_hk.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"moe_hk.{name}":
      raise
    raise AttributeError(f"module 'moe_hk' has no attribute {name!r}") from None
