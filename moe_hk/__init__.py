"""moe-hk: a Haiku MoE layer for expert-parallel JAX training that never silently drops tokens."""
from moe_hk.config import MoEConfig
from moe_hk.layer import MoELayer
from moe_hk.mesh import make_mesh
from moe_hk.sharded import MoEParams, moe_forward, param_specs
from moe_hk.stats import MoEStats

__all__ = ["MoEConfig", "MoELayer", "MoEParams", "MoEStats", "make_mesh", "moe_forward",
           "param_specs"]
