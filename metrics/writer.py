"""CLU metric writers for the MoE tags (TensorBoard event files), flushed on exit and SIGTERM.

A step's scalars, histograms and images are held until the next flush, then written as one
summary per step (`metrics.step_summaries`: one TensorFlow op a step instead of one a tag).
Asynchronous by default: writes run, in order, on one background thread, so that a training
loop never waits for TensorFlow; `flush(wait=False)` queues a flush and returns.

Tags, their descriptions and the CUSTOM SCALARS layout: `metrics.tags` (docs/metrics.md). Each
tag's first point carries its description. On process 0 the events go to the writer's run
folder, and the buffer-factor chart's three series also to one run each inside it
(`tags.FACTOR_SERIES`), so that TensorBoard draws them in three colours.
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

from metrics.aggregator import StepMetrics
from metrics.run_files import RunFiles
from metrics.tags import (DEAD_EXPERTS_TAG, DROPLESS_STEPS_TAG, DROPPED_FRACTION_TAG,
                          EXPERT_LOAD_TAG, FALLBACK_CHUNKS_TAG, FALLBACK_LAYERS_TAG,
                          FREQUENCY_TAG, LB_LOSS_TAG, LOAD_MAX_OVER_MEAN_TAG,
                          NONFINITE_TOKENS_TAG, RECOMMENDED_FACTOR_TAG, REQUIRED_FACTOR_TAG,
                          ROUTER_ENTROPY_TAG, TOKENS_PER_EXPERT_TAG, Z_LOSS_TAG)


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


@dataclasses.dataclass
class _StepPoints:
  """What has been written for one step and not yet handed to the event file."""
  scalars: dict[str, float] = dataclasses.field(default_factory=dict)
  histograms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # raw values
  # tag -> (rows per expert [layers, E] over steps first..this one, first): drawn when written.
  loads: dict[str, tuple[np.ndarray, int]] = dataclasses.field(default_factory=dict)


class MoEMetricsWriter:
  """Writes `StepMetrics` (and any extra scalars) with CLU's writers: a `LoggingWriter` and,
  on process 0 only, the run folder `logdir`'s event files (`metrics.run_files.RunFiles`).

  Steps' scalars, histograms and images are held until the next `flush()` (or `close()`),
  then written one summary per step. With `asynchronous` (the default) every write runs on one
  background thread, in the order written; a write that failed there raises `RuntimeError`
  from the next call. `flush(wait=False)` queues a flush without waiting; once more than
  `max_behind` such flushes are outstanding it waits for the oldest, so the host falls at most
  that many flushes (log intervals) behind. `close()` (also run at interpreter exit and on
  SIGTERM once `flush_on_sigterm()` is called) writes and flushes everything written so far.
  """

  def __init__(self, logdir: str, *, asynchronous: bool = True, histogram_buckets: int = 32,
               max_behind: int = 2):
    self._log = metric_writers.LoggingWriter()
    self._files = RunFiles(logdir) if jax.process_index() == 0 else None
    self._writers = [self._log] + ([self._files.run] if self._files is not None else [])
    self._pool = (concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="moe-metrics-writer") if asynchronous else None)
    self._flushes: collections.deque[concurrent.futures.Future] = collections.deque()
    self._max_behind = max_behind
    self._error: BaseException | None = None
    self._buckets = histogram_buckets
    self._points: dict[int, _StepPoints] = {}  # step -> points not yet handed to the thread
    self._closed = False
    self._lock = threading.Lock()
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
        if self._files is not None:
          self._files.write(step, p.scalars, p.histograms, p.loads, self._buckets)
    self._run(write)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    hparams = dict(hparams)
    self._run(lambda: [w.write_hparams(hparams) for w in self._writers])

  def _flush_files(self) -> None:
    self._log.flush()
    if self._files is not None:
      self._files.flush()

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

  def write_expert_load(self, step: int, tokens_per_expert: np.ndarray,
                        first_step: int | None = None) -> None:
    """The `moe/expert_load` heatmap of `tokens_per_expert [layers, E]`, the rows of steps
    `first_step` (default `step`) to `step`, written with the step's other points (drawn on
    the writer's thread: `metrics.expert_load`)."""
    self._step(step).loads[EXPERT_LOAD_TAG] = (
        np.asarray(tokens_per_expert), step if first_step is None else first_step)

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    self._step(step).scalars.update(scalars)

  def flush(self, wait: bool = True) -> None:
    """Writes out everything written so far; `wait=False` queues that and returns (waiting
    only while more than `max_behind` queued flushes are outstanding)."""
    self._hand_over_points()
    future = self._run(self._flush_files)
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
      self._log.close()
      if self._files is not None:
        self._files.close()
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
