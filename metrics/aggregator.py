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

import threading
from typing import NamedTuple

import numpy as np

from metrics import factor_rule
from metrics.evidence import Evidence
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
  advice: factor_rule.Advice     # the factor rule's answer on the window, this step included

  @property
  def recommended_factor(self) -> float | None:
    """The factor the rule names (None: the evidence names none, or is too short)."""
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


class Aggregator:
  """Collects per-layer stats: `add` from returned stats, or as an event sink
  (`moe_hk.events.add_sink(aggregator)`).

  Each finished step goes to `evidence` (`metrics.evidence.Evidence`: the factor rule's
  window, which evaluates the rule once per step); its step metrics carry the window's
  fallback frequency and the rule's advice."""

  def __init__(self, evidence: Evidence | None = None, max_open_steps: int = 64):
    if max_open_steps < 1:
      raise ValueError(f"Aggregator(max_open_steps={max_open_steps}): need max_open_steps >= 1.")
    self.evidence = Evidence(worst_case=None) if evidence is None else evidence
    self.max_open_steps = max_open_steps
    self._lock = threading.Lock()
    self._open: dict[int, dict[int, LayerRecord]] = {}
    self._finished_through = -1
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
      advice = self.evidence.add_step([r.required_factor for r in records], fallback_layers > 0)
      return StepMetrics(
          step=step, layers=layers, fallback_layers=fallback_layers,
          lb_loss=sum(r.lb_loss for r in records), z_loss=sum(r.z_loss for r in records),
          required_factor=max(r.required_factor for r in records),
          dropped_rows_fraction=sum(r.dropped_rows for r in records) / max(routed, 1),
          fallback_frequency=self.evidence.frequency(), advice=advice)

  def state_dict(self) -> dict:
    """The last finished step and the evidence, JSON-serialisable (for checkpoints)."""
    with self._lock:
      return {"finished_through": self._finished_through,
              "evidence": self.evidence.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()` (a resumed run then reports what the uninterrupted one would
    have); open steps are dropped."""
    with self._lock:
      self._open.clear()
      self._finished_through = int(state["finished_through"])
      # Checkpoints written before `Evidence` held the window here.
      self.evidence.load_state_dict(state.get("evidence", state))
