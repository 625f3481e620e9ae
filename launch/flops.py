"""Matmul FLOPs of a traced program, loops counted at their trip counts.

XLA's `compiled.cost_analysis()` counts a while loop's body once, so for a model whose layers
run in a scan it reports a fraction of the step. `matmul_flops` walks the jaxpr instead:
every `dot_general` is 2 x (output elements) x (contracted size), every `ragged_dot` 2 x
(output elements) x (contracted size) too (each row meets one group's matrix); a scan multiplies its body
by its length; a `shard_map` body (per-device shapes) by the mesh size; a cond or switch
counts its first branch (for the MoE layer: the capped path, the step that did not
overflow); remat, custom-VJP and nested calls count their bodies as they appear (a
rematerialised forward appears twice under grad, so its recompute is counted). Pallas
kernels (`pallas_call`, e.g. splash attention) are opaque: not counted.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax.extend import core


def matmul_flops(fn: Callable, *args: Any) -> float:
  """Matmul FLOPs of `fn(*args)` (args may be ShapeDtypeStructs), over the whole program."""
  return _jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _dot_flops(eqn) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)


def _ragged_dot_flops(eqn) -> float:
  """`lhs [M, K]` against `rhs [G, K, N]` (one group's matrix per row) -> `[M, N]`."""
  lhs = eqn.invars[0].aval.shape
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * lhs[-1]


def _jaxpr_flops(jaxpr: core.Jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name in ("ragged_dot", "ragged_dot_general"):
      total += _ragged_dot_flops(eqn)
    elif name == "scan":
      total += eqn.params["length"] * _jaxpr_flops(eqn.params["jaxpr"].jaxpr)
    elif name == "shard_map":
      total += eqn.params["mesh"].size * _jaxpr_flops(eqn.params["jaxpr"])
    elif name == "cond":
      total += _jaxpr_flops(eqn.params["branches"][0].jaxpr)
    elif name == "pallas_call":
      continue
    else:
      total += sum(_jaxpr_flops(sub) for sub in _sub_jaxprs(eqn.params.values()))
  return total


def _sub_jaxprs(values) -> list[core.Jaxpr]:
  """The jaxprs among an equation's parameters (closed or open, or in tuples of them)."""
  found = []
  for value in values:
    if isinstance(value, core.ClosedJaxpr):
      found.append(value.jaxpr)
    elif isinstance(value, core.Jaxpr):
      found.append(value)
    elif isinstance(value, (tuple, list)):
      found.extend(_sub_jaxprs(value))
  return found
