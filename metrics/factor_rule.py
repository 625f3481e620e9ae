"""Which `ragged_buffer_factor`: the one rule behind every answer moe-hk gives.

The rule, in two sentences:

  Name the smallest factor that would have fallen back on at most the target (1%) of the
  window's steps and fits the memory budget, unless a smaller factor that falls back on at
  most `max_frequency` (50%) of them and fits was measured: then name the fastest such
  measured factor. A measured frequency pick, or else the factor in force, is kept unless that
  factor beats it by more than `min_gain` (3%) of a step and twice their combined standard
  error.

Why smaller factors only: every factor above the frequency pick falls back as rarely and has a
bigger buffer, so the pick is at least as fast; a smaller one falls back more often, and only
its measured steps (fallbacks included) can say whether its smaller buffer wins.

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
  best, beaten = _measured_below(smallest, rows, rule, current)
  if best is smallest:
    return answer(smallest.factor, _frequency_reason(smallest, rule, steps, current),
                  "frequency" if smallest.price is None else smallest.price.basis)
  return answer(best.factor, _speed_reason(best, smallest, beaten, rule, steps, current),
                best.price.basis)


def _measured_below(smallest: Row, rows: Sequence[Row], rule: Rule, current: float | None
                    ) -> tuple[Row, Row | None]:
  """(the row the rule names, the measured row it beats beyond the noise or None): the
  fastest measured row below the frequency pick `smallest` that falls back on at most
  `max_frequency` and fits, unless the measured pick, or else the factor in force, is within
  the noise of it; `smallest` when no such row was measured."""
  below = [r for r in rows if r.factor < smallest.factor and r.price is not None and r.fits
           and r.fallback_frequency <= rule.max_frequency]
  if not below:
    return smallest, None
  best = min(below, key=lambda r: r.price.seconds)
  now = next((r for r in below if current is not None and math.isclose(r.factor, current)), None)
  kept = smallest if smallest.price is not None else now
  if kept is None:
    return best, None
  return (kept, None) if kept is best or not _beats(best, kept, rule) else (best, kept)


def _price_at(prices: Mapping[float, Price], factor: float) -> Price | None:
  return next((p for f, p in prices.items() if math.isclose(f, factor)), None)


def _beats(new: Row, old: Row, rule: Rule) -> bool:
  """Whether `new` saves more than `min_gain` of `old`'s step and twice their combined
  standard error (never when an error is unknown)."""
  gain = old.price.seconds - new.price.seconds
  return gain > max(rule.min_gain * old.price.seconds, 2 * math.hypot(old.price.se, new.price.se))


def _verb(factor: float, current: float | None) -> str:
  keep = current is not None and math.isclose(factor, current)
  return f"keep ragged_buffer_factor={factor:g}" if keep else f"use ragged_buffer_factor={factor:g}"


def _frequency_reason(row: Row, rule: Rule, steps: int, current: float | None) -> str:
  fell_back = round(row.fallback_frequency * steps)
  price = ("it was never timed" if row.price is None else
           f"{row.price}; no smaller measured factor is faster beyond the noise")
  return (f"{_verb(row.factor, current)}: the smallest factor that would have fallen back on "
          f"at most {rule.target:.0%} of the last {steps} steps ({fell_back}); {price}.")


def _speed_reason(row: Row, smallest: Row, beaten: Row | None, rule: Rule, steps: int,
                  current: float | None) -> str:
  """Why a measured factor below the frequency pick (`smallest`) is named; `beaten`: the
  measured factor it beats beyond the noise (None: it is kept within the noise)."""
  why = (f"faster beyond the noise than {beaten.factor:g} ({beaten.price})" if beaten else
         "no measured factor is faster beyond the noise")
  pick = ("" if smallest is beaten else
          f"; {smallest.factor:g}, the smallest factor that falls back on at most "
          f"{rule.target:.0%}, " + ("was never timed" if smallest.price is None else
                                    f"takes {smallest.price}"))
  return (f"{_verb(row.factor, current)}: {row.price}, falling back on "
          f"{row.fallback_frequency:.0%} of the last {steps} steps (at most "
          f"{rule.max_frequency:.0%}); {why}{pick}.")
