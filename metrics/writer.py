"""CLU metric writers for the MoE tags (TensorBoard event files), flushed on exit and SIGTERM.

A step's scalars, histograms and images are held until the next flush, then written as one
summary per step (`metrics.step_summaries`: one TensorFlow op a step instead of one a tag).
Asynchronous by default: writes run, in order, on one background thread, so that a training
loop never waits for TensorFlow; `flush(wait=False)` queues a flush and returns.

Tags (docs/metrics.md; `<i>` is the 0-based ordinal among MoE layers):
  learning/moe_dropless_fallback_layers       MoE layers whose dropless fallback ran this step
  moe/fallback_frequency                      fraction of trailing-window steps with a fallback
  moe/required_ragged_buffer_factor           max over layers of the factor the traffic needed
  moe/required_ragged_buffer_factor/layer_<i> per MoE layer
  moe/dropped_rows_fraction                   rows dropped / rows routed
  moe/recommended_ragged_buffer_factor        the factor rule's factor on the trailing window
                                              (metrics.factor_rule; no point when it names
                                              none or the window is below its min_steps)
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

Process 0 also writes a custom-scalars layout (TensorBoard's CUSTOM SCALARS tab, `LAYOUT`):
the factor in force (`moe/ragged_buffer_factor`, the trainer's), the required and the
recommended factor on one chart, the fallback frequency and layers beside it.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import signal
import threading
from typing import Any, Callable, Mapping

import jax
import numpy as np
from clu import metric_writers
from tensorboard.plugins.custom_scalar import layout_pb2, summary as custom_scalar

from metrics.aggregator import StepMetrics
from metrics.step_summaries import StepSummaryWriter, step_summary

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
FACTOR_IN_FORCE_TAG = "moe/ragged_buffer_factor"  # written by the trainer, charted here
# The CUSTOM SCALARS tab: the factor story on one chart, the fallbacks beside it (tag regexes).
LAYOUT = layout_pb2.Layout(category=[layout_pb2.Category(title="MoE buffer factor", chart=[
    layout_pb2.Chart(title="ragged_buffer_factor: in force, required, recommended",
                     multiline=layout_pb2.MultilineChartContent(tag=[
                         f"^{FACTOR_IN_FORCE_TAG}$", f"^{REQUIRED_FACTOR_TAG}$",
                         f"^{RECOMMENDED_FACTOR_TAG}$"])),
    layout_pb2.Chart(title="fallback frequency (window) and fallback layers (step)",
                     multiline=layout_pb2.MultilineChartContent(tag=[
                         f"^{FREQUENCY_TAG}$", f"^{FALLBACK_LAYERS_TAG}$"]))])])
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
      LB_LOSS_TAG: m.lb_loss,
      Z_LOSS_TAG: m.z_loss,
  }
  if m.recommended_factor is not None:
    scalars[RECOMMENDED_FACTOR_TAG] = m.recommended_factor
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


@dataclasses.dataclass
class _StepPoints:
  """What has been written for one step and not yet handed to the event file."""
  scalars: dict[str, float] = dataclasses.field(default_factory=dict)
  histograms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # raw values
  images: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # [H, W, 1] in [0, 1]


class MoEMetricsWriter:
  """Writes `StepMetrics` (and any extra scalars) with CLU's writers: a `LoggingWriter` and,
  on process 0 only, a `SummaryWriter` (`StepSummaryWriter`) for the event files.

  Steps' scalars, histograms and images are held until the next `flush()` (or `close()`),
  then written one summary per step. With `asynchronous` (the default) every write runs on one
  background thread, in the order written; a write that failed there raises `RuntimeError`
  from the next call. `flush(wait=False)` queues a flush without waiting; once more than
  `max_behind` such flushes are outstanding it waits for the oldest, so the host falls at most
  that many flushes (log intervals) behind. `close()` (also run at interpreter exit and on
  SIGTERM once `flush_on_sigterm()` is called) writes and flushes everything written so far.
  """

  def __init__(self, workdir: str, *, asynchronous: bool = True, histogram_buckets: int = 32,
               max_behind: int = 2):
    self._log = metric_writers.LoggingWriter()
    self._events = StepSummaryWriter(workdir) if jax.process_index() == 0 else None
    self._writer = metric_writers.MultiWriter(
        [self._log] + ([self._events] if self._events is not None else []))
    self._pool = (concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="moe-metrics-writer") if asynchronous else None)
    self._flushes: collections.deque[concurrent.futures.Future] = collections.deque()
    self._max_behind = max_behind
    self._error: BaseException | None = None
    self._buckets = histogram_buckets
    self._points: dict[int, _StepPoints] = {}  # step -> points not yet handed to the thread
    self._closed = False
    self._lock = threading.Lock()
    if self._events is not None:
      self._run(lambda: self._events.write_step_summary(0, custom_scalar.pb(LAYOUT)))
    atexit.register(self.close)

  def __enter__(self) -> "MoEMetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _run(self, write: Callable[[], None]) -> concurrent.futures.Future | None:
    """Runs `write` now (synchronous writer) or queues it on the background thread."""
    if self._error is not None:
      raise RuntimeError(f"writing metrics failed: {self._error!r}") from self._error
    if self._pool is None:
      write()
      return None
    future = self._pool.submit(write)
    future.add_done_callback(self._note_error)
    return future

  def _note_error(self, future: concurrent.futures.Future) -> None:
    if future.exception() is not None and self._error is None:
      self._error = future.exception()

  def _step(self, step: int) -> _StepPoints:
    return self._points.setdefault(step, _StepPoints())

  def _hand_over_points(self) -> None:
    """Queues the held steps' points: per step, one log line and one summary."""
    if not self._points:
      return
    points, self._points = self._points, {}

    def write():
      for step in sorted(points):
        p = points[step]
        if p.scalars:
          self._log.write_scalars(step, p.scalars)
        if self._events is not None:
          self._events.write_step_summary(step, step_summary(p.scalars, p.histograms,
                                                             self._buckets, p.images))
    self._run(write)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    hparams = dict(hparams)
    self._run(lambda: self._writer.write_hparams(hparams))

  def write_step(self, m: StepMetrics, dropless_steps: int | None = None,
                 extra: Mapping[str, float] | None = None) -> None:
    scalars = step_scalars(m)
    if dropless_steps is not None:
      scalars[DROPLESS_STEPS_TAG] = dropless_steps
    scalars.update(extra or {})
    points = self._step(m.step)
    points.scalars.update(scalars)
    points.histograms.update({f"{TOKENS_PER_EXPERT_TAG}/layer_{layer}": record.tokens_per_expert
                              for layer, record in m.layers.items()})

  def write_expert_load(self, step: int, tokens_per_expert: np.ndarray) -> None:
    """The `moe/expert_load` image of `tokens_per_expert [layers, E]` (an interval's rows),
    written with the step's other points."""
    self._step(step).images[EXPERT_LOAD_TAG] = expert_load_image(tokens_per_expert)

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    self._step(step).scalars.update(scalars)

  def flush(self, wait: bool = True) -> None:
    """Writes out everything written so far; `wait=False` queues that and returns (waiting
    only while more than `max_behind` queued flushes are outstanding)."""
    self._hand_over_points()
    future = self._run(self._writer.flush)
    if future is None:
      return
    self._flushes.append(future)
    while self._flushes and (wait or len(self._flushes) > self._max_behind):
      self._flushes.popleft().result()
    self._run(lambda: None)  # raises if a write failed

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
    try:
      if self._error is None:
        self._hand_over_points()
      if self._pool is not None:
        self._pool.shutdown(wait=True)
    finally:
      self._writer.close()
    if self._error is not None:
      raise RuntimeError(f"writing metrics failed: {self._error!r}") from self._error

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
