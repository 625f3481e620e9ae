"""One rule for "which `ragged_buffer_factor`", shared by the alerts' recommendation, the
planner's pick (`launch.capacity`) and the buffer-factor autopilot.

The evidence is the same for all three: the required buffer factors of recent steps, per MoE
layer (`required [steps, layers]`, the traffic), and, once the run has timed steps, a price:
predicted seconds per step at a factor (`Price`, from the run's timed intervals). A layer
overflows at factor f exactly when its required factor exceeds f (received rows > floor(N f)
<=> received / N > f for whole rows), so replaying the evidence gives each candidate's fallback
frequency (steps with an overflowing layer) and overflowing layers per step exactly.

Candidates are the multiples of `FACTOR_STEP` up to the worst case min(P, E / K), and the
factor in force. The rule (`advise`):

* A candidate whose fallback frequency on the evidence is above `max_frequency` is never
  named, nor one that does not fit the memory budget (`fits`).
* With a price (objective `'throughput'`): the candidate with the fewest predicted seconds per
  step. It is named when it is the factor in force, or when it beats the factor in force by
  more than `min_gain` of a step and by twice the two predictions' combined standard error, or
  when the factor in force is itself not admissible. Otherwise the evidence cannot separate
  the two, and no factor is named (the reason says which two, with their prices).
  A price that is only a lower bound (the matmul FLOPs scaled down from a bigger measured
  buffer: they overstate a smaller buffer's saving) is never named. When such a candidate
  beats the factor the rule keeps by the same margin, the evidence cannot decide either: no
  factor is named, and that candidate is the one to time (`Advice.trial`: `launch.capacity
  --time_config` times it apart, the autopilot tries it and its intervals then price it).
* Without a price (objective `'fallback_frequency'`): the smallest candidate whose fallback
  frequency on the evidence is at most `target`: with the default 1%, the smallest factor that
  would have avoided the fallback on all but 1% of the evidence's steps (on all of them when
  the evidence is shorter than 100 steps).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

FACTOR_STEP = 0.125  # candidate factors are its multiples (and the worst case)

# price(factor, overflowing layers per step) -> (seconds per step, its standard error,
# whether the seconds are only a lower bound).
Price = Callable[[float, float], tuple[float, float, bool]]


class Candidate(NamedTuple):
  """What the evidence says of one factor."""
  factor: float
  fallback_frequency: float   # fraction of the evidence's steps with an overflowing layer
  overflowing_layers: float   # overflowing MoE layers per step, averaged
  seconds: float = math.nan   # predicted seconds per step (NaN without a price)
  se: float = math.nan        # its standard error (inf: one interval, no spread measured)
  lower_bound: bool = False   # the seconds are only a lower bound (never named)


class Advice(NamedTuple):
  """The rule's answer."""
  factor: float | None        # the factor to run; None: the evidence names none
  objective: str              # 'throughput' (priced) or 'fallback_frequency'
  reason: str                 # one sentence: what the factor optimises, or why there is none
  candidates: tuple[Candidate, ...]
  trial: float | None = None  # a factor priced by a lower bound that might beat the pick


def candidate_factors(worst_case: float, step: float = FACTOR_STEP,
                      extra: Sequence[float] = ()) -> list[float]:
  """The multiples of `step` up to `worst_case` (included), with `extra` factors, sorted."""
  top = math.floor(worst_case / step + 1e-9)
  factors = {round(step * i, 9) for i in range(1, top + 1)} | {float(worst_case)}
  return sorted(factors | {float(f) for f in extra if 0 < f <= worst_case})


def replay(required: np.ndarray, factor: float) -> tuple[float, float]:
  """(fallback frequency, overflowing layers per step) at `factor` of `required [steps,
  layers]`; (0, 0) without evidence."""
  if required.size == 0:
    return 0.0, 0.0
  overflowing = required > factor
  return float(np.mean(overflowing.any(axis=1))), float(np.mean(overflowing.sum(axis=1)))


def advise(required: np.ndarray, *, worst_case: float, current: float | None = None,
           max_frequency: float = 0.5, target: float = 0.01, price: Price | None = None,
           min_gain: float = 0.03, fits: Callable[[float], bool] = lambda f: True,
           factors: Sequence[float] | None = None) -> Advice:
  """The rule of the module docstring on `required [steps, layers]` (the evidence's required
  factors); `factors` replaces the default candidates (the factor in force joins them)."""
  required = np.asarray(required, np.float64).reshape(len(required), -1)
  grid = candidate_factors(worst_case, extra=[] if current is None else [current])
  if factors is not None:
    grid = sorted({*map(float, factors), *([] if current is None else [current])})
  candidates = []
  for f in grid:
    frequency, layers = replay(required, f)
    priced = price(f, layers) if price is not None else (math.nan, math.nan, False)
    candidates.append(Candidate(f, frequency, layers, *priced))
  admissible = [c for c in candidates if c.fallback_frequency <= max_frequency and fits(c.factor)]
  steps = len(required)
  if not admissible:
    return Advice(None, "throughput" if price else "fallback_frequency",
                  f"no candidate both fits the memory budget and falls back on at most "
                  f"{max_frequency:.0%} of the last {steps} steps.", tuple(candidates))
  if price is None:
    return _covering(candidates, admissible, target, steps)
  return _fastest(candidates, admissible, current, min_gain, steps)


def _covering(candidates: list[Candidate], admissible: list[Candidate], target: float,
              steps: int) -> Advice:
  """The smallest admissible factor whose fallback frequency is at most `target`."""
  covering = [c for c in admissible if c.fallback_frequency <= target]
  if not covering:  # the worst case never overflows: only a memory budget excludes it
    return Advice(None, "fallback_frequency", f"no factor that fits falls back on at most "
                  f"{target:.0%} of the last {steps} steps.", tuple(candidates))
  pick = min(covering, key=lambda c: c.factor)
  fell_back = round(pick.fallback_frequency * steps)
  return Advice(pick.factor, "fallback_frequency",
                f"ragged_buffer_factor={pick.factor:g} would have run the fallback on {fell_back} "
                f"of the last {steps} steps (the smallest factor at most {target:.0%}; no step "
                "timings to price factors by).", tuple(candidates))


def _fastest(candidates: list[Candidate], admissible: list[Candidate], current: float | None,
             min_gain: float, steps: int) -> Advice:
  """The fastest admissible factor with an estimated price, when the prices separate it from
  the factor in force and no lower bound promises more (module docstring)."""
  priced = [c for c in admissible if math.isfinite(c.seconds)]
  now = next((c for c in candidates if current is not None and c.factor == current), None)
  advice = _fastest_estimated(candidates, [c for c in priced if not c.lower_bound], now,
                              admissible, min_gain, steps)
  bounds = [c for c in priced if c.lower_bound]
  by_factor = {c.factor: c for c in candidates}
  kept = now if advice.factor is None else by_factor[advice.factor]
  if not bounds or kept is None:
    return advice
  trial = min(bounds, key=lambda c: c.seconds)
  if not _beats(trial, kept, min_gain):
    return advice
  bound = (f"ragged_buffer_factor={trial.factor:g} may be faster than {kept.factor:g} "
           f"({_price(kept)}), but its price, {_price(trial)}, is only a lower bound (the "
           "matmul FLOPs scaled down from a bigger measured buffer overstate its saving)")
  timing = (f"time {trial.factor:g} (launch.capacity --time_config=<the run's config>) or let "
            "the autopilot try it")
  if kept is not now:  # a move the estimates support: named, with the bound beside it
    return advice._replace(reason=f"{advice.reason} {bound}: {timing}.", trial=trial.factor)
  return Advice(None, "throughput", f"the evidence cannot decide: {bound}; keep "
                f"{kept.factor:g} or {timing}.", tuple(candidates), trial.factor)


def _beats(new: Candidate, old: Candidate, min_gain: float) -> bool:
  """Whether `new` saves more than `min_gain` of `old`'s step and twice their combined
  standard error (never when an error is unknown)."""
  gain = old.seconds - new.seconds
  return gain > max(min_gain * old.seconds, 2 * math.hypot(old.se, new.se))


def _fastest_estimated(candidates: list[Candidate], priced: list[Candidate],
                       now: Candidate | None, admissible: list[Candidate], min_gain: float,
                       steps: int) -> Advice:
  """The fastest of `priced` (admissible, estimated prices), when the prices separate it from
  the factor in force (`now`)."""
  if not priced:
    return Advice(None, "throughput", "no admissible factor could be priced.", tuple(candidates))
  best = min(priced, key=lambda c: c.seconds)
  chosen = (f"ragged_buffer_factor={best.factor:g}: the fewest predicted seconds per step "
            f"({_price(best)}) among the factors that fall back on at most the allowed share of "
            f"the last {steps} steps")
  if now is None or now.factor == best.factor or now not in admissible:
    return Advice(best.factor, "throughput", chosen + ".", tuple(candidates))
  if _beats(best, now, min_gain):
    return Advice(best.factor, "throughput",
                  f"{chosen}; the factor in force, {now.factor:g}, takes {_price(now)}.",
                  tuple(candidates))
  why = ("its error is unknown (one timed interval)" if not math.isfinite(now.se + best.se) else
         f"the gain is within twice the error or below {min_gain:.0%} of a step")
  return Advice(None, "throughput",
                f"the timings cannot separate ragged_buffer_factor={best.factor:g} "
                f"({_price(best)}) from the factor in force, {now.factor:g} ({_price(now)}): "
                f"{why}; keep {now.factor:g} or time more steps.", tuple(candidates))


def _price(c: Candidate) -> str:
  """`0.4139 ± 0.0012 s/step`, or without the error when it is not known."""
  if math.isfinite(c.se):
    return f"{c.seconds:.4g} ± {c.se:.2g} s/step"
  return f"{c.seconds:.4g} s/step, error unknown"
