"""Which `ragged_buffer_factor`: the one rule behind every answer moe-hk gives.

The rule, in two sentences:

  Name the smallest factor whose fallback frequency over the evidence window is at most the
  target (1%) and that fits the memory budget. If that factor's step time was measured, name
  instead the fastest measured factor that falls back on at most `max_frequency` (50%) of the
  window and fits, when it is faster by more than `min_gain` (3%) of a step and by twice the
  two measurements' combined standard error.

With fewer than `min_steps` steps of evidence the rule names nothing; when the factor it names
is the one in force, its answer reads "keep". A price is only ever a measurement taken at that
factor (`Price.basis`: 'measured', the run's own timed intervals at it; 'timed', a capped step
timed apart by `launch.capacity --time_config`), never extrapolated from another factor. The
alerts, the `moe/recommended_ragged_buffer_factor` tag, `launch.capacity` and the autopilot
all call `advise`.

A layer overflows at factor f exactly when its required factor exceeds f (received rows >
floor(N f) <=> received / N > f for whole rows), so replaying the window's required factors
`[steps, layers]` gives each candidate's fallback frequency exactly. Candidates are the
multiples of `FACTOR_STEP` up to the worst case min(P, E / K), the factor in force and the
priced factors. Host-only: numpy, no jax.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

FACTOR_STEP = 0.125  # candidate factors are its multiples (and the worst case)


class Rule(NamedTuple):
  """The rule's settings (`config.autopilot` holds the run's)."""
  target: float = 0.01        # the frequency rule: at most this share of steps fall back
  max_frequency: float = 0.5  # no priced factor falling back more often is named
  min_gain: float = 0.03      # a faster factor must save more than this share of a step
  min_steps: int = 20         # below this many steps of evidence, nothing is named


class Price(NamedTuple):
  """Seconds per step measured at one factor."""
  seconds: float
  se: float    # standard error over the timed intervals (inf: one interval, spread unknown)
  basis: str   # 'measured' (the run's own intervals) or 'timed' (launch.capacity --time_config)

  def __str__(self) -> str:
    error = f" ± {self.se:.2g}" if math.isfinite(self.se) else " (one interval: error unknown)"
    return f"{self.seconds:.4g}{error} s/step {self.basis}"


class Row(NamedTuple):
  """What the evidence says of one candidate factor."""
  factor: float
  fallback_frequency: float  # share of the window's steps with an overflowing layer
  overflowing_layers: float  # overflowing MoE layers per step, averaged
  price: Price | None        # None: never timed at this factor
  fits: bool                 # within the memory budget


class Advice(NamedTuple):
  """The rule's answer on one window."""
  factor: float | None   # the factor to run; None: the evidence names none (`reason` says why)
  reason: str            # one sentence
  rows: tuple[Row, ...]  # every candidate, by factor
  steps: int             # steps of evidence
  basis: str | None      # how `factor` was chosen: 'frequency', 'measured' or 'timed'
  current: float | None  # the factor in force
  rule: Rule             # the settings it was given

  @property
  def enough(self) -> bool:
    """Whether the window held the rule's `min_steps` (below, nothing is named or alerted)."""
    return self.steps >= self.rule.min_steps

  @property
  def keep(self) -> bool:
    """Whether the factor named is the one in force."""
    return (self.factor is not None and self.current is not None and
            math.isclose(self.factor, self.current))


def candidate_factors(worst_case: float, extra: Sequence[float] = ()) -> list[float]:
  """The multiples of `FACTOR_STEP` up to `worst_case` (included), with the `extra` factors
  within it, sorted."""
  top = math.floor(worst_case / FACTOR_STEP + 1e-9)
  grid = {round(FACTOR_STEP * i, 9) for i in range(1, top + 1)} | {float(worst_case)}
  return sorted(grid | {float(f) for f in extra if 0 < f <= worst_case + 1e-9})


def replay(required: np.ndarray, factors: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
  """(fallback frequency, overflowing layers per step), each `[len(factors)]`, of `required
  [steps, layers]` replayed at each factor; zeros without evidence."""
  if required.size == 0:
    return np.zeros(len(factors)), np.zeros(len(factors))
  over = required[None] > np.asarray(factors, np.float64)[:, None, None]  # [F, steps, layers]
  return over.any(axis=2).mean(axis=1), over.sum(axis=2).mean(axis=1)


def measured_prices(factors: Sequence[float], steps: Sequence[int], seconds: Sequence[float],
                    basis: str = "measured") -> dict[float, Price]:
  """`{factor: Price}` of timed intervals (`steps[i]` steps at `factors[i]` in `seconds[i]`):
  all seconds over all steps at a factor, the error from the spread of its intervals' rates."""
  factors, steps, seconds = (np.asarray(a, np.float64) for a in (factors, steps, seconds))
  prices = {}
  for f in np.unique(factors):
    at = factors == f
    rates = seconds[at] / steps[at]
    se = float(np.std(rates, ddof=1) / math.sqrt(len(rates))) if len(rates) > 1 else math.inf
    prices[float(f)] = Price(float(seconds[at].sum() / steps[at].sum()), se, basis)
  return prices


def advise(required: np.ndarray, *, worst_case: float, rule: Rule = Rule(),
           prices: Mapping[float, Price] | None = None, current: float | None = None,
           fits: Callable[[float], bool] = lambda f: True,
           factors: Sequence[float] | None = None) -> Advice:
  """The rule of the module docstring on `required [steps, layers]` (each step's required
  factor per MoE layer), with `prices` measured at some factors; `factors` replaces the
  default candidates (the factor in force joins either)."""
  required = np.asarray(required, np.float64)
  required = required.reshape(len(required), -1) if required.size else np.zeros((0, 1))
  prices = dict(prices or {})
  grid = (sorted({*map(float, factors), *([] if current is None else [current])})
          if factors is not None else
          candidate_factors(worst_case, [*prices, *([] if current is None else [current])]))
  frequency, layers = replay(required, grid)
  rows = tuple(Row(f, float(q), float(n), _price_at(prices, f), bool(fits(f)))
               for f, q, n in zip(grid, frequency, layers))
  steps = len(required)
  answer = lambda factor, reason, basis=None: Advice(factor, reason, rows, steps, basis, current,
                                                     rule)
  if steps < rule.min_steps:
    return answer(None, f"{steps} of {rule.min_steps} steps of evidence: too few to name a "
                  "factor yet.")
  covering = [r for r in rows if r.fits and r.fallback_frequency <= rule.target]
  if not covering:
    return answer(None, f"no factor that fits the memory budget falls back on at most "
                  f"{rule.target:.0%} of the last {steps} steps.")
  smallest = covering[0]
  faster = _faster(smallest, rows, rule)
  if faster is None:
    return answer(smallest.factor, _frequency_reason(smallest, rule, steps, current),
                  "frequency")
  return answer(faster.factor, _speed_reason(faster, smallest, rule, steps, current),
                faster.price.basis)


def _price_at(prices: Mapping[float, Price], factor: float) -> Price | None:
  return next((p for f, p in prices.items() if math.isclose(f, factor)), None)


def _faster(smallest: Row, rows: Sequence[Row], rule: Rule) -> Row | None:
  """The fastest priced row that may fall back up to `max_frequency`, fits, and beats
  `smallest` (priced) beyond the noise; None when there is none."""
  if smallest.price is None:
    return None
  priced = [r for r in rows if r.price is not None and r.fits and
            r.fallback_frequency <= rule.max_frequency]
  best = min(priced, key=lambda r: r.price.seconds)
  gain = smallest.price.seconds - best.price.seconds
  noise = max(rule.min_gain * smallest.price.seconds, 2 * math.hypot(smallest.price.se,
                                                                      best.price.se))
  return best if gain > noise else None


def _verb(factor: float, current: float | None) -> str:
  keep = current is not None and math.isclose(factor, current)
  return f"keep ragged_buffer_factor={factor:g}" if keep else f"use ragged_buffer_factor={factor:g}"


def _frequency_reason(row: Row, rule: Rule, steps: int, current: float | None) -> str:
  fell_back = round(row.fallback_frequency * steps)
  price = ("it was never timed" if row.price is None else
           f"{row.price}; no measured factor is faster beyond the noise")
  return (f"{_verb(row.factor, current)}: the smallest factor that would have fallen back on "
          f"at most {rule.target:.0%} of the last {steps} steps ({fell_back}); {price}.")


def _speed_reason(row: Row, smallest: Row, rule: Rule, steps: int, current: float | None
                  ) -> str:
  return (f"{_verb(row.factor, current)}: {row.price}, faster beyond the noise than "
          f"{smallest.factor:g} ({smallest.price}), the smallest factor that falls back on at "
          f"most {rule.target:.0%}; it falls back on {row.fallback_frequency:.0%} of the last "
          f"{steps} steps (at most {rule.max_frequency:.0%}).")
