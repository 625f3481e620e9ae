"""Host-side overflow alerts: rules over `StepMetrics`, rate-limited, to three sinks.

Rules:
  fallback_ran          a MoE layer fell back this step
  frequent_fallback     fallback frequency over the trailing window above a threshold
  rows_dropped          the capped buffer dropped rows (the fallback is off)
  near_worst_case       the required factor came within a margin of the worst case

Each alert names the layers, since when the condition holds, how often it happens, and the
`ragged_buffer_factor` that would have avoided overflow in the trailing window's quantile.
Sinks: absl `logging.warning`, `alerts.jsonl` in the workdir (one JSON object a line), and an
optional callable. A rule fires at most once every `min_steps_between` steps.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from typing import Callable, NamedTuple

from absl import logging

from metrics.aggregator import StepMetrics


@dataclasses.dataclass(frozen=True)
class AlertConfig:
  frequency_threshold: float = 0.1   # frequent_fallback fires above this fraction of steps.
  near_worst_fraction: float = 0.9   # near_worst_case fires at this fraction of the worst case.
  min_steps_between: int = 100       # rate limit per rule, in steps.


class Alert(NamedTuple):
  time: float
  step: int
  rule: str
  layers: list
  since: int
  frequency: float
  required_factor: float
  recommended_ragged_buffer_factor: float
  message: str


def _round_up(factor: float) -> float:
  """A factor to recommend: the next multiple of 0.05 at or above `factor`."""
  return math.ceil(factor * 20 - 1e-9) / 20


class AlertManager:
  """Checks each step's metrics and sends alerts.

  `worst_case_factor` is the factor of the worst-case buffer, min(P, E / K): the
  near_worst_case rule compares against it.
  """

  def __init__(self, *, worst_case_factor: float, workdir: str | None = None,
               callback: Callable[[Alert], None] | None = None,
               config: AlertConfig = AlertConfig()):
    self.worst_case_factor = worst_case_factor
    self.config = config
    self.callback = callback
    self.path = os.path.join(workdir, "alerts.jsonl") if workdir else None
    self._since: dict[str, int] = {}
    self._last_sent: dict[str, int] = {}
    self._lock = threading.Lock()

  def _conditions(self, m: StepMetrics) -> dict[str, list[int]]:
    """Rule -> layers it concerns, for the rules that hold at this step."""
    layers = m.layers.items()
    held = {
        "fallback_ran": [i for i, r in layers if r.fallback],
        "rows_dropped": [i for i, r in layers if r.dropped_rows > 0],
        "near_worst_case": [i for i, r in layers if r.required_factor >=
                            self.config.near_worst_fraction * self.worst_case_factor],
    }
    if m.fallback_frequency > self.config.frequency_threshold:
      held["frequent_fallback"] = [i for i, r in layers if r.fallback or r.would_drop_rows]
    return {rule: ls for rule, ls in held.items() if ls or rule == "frequent_fallback"}

  def check(self, m: StepMetrics) -> list[Alert]:
    """Returns (and sends) the alerts of this step."""
    alerts = []
    with self._lock:
      held = self._conditions(m)
      for rule in list(self._since):
        if rule not in held:
          del self._since[rule]
      for rule, layers in held.items():
        since = self._since.setdefault(rule, m.step)
        last = self._last_sent.get(rule)
        if last is not None and m.step - last < self.config.min_steps_between:
          continue
        self._last_sent[rule] = m.step
        alerts.append(self._alert(m, rule, layers, since))
    for alert in alerts:
      self._send(alert)
    return alerts

  def _alert(self, m: StepMetrics, rule: str, layers: list[int], since: int) -> Alert:
    recommended = _round_up(m.recommended_factor)
    what = {
        "fallback_ran": "ran the dropless fallback",
        "rows_dropped": f"dropped {m.dropped_rows_fraction:.2%} of routed rows",
        "near_worst_case": (f"needed a buffer factor of {m.required_factor:.3g}, within "
                            f"{1 - self.config.near_worst_fraction:.0%} of the worst case "
                            f"{self.worst_case_factor:.3g}"),
        "frequent_fallback": (f"overflowed on {m.fallback_frequency:.0%} of recent steps "
                              f"(threshold {self.config.frequency_threshold:.0%})"),
    }[rule]
    message = (f"MoE overflow [{rule}] at step {m.step}: layers {layers} {what}; since step "
               f"{since}, fallback frequency {m.fallback_frequency:.0%}, required factor "
               f"{m.required_factor:.3g}; ragged_buffer_factor={recommended} would have "
               f"avoided overflow in the recent window.")
    return Alert(time=time.time(), step=m.step, rule=rule, layers=layers, since=since,
                 frequency=m.fallback_frequency, required_factor=m.required_factor,
                 recommended_ragged_buffer_factor=recommended, message=message)

  def _send(self, alert: Alert) -> None:
    logging.warning(alert.message)
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps(alert._asdict()) + "\n")
    if self.callback is not None:
      self.callback(alert)
