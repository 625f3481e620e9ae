"""Matmul FLOPs of a traced program, loops counted at their trip counts.

XLA's `compiled.cost_analysis()` counts a while loop's body once, so for a model whose layers
run in a scan it reports a fraction of the step. `matmul_flops` walks the jaxpr instead:
every `dot_general` is 2 x (output elements) x (contracted size), every `ragged_dot` (and its
transposes) 2 x rows x K x N (each row meets one group's matrix); a scan multiplies its body
by its length; a `shard_map` body (per-device shapes) by the mesh size; a cond or switch
counts its first branch (for the MoE layer: the capped path, the step that did not
overflow); remat, custom-VJP and nested calls count their bodies as they appear (a
rematerialised forward appears twice under grad, so its recompute is counted). What nothing
uses is not counted, as XLA removes it: the fallback's VJP recomputes its branch with
`jax.vjp`, whose last expert matmul only feeds the primal output, which the backward of an
input-weighted router never reads. A Pallas kernel (`pallas_call`) counts the FLOPs its
`cost_estimate` states (megablox's grouped matmuls: 2 x rows x K x N, as for ragged_dot); one
without an estimate (splash attention) is opaque: not counted.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax._src.interpreters import partial_eval
from jax.extend import core


def matmul_flops(fn: Callable, *args: Any) -> float:
  """Matmul FLOPs of `fn(*args)` (args may be ShapeDtypeStructs), over the whole program."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  # jax's dead-code elimination, into every nested jaxpr (each primitive's own rule: a scan's
  # unused carries, a custom VJP's unused outputs); jax exposes it only privately, in both
  # pinned versions.
  live, _ = partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  return _jaxpr_flops(live)


def _dot_flops(eqn) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)


def _ragged_dot_flops(eqn) -> float:
  """Each lhs element meets one group's slice of rhs: 2 x (lhs elements) x (rhs dims that are
  neither contracted, batch nor group). `[M, K] x [G, K, N]`, its input gradient
  `[M, N] x [G, K, N]` and its weight gradient `[M, K] x [M, N] -> [G, K, N]` are each 2MKN."""
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
  lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  bound = set(rhs_contract) | set(rhs_batch) | set(numbers.rhs_group_dimensions)
  return 2.0 * math.prod(lhs) * math.prod(n for d, n in enumerate(rhs) if d not in bound)


def _jaxpr_flops(jaxpr: core.Jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "ragged_dot_general":
      total += _ragged_dot_flops(eqn)
    elif name == "scan":
      total += eqn.params["length"] * _jaxpr_flops(eqn.params["jaxpr"].jaxpr)
    elif name == "shard_map":
      total += eqn.params["mesh"].size * _jaxpr_flops(eqn.params["jaxpr"])
    elif name == "cond":
      total += _jaxpr_flops(eqn.params["branches"][0].jaxpr)
    elif name == "pallas_call":
      estimate = eqn.params.get("cost_estimate")
      total += estimate.flops if estimate is not None else 0.0
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
