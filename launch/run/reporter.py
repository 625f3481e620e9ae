"""`Reporter`: fetches the training loop's finished steps from the device and hands them, as
records, to the run's consumers.

The train step's outputs stay on the device until the loop fetches a batch of them (every
`config.log_every` steps, and before an eval, a checkpoint or a stop); `Reporter.flush`
fetches them in one transfer, makes one `StepRecord` per step and one `IntervalRecord` per
fetch (`launch.run.records`), and hands each to every consumer registered in its
`Hooks` (`launch.run.hooks`), in order. It also judges how the fetch's time may be
read: the first fetch's time is mostly compilation, a fetch cut short by a stop may be one
step of the host's work, and one that held more than its steps (an eval, a checkpoint, a
switch of program, the autopilot's background compile) says nothing of a step's time.
"""
from __future__ import annotations

import time
from typing import Callable

import jax

from launch.run.hooks import Hooks
from launch.run.records import IntervalRecord, Pending, step_records


class Reporter:
  """Fetches pending steps and hands their records to `hooks`. `compiles()` says how many
  background compiles have started and whether one is under way (the autopilot's; (0, False)
  without one)."""

  def __init__(self, hooks: Hooks, compiles: Callable[[], tuple[int, bool]]):
    self.hooks = hooks
    self._compile_state = compiles
    self._since = time.perf_counter()
    self._compiled = False  # whether the fetch that compiled the step has been reported
    # Whether the interval under way holds more than its steps.
    self._disturbed = False
    self._compiles = compiles()

  def disturbed(self) -> None:
    """The interval under way also did other work than its steps: do not time it."""
    self._disturbed = True

  def flush(self, pending: list[Pending], stopping: bool = False, cut_short: bool = False
            ) -> IntervalRecord | None:
    """Fetches and reports `pending` (then empties it); returns the fetch's record (None when
    nothing was pending). `stopping`: the run stops after it (its progress line shows no
    ETA); `cut_short`: a stop ended it before its boundary (no speed either)."""
    if not pending:
      return None
    fetched = jax.device_get([p.outputs for p in pending])
    # From fetch to fetch: the interval's time includes the host's work for the one before.
    now = time.perf_counter()
    seconds, self._since = now - self._since, now
    records = step_records(pending, fetched)
    for record in records:
      self.hooks.step(record)
    # After the steps' consumers: a compile the autopilot started on them disturbs the interval.
    interval = IntervalRecord(tuple(records), seconds, timed=self._compiled and not cut_short,
                              clean=self._timed_cleanly(), stopping=stopping,
                              cut_short=cut_short)
    self._compiled = True
    self.hooks.interval(interval)
    pending.clear()
    return interval

  def _timed_cleanly(self) -> bool:
    """Whether the interval just fetched timed its steps alone: it was not the first, nothing
    else disturbed it, and no background compile was under way at either end or started in
    between."""
    compiles = self._compile_state()
    clean = (self._compiled and not self._disturbed and compiles == self._compiles and
             not compiles[1])
    self._disturbed, self._compiles = False, compiles
    return clean
