"""`Evidence`: the one home of what the buffer-factor rule weighs during a run.

It holds the trailing window of finished steps (each MoE layer's required factor, whether the
step fell back), the cleanly timed intervals (n steps at one factor in s seconds), the factors
whose programs did not fit the memory budget, and the factor in force. `add_step` evaluates
the rule (`metrics.factor_rule.advise`) once per finished step; the aggregator's step metrics,
the alerts, the recommendation tag and the autopilot read that one `advice`. `state_dict`
travels in the checkpoint, so a resumed run weighs what the uninterrupted one would have.
Host-only: numpy, no jax.
"""
from __future__ import annotations

import collections
import math
from typing import Sequence

import numpy as np

from metrics import factor_rule


class Evidence:
  """The factor rule's window and timings; `worst_case` is min(P, E / K), the largest
  candidate (None: the largest required factor seen); `priced=False` makes the rule ignore
  the timings (the autopilot's 'fallback_frequency' objective)."""

  def __init__(self, *, worst_case: float | None, factor: float | None = None,
               rule: factor_rule.Rule = factor_rule.Rule(), window: int = 100,
               priced: bool = True, max_intervals: int = 256):
    if window < 1:
      raise ValueError(f"Evidence(window={window}): need window >= 1.")
    self.worst_case = worst_case
    self.factor = factor  # the factor in force (None: not known, e.g. a bare layer's)
    self.rule = rule
    self.priced = priced
    self.refused: set[float] = set()  # factors whose program did not fit the memory budget
    self._required = collections.deque(maxlen=window)   # per step: (factor per layer, ...)
    self._fell_back = collections.deque(maxlen=window)
    self._intervals = collections.deque(maxlen=max_intervals)  # (factor, steps, seconds)
    self.advice = self._advise()

  @property
  def window(self) -> int:
    return self._required.maxlen

  @property
  def steps(self) -> int:
    """Steps in the window."""
    return len(self._required)

  def add_step(self, required: Sequence[float], fell_back: bool) -> factor_rule.Advice:
    """One finished step: its required factor per MoE layer and whether any layer fell back.
    Evaluates the rule on the new window (`advice`) and returns it."""
    self._required.append(tuple(float(f) for f in np.atleast_1d(required)))
    self._fell_back.append(bool(fell_back))
    self.advice = self._advise()
    return self.advice

  def add_interval(self, factor: float, steps: int, seconds: float) -> None:
    """A cleanly timed interval: `steps` steps at `factor` took `seconds` (fallbacks
    included); it prices `factor` from the next step's advice on."""
    self._intervals.append((float(factor), int(steps), float(seconds)))

  def refuse(self, factor: float) -> None:
    """`factor`'s program did not fit the memory budget: from now on no factor from it up
    fits (`fits`)."""
    self.refused.add(float(factor))
    self.advice = self._advise()

  def set_factor(self, factor: float) -> None:
    """The factor in force is now `factor` (the advice says "keep" of it)."""
    self.factor = float(factor)
    self.advice = self._advise()

  def frequency(self, recent: int | None = None) -> float:
    """Share of the window's steps (of its last `recent`) that fell back; 0 without steps."""
    fell_back = list(self._fell_back)[-recent:] if recent else self._fell_back
    return float(np.mean(fell_back)) if fell_back else 0.0

  def required(self) -> np.ndarray:
    """`[steps, layers]`: the window's required factors (a layer a step did not report: 0)."""
    width = max((len(r) for r in self._required), default=1)
    return np.array([r + (0.0,) * (width - len(r)) for r in self._required]).reshape(-1, width)

  def prices(self) -> dict[float, factor_rule.Price]:
    """Seconds per step measured at each factor the run timed."""
    if not self._intervals:
      return {}
    return factor_rule.measured_prices(*zip(*self._intervals))

  def fits(self, factor: float) -> bool:
    """Whether `factor`'s program may fit: memory grows with the factor, so none from the
    smallest refused one up."""
    return not self.refused or factor < min(self.refused) - 1e-9

  def smallest(self, above: float, frequency: float) -> float | None:
    """The smallest candidate above `above` that fits and would have fallen back on at most
    `frequency` of the window (the autopilot's guard)."""
    rows = self.advice.rows
    return next((r.factor for r in rows if r.factor > above + 1e-9 and r.fits and
                 r.fallback_frequency <= frequency), None)

  def _advise(self) -> factor_rule.Advice:
    required = self.required()
    worst = self.worst_case
    if worst is None:
      worst = max(float(required.max(initial=0.0)), self.factor or 0.0, factor_rule.FACTOR_STEP)
    return factor_rule.advise(required, worst_case=worst, rule=self.rule,
                              prices=self.prices() if self.priced else None,
                              current=self.factor, fits=self.fits)

  def state_dict(self) -> dict:
    """JSON-serialisable, for checkpoints."""
    return {"factor": self.factor, "required": [list(r) for r in self._required],
            "fell_back": [bool(v) for v in self._fell_back],
            "intervals": [list(i) for i in self._intervals], "refused": sorted(self.refused)}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()` (and the windows of checkpoints written before this class)."""
    # A state without a factor (a converted checkpoint's, older ones) keeps the run's.
    factor = state.get("factor")
    self.factor = self.factor if factor is None or not math.isfinite(factor) else float(factor)
    self._required.clear()
    self._required.extend(tuple(np.atleast_1d(np.asarray(r, float)).tolist())
                          for r in state.get("required", []))
    self._fell_back.clear()
    self._fell_back.extend(bool(v) for v in state.get("fell_back", []))
    self._intervals.clear()
    # Intervals of older checkpoints also held the fallback chunks: (factor, steps, chunks, s).
    self._intervals.extend((float(i[0]), int(i[1]), float(i[-1]))
                           for i in state.get("intervals", []))
    self.refused = {float(f) for f in state.get("refused", [])}
    self.advice = self._advise()
