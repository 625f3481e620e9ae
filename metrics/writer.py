"""CLU metric writers for the MoE tags (TensorBoard event files), flushed on exit and SIGTERM.

Tags (docs/metrics.md; `<i>` is the 0-based ordinal among MoE layers):
  learning/moe_dropless_fallback_layers       MoE layers whose dropless fallback ran this step
  moe/fallback_frequency                      fraction of trailing-window steps with a fallback
  moe/required_ragged_buffer_factor           max over layers of the factor the traffic needed
  moe/required_ragged_buffer_factor/layer_<i> per MoE layer
  moe/dropped_rows_fraction                   rows dropped / rows routed
  moe/recommended_ragged_buffer_factor        high quantile of recent required factors
  moe/lb_loss, moe/z_loss                     weighted load-balance and router z-loss, all layers
  moe/load_max_over_mean/layer_<i>            busiest expert's rows over the mean per expert
  moe/dead_experts/layer_<i>                  experts that got no row
  moe/router_entropy/layer_<i>                mean entropy of the router softmax (nats)
  moe/fallback_chunks/layer_<i>               chunks the fallback ran (0: it did not run)
  moe/nonfinite_tokens/layer_<i>              tokens whose router logits were not finite
                                              (routed to no expert, output NaN)
  moe/dropless_steps                          step mode: steps so far that ran dropless from
                                              their first overflowing layer on
  moe/tokens_per_expert/layer_<i>             histogram of rows per expert
  moe/expert_load                             image: MoE layers x experts, rows over the fair
                                              share over a log interval (grey = fair share)
"""
from __future__ import annotations

import atexit
import signal
import threading
from typing import Any, Mapping

import jax
import numpy as np
from clu import metric_writers

from metrics.aggregator import StepMetrics

FALLBACK_LAYERS_TAG = "learning/moe_dropless_fallback_layers"
FREQUENCY_TAG = "moe/fallback_frequency"
REQUIRED_FACTOR_TAG = "moe/required_ragged_buffer_factor"
DROPPED_FRACTION_TAG = "moe/dropped_rows_fraction"
RECOMMENDED_FACTOR_TAG = "moe/recommended_ragged_buffer_factor"
LB_LOSS_TAG = "moe/lb_loss"
Z_LOSS_TAG = "moe/z_loss"
LOAD_MAX_OVER_MEAN_TAG = "moe/load_max_over_mean"
DEAD_EXPERTS_TAG = "moe/dead_experts"
ROUTER_ENTROPY_TAG = "moe/router_entropy"
FALLBACK_CHUNKS_TAG = "moe/fallback_chunks"
NONFINITE_TOKENS_TAG = "moe/nonfinite_tokens"
DROPLESS_STEPS_TAG = "moe/dropless_steps"
TOKENS_PER_EXPERT_TAG = "moe/tokens_per_expert"
EXPERT_LOAD_TAG = "moe/expert_load"
# moe/expert_load: each (layer, expert) cell is a square of this many pixels; its grey level
# is load / fair share / 2, so black = no rows, mid grey = the fair share, white >= 2x.
EXPERT_LOAD_CELL_PIXELS = 8


def step_scalars(m: StepMetrics) -> dict[str, float]:
  """The scalar tags of one step."""
  scalars = {
      FALLBACK_LAYERS_TAG: m.fallback_layers,
      FREQUENCY_TAG: m.fallback_frequency,
      REQUIRED_FACTOR_TAG: m.required_factor,
      DROPPED_FRACTION_TAG: m.dropped_rows_fraction,
      RECOMMENDED_FACTOR_TAG: m.recommended_factor,
      LB_LOSS_TAG: m.lb_loss,
      Z_LOSS_TAG: m.z_loss,
  }
  for layer, r in m.layers.items():
    scalars[f"{REQUIRED_FACTOR_TAG}/layer_{layer}"] = r.required_factor
    scalars[f"{LOAD_MAX_OVER_MEAN_TAG}/layer_{layer}"] = r.load_max_over_mean
    scalars[f"{DEAD_EXPERTS_TAG}/layer_{layer}"] = r.dead_experts
    scalars[f"{ROUTER_ENTROPY_TAG}/layer_{layer}"] = r.router_entropy
    scalars[f"{FALLBACK_CHUNKS_TAG}/layer_{layer}"] = r.fallback_chunks
    scalars[f"{NONFINITE_TOKENS_TAG}/layer_{layer}"] = r.nonfinite_tokens
  return scalars


def expert_load_image(tokens_per_expert: np.ndarray) -> np.ndarray:
  """`[H, W, 1]` float image in [0, 1] of `tokens_per_expert [layers, E]` (rows summed over
  an interval): each cell is rows over the layer's fair share (mean per expert), halved and
  clipped, drawn as an `EXPERT_LOAD_CELL_PIXELS` square."""
  load = np.asarray(tokens_per_expert, np.float64)
  fair = np.maximum(load.mean(axis=1, keepdims=True), 1e-12)
  cells = np.clip(load / fair / 2, 0.0, 1.0)
  pixels = np.kron(cells, np.ones((EXPERT_LOAD_CELL_PIXELS, EXPERT_LOAD_CELL_PIXELS)))
  return pixels[..., None].astype(np.float32)


class MoEMetricsWriter:
  """Writes `StepMetrics` (and any extra scalars) with CLU's default writer.

  Only process 0 writes event files; other processes only log. Asynchronous by default.
  `close()` (also run at interpreter exit and on SIGTERM once `flush_on_sigterm()` is called)
  flushes everything written so far.
  """

  def __init__(self, workdir: str, *, asynchronous: bool = True,
               histogram_buckets: int = 32):
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=jax.process_index() > 0, asynchronous=asynchronous)
    self._buckets = histogram_buckets
    self._closed = False
    self._lock = threading.Lock()
    atexit.register(self.close)

  def __enter__(self) -> "MoEMetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @property
  def clu_writer(self) -> metric_writers.MetricWriter:
    """The underlying CLU writer (e.g. for `periodic_actions.ReportProgress`)."""
    return self._writer

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self._writer.write_hparams(dict(hparams))

  def write_step(self, m: StepMetrics, dropless_steps: int | None = None,
                 extra: Mapping[str, float] | None = None) -> None:
    scalars = step_scalars(m)
    if dropless_steps is not None:
      scalars[DROPLESS_STEPS_TAG] = dropless_steps
    scalars.update(extra or {})
    self._writer.write_scalars(m.step, scalars)
    self._writer.write_histograms(
        m.step, {f"{TOKENS_PER_EXPERT_TAG}/layer_{layer}": record.tokens_per_expert
                 for layer, record in m.layers.items()},
        num_buckets={f"{TOKENS_PER_EXPERT_TAG}/layer_{layer}": self._buckets
                     for layer in m.layers})

  def write_expert_load(self, step: int, tokens_per_expert: np.ndarray) -> None:
    """The `moe/expert_load` image of `tokens_per_expert [layers, E]` (an interval's rows)."""
    self._writer.write_images(step, {EXPERT_LOAD_TAG: expert_load_image(tokens_per_expert)[None]})

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    self._writer.write_scalars(step, dict(scalars))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._writer.close()

  def flush_on_sigterm(self) -> None:
    """On SIGTERM: close (flush) this writer, then let the previous handler act (default:
    terminate). Call from the main thread."""
    previous = signal.getsignal(signal.SIGTERM)
    def handler(signum, frame):
      self.close()
      if callable(previous):
        previous(signum, frame)
      else:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
    signal.signal(signal.SIGTERM, handler)
