"""Replaying a run's recorded MoE traffic at other buffer factors, and the factor rule on it.

`plan` replays every recorded step and MoE layer (`metrics.traffic`) through the capped buffer
of each candidate `ragged_buffer_factor`, as `moe_hk.buffer_size` sizes it and
`moe_hk.dispatch_plan` fills it: how
often the fallback would run, how many layers per step, what would drop without it. `advise`
names the factor by the rule the alerts and the autopilot follow (`metrics.factor_rule`), on
the same evidence: the window's required factors, priced by the run's own timed intervals at
the factors it ran ('measured') or by capped steps timed apart ('timed', `launch.capacity
--time_config`). Host-only: numpy and the jax-free `moe_hk.buffer_size`, no jax.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from metrics import factor_rule
from metrics.traffic import Traffic
from moe_hk.buffer_size import buffer_rows, factor_in_force, worst_case_factor

DEFAULT_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)


def group_traffic(counts: np.ndarray, expert_shards: int) -> np.ndarray:
  """`A [n, layers, G, P, P]` (sender, receiver) from `counts [n, layers, devices, E]`: G =
  devices / P groups, each receiver holding E / P consecutive experts."""
  n, layers, devices, experts = counts.shape
  for what, size in (("recorded devices", devices), ("experts", experts)):
    if expert_shards < 1 or size % expert_shards:
      raise ValueError(f"expert_shards={expert_shards} must divide the {size} {what}.")
  p = expert_shards
  return counts.astype(np.int64).reshape(n, layers, devices // p, p, p, experts // p).sum(-1)


def plan(traffic: Traffic, factors: Sequence[float],
         expert_shards: int | None = None) -> list[dict]:
  """Per factor (in the order given), what a capped buffer would have done on every recorded
  step and MoE layer: `factor`, `fallback_frequency`, `overflowing_layers_mean`,
  `would_drop_fraction`, `buffer_rows`, `expert_shards`."""
  shards = traffic.expert_shards if expert_shards is None else expert_shards
  received = group_traffic(traffic.counts, shards).sum(axis=-2)  # [n, layers, G, P]
  local = traffic.counts.shape[-1] // shards
  routed = traffic.counts.sum(dtype=np.int64)
  results = []
  for factor in factors:
    rows = buffer_rows(shards, traffic.tokens_per_device, traffic.k, local, factor)
    beyond = np.maximum(received - rows, 0).sum(axis=-1)   # [n, layers, G]
    overflowing = (beyond > 0).any(axis=2)                 # [n, layers]
    results.append(dict(
        factor=float(factor),
        fallback_frequency=float(overflowing.any(axis=1).mean()),
        overflowing_layers_mean=float(overflowing.sum(axis=1).mean()),
        would_drop_fraction=float(beyond.sum() / routed),
        buffer_rows=rows, expert_shards=shards))
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
  received = group_traffic(traffic.counts, shards).sum(axis=-2)  # [n, layers, G, P]
  return received.max(axis=(2, 3)) / (traffic.tokens_per_device * traffic.k)


def _worst(traffic: Traffic, shards: int) -> float:
  return worst_case_factor(traffic.counts.shape[-1], traffic.k, shards)


def run_factor(traffic: Traffic) -> float:
  """The factor in force at the newest recorded step (the worst case's for -1)."""
  return factor_in_force(float(traffic.factors[-1]), _worst(traffic, traffic.expert_shards))


def measured(traffic: Traffic) -> dict[float, factor_rule.Price]:
  """Seconds per step at each factor the run timed (its clean intervals, fallbacks included);
  the worst-case buffer (-1) at its factor."""
  timings = traffic.timings
  if timings is None or not len(timings.seconds):
    return {}
  worst = _worst(traffic, traffic.expert_shards)
  factors = [factor_in_force(float(f), worst) for f in timings.factors]
  return factor_rule.measured_prices(factors, timings.steps, timings.seconds)


def advise(traffic: Traffic, *, rule: factor_rule.Rule, expert_shards: int | None = None,
           factors: Sequence[float] | None = None,
           prices: dict[float, factor_rule.Price] | None = None,
           fits: Callable[[float], bool] = lambda factor: True) -> factor_rule.Advice:
  """The factor rule on `traffic`'s steps (window them with `window`), with `prices` (default:
  the run's measured ones, which hold for its own expert-parallel size only); `factors`
  restricts the candidates (default: the rule's, multiples of 1/8)."""
  shards = traffic.expert_shards if expert_shards is None else expert_shards
  own = shards == traffic.expert_shards
  if prices is None:
    prices = measured(traffic) if own else {}
  return factor_rule.advise(required_factors(traffic, shards), worst_case=_worst(traffic, shards),
                            rule=rule, prices=prices, current=run_factor(traffic) if own else None,
                            fits=fits, factors=factors)


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
  """ValueError unless `layer` (an `moe_hk.MoEConfig` from --`flag`) routes like the recorded
  run: experts and top-K."""
  experts = traffic.counts.shape[-1]
  if (layer.num_experts, layer.num_experts_per_tok) != (experts, traffic.k):
    raise ValueError(f"--{flag} has {layer.num_experts} experts, top-"
                     f"{layer.num_experts_per_tok}; the traffic {experts}, top-{traffic.k}.")
