"""moe-hk: a Haiku MoE layer for expert-parallel JAX training that never silently drops tokens."""
from moe_hk.config import MoEConfig
from moe_hk.layer import MoELayer
from moe_hk.mesh import check_layer, make_mesh
from moe_hk.mesh_forward import MoEParams, moe_forward, param_specs
from moe_hk.stats import MoEStats

__all__ = ["MoEConfig", "MoELayer", "MoEParams", "MoEStats", "check_layer", "make_mesh",
           "moe_forward", "param_specs"]
