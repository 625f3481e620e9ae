"""Replaying a run's recorded MoE traffic at other buffer factors, and pricing them.

`plan` replays every recorded step and MoE layer (`metrics.traffic`) through the capped buffer
of each candidate `ragged_buffer_factor` (`moe_hk.dispatch_plan`): how often the fallback
would run, how many layers per step, what would drop without it. `advise` names the factor to
use by the rule the alerts and the autopilot follow (`metrics.factor_advice`), on the same
evidence: the recorded steps' required factors (`window`: the trailing window the run weighs)
and, priced by the run's own timed intervals (`launch.planning.step_model`), its step times.
`launch.capacity` prints and plots them.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from launch.planning import step_model
from metrics import factor_advice
from metrics.traffic import Traffic
from moe_hk import dispatch_plan

DEFAULT_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)

# [M, P, P] traffic matrices -> [M] rows beyond a buffer of R rows (R traced: one compile).
_overflow_rows = jax.jit(jax.vmap(dispatch_plan.overflow_rows, in_axes=(0, None)))


def group_traffic(counts: np.ndarray, expert_shards: int) -> jax.Array:
  """`A [n, layers, G, P, P]` from `counts [n, layers, devices, E]`: G = devices / P groups."""
  n, layers, devices, experts = counts.shape
  for what, size in (("recorded devices", devices), ("experts", experts)):
    if expert_shards < 1 or size % expert_shards:
      raise ValueError(f"expert_shards={expert_shards} must divide the {size} {what}.")
  groups = counts.reshape(-1, expert_shards, experts)  # [n * layers * G, P, E]
  return jax.vmap(dispatch_plan.traffic_matrix)(groups).reshape(
      n, layers, devices // expert_shards, expert_shards, expert_shards)


def plan(traffic: Traffic, factors: Sequence[float],
         expert_shards: int | None = None) -> list[dict]:
  """Per factor, what a capped buffer would have done on every recorded step and MoE layer.

  One dict per factor, in the order given, with the keys of the module docstring (no memory).
  """
  shards = traffic.expert_shards if expert_shards is None else expert_shards
  matrices = group_traffic(traffic.counts, shards)
  flat = matrices.reshape(-1, shards, shards)
  local = traffic.counts.shape[-1] // shards
  routed = traffic.counts.sum(dtype=np.int64)
  results = []
  for factor in factors:
    rows = dispatch_plan.buffer_rows(shards, traffic.tokens_per_device, traffic.k, local, factor)
    beyond = np.asarray(_overflow_rows(flat, rows)).reshape(matrices.shape[:3])  # [n, layers, G]
    overflowing = (beyond > 0).any(axis=2)                                        # [n, layers]
    results.append(dict(
        factor=float(factor),
        fallback_frequency=float(overflowing.any(axis=1).mean()),
        overflowing_layers_mean=float(overflowing.sum(axis=1).mean()),
        would_drop_fraction=float(beyond.sum(dtype=np.int64) / routed),
        buffer_rows=rows,
        expert_shards=shards))
  return results


def window(traffic: Traffic, steps: int) -> Traffic:
  """The last `steps` recorded steps of `traffic` (all of them for 0): the trailing window the
  alerts and the autopilot weigh. The timed intervals are kept whole, as the run keeps them."""
  if steps <= 0 or steps >= len(traffic.steps):
    return traffic
  return traffic._replace(steps=traffic.steps[-steps:], counts=traffic.counts[-steps:],
                          factors=traffic.factors[-steps:])


def required_factors(traffic: Traffic, expert_shards: int | None = None) -> np.ndarray:
  """`[steps, layers]`: each step's required buffer factor per MoE layer, the largest over
  its expert groups and receivers of the received rows over N (what `MoEStats` reports)."""
  shards = traffic.expert_shards if expert_shards is None else expert_shards
  received = np.asarray(group_traffic(traffic.counts, shards)).sum(axis=-2)  # [n, L, G, P]
  return received.max(axis=(2, 3)) / (traffic.tokens_per_device * traffic.k)


def rule_price(traffic: Traffic, timed: dict[float, float] | None = None
               ) -> factor_advice.Price | None:
  """The factor rule's price from the run's timed intervals (for the recorded
  expert-parallel size), scaled to the factors the run did not train at by `timed`
  (`{factor: seconds of a capped step}`, `launch.planning.capped_timing`) where it has the
  factor and a measured one; None when the traffic has no timings or run shape. With adaptive
  chunking a fallback is priced at its most chunks (`step_model.fallback_chunks`): an upper
  bound."""
  shape, timings = traffic.shape, traffic.timings
  if shape is None or timings is None or not len(timings.seconds):
    return None
  shards, experts = traffic.expert_shards, traffic.counts.shape[-1]
  # The model prices a factor by its buffer's size: the worst case (-1) as its factor.
  worst = dispatch_plan.worst_case_factor(experts, traffic.k, shards)
  size = lambda factor: float(factor) if factor > 0 else worst
  flops = step_model.StepFlops(shape.flops_fixed, shape.flops_per_factor,
                               moe_layers=traffic.counts.shape[1])

  def chunks(factor: float) -> float:
    return step_model.fallback_chunks(
        factor, tokens_per_device=traffic.tokens_per_device, seq_len=shape.seq_len, k=traffic.k,
        shards=shards, local_experts=experts // shards, requested=shape.requested_chunks)
  sized = timings._replace(factors=np.asarray([size(f) for f in timings.factors]))
  return step_model.rule_price(sized, flops, chunks,
                               {size(f): s for f, s in (timed or {}).items()})


def run_factor(traffic: Traffic) -> float:
  """The factor in force at the newest recorded step (the worst case for -1)."""
  factor = float(traffic.factors[-1])
  experts = traffic.counts.shape[-1]
  return factor if factor > 0 else dispatch_plan.worst_case_factor(experts, traffic.k,
                                                                   traffic.expert_shards)


def advise(traffic: Traffic, *, max_frequency: float, target: float,
           expert_shards: int | None = None, factors: Sequence[float] | None = None,
           timed: dict[float, float] | None = None,
           fits=lambda factor: True) -> factor_advice.Advice:
  """The shared factor rule (`metrics.factor_advice`) on `traffic`'s steps (window them with
  `window`): priced by the run's timings when they are for this expert-parallel size.
  `factors` restricts the candidates (default: the rule's, multiples of 1/8)."""
  shards = traffic.expert_shards if expert_shards is None else expert_shards
  experts = traffic.counts.shape[-1]
  price = rule_price(traffic, timed) if shards == traffic.expert_shards else None
  return factor_advice.advise(
      required_factors(traffic, shards),
      worst_case=dispatch_plan.worst_case_factor(experts, traffic.k, shards),
      current=run_factor(traffic) if shards == traffic.expert_shards else None,
      max_frequency=max_frequency if price else 1.0, target=target, price=price, fits=fits,
      factors=factors)


def factor_list(values: list[str] | None, traffic: Traffic) -> list[float]:
  """--factors as sorted distinct numbers; default: DEFAULT_FACTORS and the run's own."""
  if values is None:
    # A run on the worst-case buffer (-1) never overflows: nothing to replay for it.
    return sorted({*DEFAULT_FACTORS, *(f for f in traffic.factors.tolist() if f > 0)})
  text = ",".join(values)
  try:
    factors = [float(v) for v in values]
  except ValueError:
    raise ValueError(f"--factors={text}: not a comma-separated list of numbers.") from None
  if not factors or not all(math.isfinite(f) and f > 0 for f in factors):
    raise ValueError(f"--factors={text}: need one or more positive buffer factors, e.g. 1,1.5,2.")
  return sorted(set(factors))


def check_routing(layer, traffic: Traffic, flag: str) -> None:
  """ValueError unless `config` (--`flag`) routes like the recorded run: experts and top-K."""
  experts = traffic.counts.shape[-1]
  if (layer.num_experts, layer.num_experts_per_tok) != (experts, traffic.k):
    raise ValueError(f"--{flag} has {layer.num_experts} experts, top-"
                     f"{layer.num_experts_per_tok}; the traffic {experts}, top-{traffic.k}.")
