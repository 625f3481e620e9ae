"""`MoEMetrics`: per-layer stats -> aggregator -> TensorBoard writer and alerts, once per step.

Two ways to feed it. A train step that returns its MoE layers' stats (the launcher) hands them
over with `report_step`, as many steps at a time as it fetched from the device, so the host
never waits for the device in between; `write_expert_load` then writes the `moe/expert_load`
image of the fetch, and the writer's `flush(wait=False)` queues its flush (the loop does not
wait for the writer's background thread either). A loop over bare layers that stream their stats through callbacks
(`MoEConfig.stream_step_stats`) calls `end_step` after each step instead, which waits for the
step's callbacks. Either way the alerts run on the finished step (`fallback_ran` names every
layer of it that fell back).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from metrics.aggregator import Aggregator, StepMetrics, layer_record
from metrics.evidence import Evidence
from metrics.alerts import AlertManager
from metrics.writer import DROPLESS_STEPS_TAG, MoEMetricsWriter
from moe_hk import events


class MoEMetrics:
  """Collects MoE layer stats while open and reports each finished step.

  Usage: `with MoEMetrics(workdir, worst_case_factor=...) as moe_metrics:` then either
  `report_step(step, stats)` with the `MoEStats` (fields stacked `[layers, ...]`) a train step
  returned, or, after each step whose layers got `step=` (and `layer_index=`),
  `end_step(step)`.
  """

  def __init__(self, workdir: str, *, worst_case_factor: float, evidence: Evidence | None = None,
               alerts: AlertManager | None = None, hparams: Mapping[str, Any] | None = None,
               asynchronous: bool = True, flush_on_sigterm: bool = True,
               writer: MoEMetricsWriter | None = None):
    # The factor rule's evidence (`metrics.evidence`): the run's, or a default window.
    self.aggregator = Aggregator(Evidence(worst_case=worst_case_factor) if evidence is None
                                 else evidence)
    # A writer passed in belongs to the caller, who closes it; otherwise one of its own.
    self._owns_writer = writer is None
    self.writer = MoEMetricsWriter(workdir, asynchronous=asynchronous) if writer is None else writer
    # The run's alerts (rules and sink), or the default rules writing to `workdir`.
    self.alerts = (AlertManager(worst_case_factor=worst_case_factor, workdir=workdir)
                   if alerts is None else alerts)
    if hparams:
      self.writer.write_hparams(hparams)
    if flush_on_sigterm:
      self.writer.flush_on_sigterm()
    self._interval_load = None  # [layers, E] rows since the last write_expert_load
    self._interval_first = 0    # the step they start at
    events.add_sink(self.aggregator)
    self._open = True

  def __enter__(self) -> "MoEMetrics":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def report_step(self, step: int, stats: Any, *, dropless_steps: int | None = None,
                  extra_scalars: Mapping[str, float] | None = None) -> StepMetrics | None:
    """Files the stats a train step returned (`MoEStats`, numpy, fields `[layers, ...]`),
    finishes the step, writes it (with step mode's running count `dropless_steps`), runs the
    alerts."""
    process = jax.process_index()
    for layer in range(np.shape(stats.fallback)[0]):
      one = type(stats)(*(np.asarray(field)[layer] for field in stats))
      self.aggregator.add(step, layer, layer_record(one, process=process))
    load = np.asarray(stats.tokens_per_expert, np.int64)
    if self._interval_load is None:
      self._interval_load, self._interval_first = load, step
    else:
      self._interval_load = self._interval_load + load
    return self._finish(step, dropless_steps, extra_scalars)

  def write_expert_load(self, step: int) -> None:
    """Writes the `moe/expert_load` image of the rows reported since the last call, at
    `step` (nothing when none were)."""
    if self._interval_load is not None:
      self.writer.write_expert_load(step, self._interval_load, self._interval_first)
      self._interval_load = None

  def end_step(self, step: int, *, dropless_steps: int | None = None,
               extra_scalars: Mapping[str, float] | None = None) -> StepMetrics | None:
    """Callback route: waits for the step's callbacks, then writes it and runs the alerts."""
    jax.effects_barrier()
    return self._finish(step, dropless_steps, extra_scalars)

  def _finish(self, step, dropless_steps, extra_scalars) -> StepMetrics | None:
    m = self.aggregator.finish_step(step)
    if m is not None:
      self.writer.write_step(m, dropless_steps=dropless_steps, extra=extra_scalars)
      self.alerts.check(m)
    elif extra_scalars or dropless_steps is not None:  # no layer reported: still log the step
      self.writer.write_scalars(step, {**(extra_scalars or {}), **(
          {} if dropless_steps is None else {DROPLESS_STEPS_TAG: dropless_steps})})
    return m

  def close(self) -> None:
    if self._open:
      events.remove_sink(self.aggregator)
      self._open = False
    if self._owns_writer:
      self.writer.close()
    else:
      self.writer.flush()
