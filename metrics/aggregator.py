"""Host-side aggregation of MoE layer events into one record per (step, layer) and step metrics.

Events arrive from `jax.debug.callback` on arbitrary threads and with duplicates: another copy
when a rematerialised forward is recomputed under grad, one per process in multi-process runs.
Every copy of one (step, layer, attempt) carries the same global stats, so the first is kept
and later copies only add their shard to the record's set of reporters. A step-mode replay (attempt 1) replaces
the discarded attempt's records. Memory is bounded: at most `max_open_steps` unfinished steps
and fixed-size trailing windows.
"""
from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import numpy as np

from metrics.emit import FALLBACK_EVENT, LayerEvent


class LayerRecord(NamedTuple):
  """One MoE layer in one step, deduplicated."""
  attempt: int
  fallback: bool
  required_factor: float
  would_drop_rows: int
  dropped_rows: int
  routed_rows: int
  tokens_per_expert: np.ndarray  # [E]
  shards: frozenset              # devices whose events arrived


class StepMetrics(NamedTuple):
  """What the writers and alerts see for one finished step."""
  step: int
  layers: dict                   # layer ordinal -> LayerRecord
  fallback_layers: int           # MoE layers whose dropless fallback ran
  required_factor: float         # max over layers
  dropped_rows_fraction: float   # dropped rows / routed rows, over layers
  fallback_frequency: float      # fraction of the trailing window's steps with a fallback
  recommended_factor: float      # quantile of the trailing window's required factors
  replayed: bool                 # the step's records come from a step-mode replay


def _record(event: LayerEvent) -> LayerRecord:
  s = event.stats
  return LayerRecord(
      attempt=event.attempt, fallback=bool(s.fallback) or event.name == FALLBACK_EVENT,
      required_factor=float(s.required_factor), would_drop_rows=int(s.would_drop_rows),
      dropped_rows=int(s.dropped_rows), routed_rows=int(np.sum(s.tokens_per_expert)),
      tokens_per_expert=np.asarray(s.tokens_per_expert), shards=frozenset([event.shard]))


class Aggregator:
  """Collects `LayerEvent`s (it is a sink: `metrics.emit.add_sink(aggregator)`)."""

  def __init__(self, window: int = 100, quantile: float = 0.99, max_open_steps: int = 64):
    if window < 1 or not 0 < quantile <= 1 or max_open_steps < 1:
      raise ValueError(f"Aggregator(window={window}, quantile={quantile}, max_open_steps="
                       f"{max_open_steps}): need window >= 1, 0 < quantile <= 1, "
                       "max_open_steps >= 1.")
    self.quantile = quantile
    self.max_open_steps = max_open_steps
    self._lock = threading.Lock()
    self._open: dict[int, dict[int, LayerRecord]] = {}
    self._finished_through = -1
    self._fell_back = collections.deque(maxlen=window)
    self._factors = collections.deque(maxlen=window)
    self.late_events = 0      # events for steps already finished (not counted)
    self.evicted_steps = 0    # unfinished steps dropped to bound memory

  def __call__(self, event: LayerEvent) -> None:
    with self._lock:
      if event.step <= self._finished_through:
        self.late_events += 1
        return
      layers = self._open.get(event.step)
      if layers is None:
        if len(self._open) >= self.max_open_steps:
          del self._open[min(self._open)]
          self.evicted_steps += 1
        layers = self._open[event.step] = {}
      old = layers.get(event.layer)
      if old is None or event.attempt > old.attempt:
        layers[event.layer] = _record(event)
      elif event.attempt == old.attempt:
        layers[event.layer] = old._replace(shards=old.shards | {event.shard})

  def finish_step(self, step: int) -> StepMetrics | None:
    """Closes `step` (call after its outputs are ready and `jax.effects_barrier()`), updates
    the trailing windows and returns its metrics; None if no layer reported."""
    with self._lock:
      self._finished_through = max(self._finished_through, step)
      for stale in [s for s in self._open if s < step]:
        del self._open[stale]
        self.evicted_steps += 1
      layers = self._open.pop(step, None)
      if not layers:
        return None
      records = list(layers.values())
      fallback_layers = sum(r.fallback for r in records)
      required = max(r.required_factor for r in records)
      routed = sum(r.routed_rows for r in records)
      self._fell_back.append(fallback_layers > 0)
      self._factors.append(required)
      return StepMetrics(
          step=step, layers=dict(sorted(layers.items())), fallback_layers=fallback_layers,
          required_factor=required,
          dropped_rows_fraction=sum(r.dropped_rows for r in records) / max(routed, 1),
          fallback_frequency=float(np.mean(self._fell_back)),
          recommended_factor=float(np.quantile(np.asarray(self._factors), self.quantile)),
          replayed=any(r.attempt > 0 for r in records))
