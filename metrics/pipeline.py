"""`MoEMetrics`: layer events -> aggregator -> TensorBoard writer and alerts, once per step."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax

from metrics import emit
from metrics.aggregator import Aggregator, StepMetrics
from metrics.alerts import Alert, AlertConfig, AlertManager
from metrics.writer import STEP_REPLAYS_TAG, MoEMetricsWriter


def worst_case_factor(num_experts: int, k: int, expert_shards: int) -> float:
  """The buffer factor of the worst case: min(P, E / K)."""
  return min(expert_shards, num_experts / k)


class MoEMetrics:
  """Collects the MoE layers' events while open and reports each finished step.

  Usage: `with MoEMetrics(workdir, worst_case_factor=...) as moe_metrics:` then, after each
  train step whose MoE layers got `step=` (and `layer_index=`), `moe_metrics.end_step(step)`.
  """

  def __init__(self, workdir: str, *, worst_case_factor: float, window: int = 100,
               quantile: float = 0.99, alert_config: AlertConfig = AlertConfig(),
               alert_callback: Callable[[Alert], None] | None = None,
               hparams: Mapping[str, Any] | None = None, asynchronous: bool = True,
               flush_on_sigterm: bool = True):
    self.aggregator = Aggregator(window=window, quantile=quantile)
    self.writer = MoEMetricsWriter(workdir, asynchronous=asynchronous)
    self.alerts = AlertManager(worst_case_factor=worst_case_factor, workdir=workdir,
                               callback=alert_callback, config=alert_config)
    if hparams:
      self.writer.write_hparams(hparams)
    if flush_on_sigterm:
      self.writer.flush_on_sigterm()
    emit.add_sink(self.aggregator)
    self._open = True

  def __enter__(self) -> "MoEMetrics":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def end_step(self, step: int, *, replays: int | None = None,
               extra_scalars: Mapping[str, float] | None = None) -> StepMetrics | None:
    """Waits for the step's callbacks, writes its metrics, runs the alert rules."""
    jax.effects_barrier()
    m = self.aggregator.finish_step(step)
    if m is not None:
      self.writer.write_step(m, replays=replays, extra=extra_scalars)
      self.alerts.check(m)
    elif extra_scalars or replays is not None:  # no layer reported: still log the step
      self.writer.write_scalars(step, {**(extra_scalars or {}), **(
          {} if replays is None else {STEP_REPLAYS_TAG: replays})})
    return m

  def close(self) -> None:
    if self._open:
      emit.remove_sink(self.aggregator)
      self._open = False
    self.writer.close()
