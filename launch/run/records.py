"""The records the training loop hands its consumers: one per finished step, one per fetch.

The train step's outputs (`launch.model.train_step.StepOutputs`) stay on the device as a
`Pending` step until the loop fetches a batch of them; `step_records` turns each fetched step
into a `StepRecord` (host values only), once, and the fetch becomes an `IntervalRecord`. Every
consumer (`launch.run.hooks`) reads these and nothing else of the step.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from launch.model.spikes import SpikeCheck
from launch.model.train_step import StepOutputs
from moe_hk.stats import MoEStats


class Pending(NamedTuple):
  """A step whose outputs are still on the device."""
  step: int
  outputs: StepOutputs   # device arrays
  factor: float          # the ragged_buffer_factor of the program that ran it
  # The step compiled its program: the seconds it took, compile included; None: it ran one
  # already compiled.
  compile_seconds: float | None = None


class Spike(NamedTuple):
  """The spike test of one step (`config.spikes.enabled`): its loss or gradient norm against
  the window of recent applied steps."""
  spiked: bool                  # above the window's mean by `config.spikes.sigma` deviations
  mean: tuple[float, float]     # the window's (loss, gradient norm) means
  std: tuple[float, float]      # ... and deviations


class StepRecord(NamedTuple):
  """One finished train step, fetched."""
  step: int
  factor: float                 # the ragged_buffer_factor of the program that ran it
  loss: float                   # cross-entropy
  grad_norm: float
  learning_rate: float
  skipped: bool                 # the loss or gradient norm was not finite
  spike: Spike | None           # None: spike detection is off
  dropless: bool | None         # step mode: it ran dropless from an overflowing layer on
  moe_stats: MoEStats           # numpy, fields `[layers, ...]`
  compile_seconds: float | None  # it compiled its program: its seconds, compile included

  @property
  def fell_back(self) -> bool:
    """Whether a MoE layer ran the dropless fallback."""
    return bool(np.any(self.moe_stats.fallback))

  @property
  def dropped_rows(self) -> int:
    """Rows the MoE layers dropped (none with a fallback)."""
    return int(np.sum(self.moe_stats.dropped_rows))

  @property
  def spiked(self) -> bool:
    return self.spike is not None and self.spike.spiked

  @property
  def unapplied(self) -> bool:
    """Whether its update was skipped or caught as a spike (the state did not take it)."""
    return self.skipped or self.spiked


class IntervalRecord(NamedTuple):
  """The steps of one fetch and how their time may be read."""
  steps: tuple[StepRecord, ...]  # in order; never empty
  seconds: float                 # from the previous fetch to this one
  timed: bool        # the time is its steps' (not the compile's, nor a stop's host work)
  clean: bool        # timed with nothing else in it (no eval, checkpoint, switch, compile)
  stopping: bool     # the run stops after it
  cut_short: bool    # a stop ended it before its boundary

  @property
  def last(self) -> StepRecord:
    return self.steps[-1]

  @property
  def factors(self) -> set[float]:
    """The buffer factors its steps ran."""
    return {r.factor for r in self.steps}

  def unapplied_in_a_row(self, before: int) -> int:
    """The steps in a row through its last whose update the state did not take (`unapplied`),
    `before` such steps in a row having ended just before its first."""
    count = before
    for record in self.steps:
      count = count + 1 if record.unapplied else 0
    return count


def _spike(check: SpikeCheck | None) -> Spike | None:
  if check is None:
    return None
  return Spike(bool(check.spike), tuple(map(float, check.mean)), tuple(map(float, check.std)))


def step_records(pending: Sequence[Pending], fetched: Sequence[StepOutputs]
                 ) -> list[StepRecord]:
  """The records of the `pending` steps from their fetched (numpy) outputs, in order."""
  return [StepRecord(
      step=p.step, factor=float(p.factor), loss=float(out.loss), grad_norm=float(out.grad_norm),
      learning_rate=float(out.learning_rate), skipped=bool(out.skipped), spike=_spike(out.spike),
      dropless=None if out.dropless is None else bool(out.dropless), moe_stats=out.moe_stats,
      compile_seconds=p.compile_seconds) for p, out in zip(pending, fetched)]
