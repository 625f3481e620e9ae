"""`Alert` and `AlertSink`: every alert of a run, whoever raises it, through one rate limiter to
one set of outputs.

An alert is its step, its rule, its message and the rule's own fields (`details`). The sink
sends it to absl `logging.warning`, to `alerts.jsonl` in the workdir (one JSON object a line:
`time`, `step`, `rule`, `message` and the details' fields beside them) and to an optional
callable. A rate-limited rule fires at most once every `min_steps_between` steps; the limit's
state travels with checkpoints (`state_dict`). Host-only: no jax.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, NamedTuple

from absl import logging

ALERTS_FILE = "alerts.jsonl"  # in the workdir: one JSON object per alert


class Alert(NamedTuple):
  """One alert: `details` holds its rule's fields (docs/metrics.md lists them per rule)."""
  step: int
  rule: str
  message: str
  details: dict

  def line(self, when: float) -> dict:
    """The alert as `alerts.jsonl` holds it, sent at time `when` (seconds since the epoch)."""
    return {"time": when, "step": self.step, "rule": self.rule, **self.details,
            "message": self.message}


class AlertSink:
  """Sends alerts: to the log when `log`, to `workdir/alerts.jsonl` when `workdir`, to
  `callback` when given; a rate-limited alert only when its rule last fired at least
  `min_steps_between` steps before. Thread-safe."""

  def __init__(self, *, min_steps_between: int, workdir: str | None = None,
               callback: Callable[[Alert], None] | None = None, log: bool = True):
    self.min_steps_between = min_steps_between
    self.path = os.path.join(workdir, ALERTS_FILE) if workdir else None
    self.callback = callback
    self.log = log
    self._last_sent: dict[str, int] = {}  # rule -> step of its last rate-limited alert
    self._lock = threading.Lock()

  def due(self, rule: str, step: int) -> bool:
    """Whether a rate-limited `rule` may fire at `step`; if so, it counts as fired there."""
    with self._lock:
      last = self._last_sent.get(rule)
      if last is not None and step - last < self.min_steps_between:
        return False
      self._last_sent[rule] = step
      return True

  def send(self, alert: Alert, *, limited: bool = True) -> bool:
    """Sends `alert` unless the rate limit holds it back (`limited=False`: never held back);
    whether it went out."""
    if limited and not self.due(alert.rule, alert.step):
      return False
    with self._lock:
      if self.log:
        logging.warning(alert.message)
      if self.path:
        with open(self.path, "a") as f:
          f.write(json.dumps(alert.line(time.time())) + "\n")
    if self.callback is not None:
      self.callback(alert)
    return True

  def state_dict(self) -> dict:
    """Each rate-limited rule's last firing, JSON-serialisable (for checkpoints)."""
    with self._lock:
      return {"last_sent": dict(self._last_sent)}

  def load_state_dict(self, state: dict) -> None:
    with self._lock:
      self._last_sent = {rule: int(step) for rule, step in state["last_sent"].items()}
