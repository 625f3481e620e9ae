"""Host-side aggregation of MoE layer stats into one record per (step, layer) and step metrics.

Stats arrive by two routes: the train step's returned `MoEStats`, fetched by the trainer every
few steps (`add`), and layer events from `jax.debug.callback` on arbitrary threads (`__call__`),
with duplicates: another copy when a rematerialised forward is recomputed under grad, one per
process in multi-process runs. Every copy of one (step, layer) carries the same global stats,
whichever route brought it, so the first is kept and later copies only add their process to
the record's set of reporters. Memory is bounded: at most `max_open_steps` unfinished steps
and fixed-size trailing windows; the windows are saved with checkpoints (`state_dict`).
"""
from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import numpy as np

from metrics import factor_advice
from moe_hk.events import FALLBACK_EVENT, LayerEvent


class LayerRecord(NamedTuple):
  """One MoE layer in one step, deduplicated."""
  fallback: bool
  required_factor: float
  would_drop_rows: int
  dropped_rows: int
  routed_rows: int
  tokens_per_expert: np.ndarray  # [E]
  nonfinite_tokens: int          # tokens with non-finite router logits, routed to no expert
  processes: frozenset           # processes whose reports arrived
  fallback_chunks: int           # chunks the fallback ran (0 if it did not)
  router_entropy: float          # mean router entropy (nats)
  lb_loss: float                 # weighted load-balance loss
  z_loss: float                  # weighted router z-loss
  receiver_overflow_rows: np.ndarray  # [P] rows beyond each receiving expert shard's buffer

  @property
  def load_max_over_mean(self) -> float:
    """The busiest expert's rows over the mean rows per expert (1 = perfectly balanced)."""
    mean = float(np.mean(self.tokens_per_expert))
    return float(np.max(self.tokens_per_expert)) / mean if mean else 0.0

  @property
  def dead_experts(self) -> int:
    """Experts that got no row."""
    return int(np.sum(self.tokens_per_expert == 0))

  def hottest_experts(self, n: int = 3) -> list[int]:
    """The `n` experts with the most rows, busiest first."""
    return [int(e) for e in np.argsort(-self.tokens_per_expert, kind="stable")[:n]]

  @property
  def overflowing_receivers(self) -> list[int]:
    """Expert shards (positions on the expert axis) whose capped buffer overflowed."""
    return [int(j) for j in np.flatnonzero(self.receiver_overflow_rows)]


class StepMetrics(NamedTuple):
  """What the writers and alerts see for one finished step."""
  step: int
  layers: dict                   # layer ordinal -> LayerRecord
  fallback_layers: int           # MoE layers whose dropless fallback ran
  lb_loss: float                 # weighted load-balance loss, summed over layers
  z_loss: float                  # weighted router z-loss, summed over layers
  required_factor: float         # max over layers
  dropped_rows_fraction: float   # dropped rows / routed rows, over layers
  fallback_frequency: float      # fraction of the trailing window's steps with a fallback
  advice: factor_advice.Advice   # the shared rule's factor on the trailing window

  @property
  def recommended_factor(self) -> float | None:
    """The factor the rule names (None: the evidence names none)."""
    return self.advice.factor


def layer_record(stats, *, process: int) -> LayerRecord:
  """A record from one layer's `MoEStats` of one step (numpy or device values)."""
  s = stats
  return LayerRecord(
      fallback=bool(s.fallback), required_factor=float(s.required_factor),
      would_drop_rows=int(s.would_drop_rows), dropped_rows=int(s.dropped_rows),
      routed_rows=int(np.sum(s.tokens_per_expert)),
      tokens_per_expert=np.asarray(s.tokens_per_expert),
      nonfinite_tokens=int(s.nonfinite_tokens), processes=frozenset([process]),
      fallback_chunks=int(s.fallback_chunks), router_entropy=float(s.router_entropy),
      lb_loss=float(s.lb_loss), z_loss=float(s.z_loss),
      receiver_overflow_rows=np.asarray(s.receiver_overflow_rows))


class AdviceSettings(NamedTuple):
  """What the shared factor rule (`metrics.factor_advice.advise`) weighs the window with."""
  worst_case: float             # min(P, E / K): the largest candidate
  max_frequency: float = 0.5    # no factor that falls back more often than this is named
  target: float = 0.01          # without prices: the fallback frequency a factor must meet


class Aggregator:
  """Collects per-layer stats: `add` from returned stats, or as an event sink
  (`moe_hk.events.add_sink(aggregator)`).

  The trailing window keeps, per finished step, whether it fell back and each MoE layer's
  required factor: the evidence of the factor rule (`advice`). `price` (set by a trainer
  that times its steps; `metrics.factor_advice.Price`) and `factor` (the buffer factor in
  force) join the evidence when known."""

  def __init__(self, window: int = 100, advice: AdviceSettings | None = None,
               max_open_steps: int = 64):
    if window < 1 or max_open_steps < 1:
      raise ValueError(f"Aggregator(window={window}, max_open_steps={max_open_steps}): need "
                       "window >= 1, max_open_steps >= 1.")
    self.settings = advice
    self.price: factor_advice.Price | None = None
    self.factor: float | None = None
    self.max_open_steps = max_open_steps
    self._lock = threading.Lock()
    self._open: dict[int, dict[int, LayerRecord]] = {}
    self._finished_through = -1
    self._fell_back = collections.deque(maxlen=window)
    self._required = collections.deque(maxlen=window)  # per step: (factor per layer, ...)
    self.late_events = 0      # events for steps already finished (not counted)
    self.evicted_steps = 0    # unfinished steps dropped to bound memory

  def __call__(self, event: LayerEvent) -> None:
    record = layer_record(event.stats, process=event.process)
    if event.name == FALLBACK_EVENT:
      record = record._replace(fallback=True)
    self.add(event.step, event.layer, record)

  def add(self, step: int, layer: int, record: LayerRecord) -> None:
    """Files one layer's record of `step` (a duplicate only adds its processes)."""
    with self._lock:
      if step <= self._finished_through:
        self.late_events += 1
        return
      layers = self._open.get(step)
      if layers is None:
        if len(self._open) >= self.max_open_steps:
          del self._open[min(self._open)]
          self.evicted_steps += 1
        layers = self._open[step] = {}
      old = layers.get(layer)
      layers[layer] = record if old is None else old._replace(
          processes=old.processes | record.processes)

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
      layers = dict(sorted(layers.items()))
      records = list(layers.values())
      fallback_layers = sum(r.fallback for r in records)
      routed = sum(r.routed_rows for r in records)
      self._fell_back.append(fallback_layers > 0)
      self._required.append(tuple(r.required_factor for r in records))
      frequency, advice = self._summary(self._fell_back, self._required)
      return StepMetrics(
          step=step, layers=layers, fallback_layers=fallback_layers,
          lb_loss=sum(r.lb_loss for r in records), z_loss=sum(r.z_loss for r in records),
          required_factor=max(r.required_factor for r in records),
          dropped_rows_fraction=sum(r.dropped_rows for r in records) / max(routed, 1),
          fallback_frequency=frequency, advice=advice)

  def _summary(self, fell_back, required) -> tuple[float, factor_advice.Advice]:
    """(fallback frequency, the factor rule's advice) of the given windows."""
    width = max(len(r) for r in required)
    matrix = np.array([r + (0.0,) * (width - len(r)) for r in required])
    worst = (self.settings.worst_case if self.settings else
             max(float(matrix.max()), factor_advice.FACTOR_STEP))
    settings = self.settings or AdviceSettings(worst)
    advice = factor_advice.advise(matrix, worst_case=worst, current=self.factor,
                                  max_frequency=settings.max_frequency, target=settings.target,
                                  price=self.price)
    return float(np.mean(fell_back)), advice

  def summary_with_fallback(self, layer: int, required_factor: float
                            ) -> tuple[float, factor_advice.Advice]:
    """`_summary()` as if a step whose layer `layer` fell back needing `required_factor` had
    just finished (for an alert raised from a fallback event, before its step is finished;
    the step's other layers count as not overflowing)."""
    with self._lock:
      fell_back = collections.deque(self._fell_back, maxlen=self._fell_back.maxlen)
      required = collections.deque(self._required, maxlen=self._required.maxlen)
      fell_back.append(True)
      required.append((0.0,) * layer + (required_factor,))
      return self._summary(fell_back, required)

  def state_dict(self) -> dict:
    """The trailing windows and the last finished step, JSON-serialisable (for checkpoints)."""
    with self._lock:
      return {"finished_through": self._finished_through,
              "fell_back": [bool(v) for v in self._fell_back],
              "required": [list(r) for r in self._required]}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()`'s windows (a resumed run then reports what the uninterrupted
    one would have); open steps are dropped."""
    with self._lock:
      self._open.clear()
      self._finished_through = int(state["finished_through"])
      self._fell_back.clear()
      self._fell_back.extend(bool(v) for v in state["fell_back"])
      self._required.clear()
      self._required.extend(tuple(float(f) for f in r) for r in state["required"])
