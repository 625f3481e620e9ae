"""What the training loop does with a fetch of finished steps: every step's points, the
telemetry, the recorded traffic, the autopilot's evidence and the console's progress line.

The train step's outputs stay on the device until the loop fetches a batch of them (every
`config.log_every` steps, and before an eval, a checkpoint or a stop); `Reporter.flush`
fetches them in one transfer and reports each step.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
import numpy as np

import metrics
from launch.planning import autopilot
from launch.training import console as console_lib, throughput
from metrics import tags, traffic


class Pending(NamedTuple):
  """A step whose outputs are still on the device."""
  step: int
  outputs: dict        # loss, grad_norm, learning_rate, skipped, moe_stats (device arrays)
  factor: float        # the ragged_buffer_factor of the program that ran it


class Totals:
  """What the run did so far, for the console's summary and the skipped-steps stop."""

  def __init__(self):
    self.steps = self.fallback_steps = self.dropped_rows = self.skipped = self.spikes = 0
    # Steps skipped in a row (non-finite or spiking), up to the last step fetched.
    self.consecutive_skipped = 0
    self.eval_loss: float | None = None


class Speed(NamedTuple):
  """What turns a step's time into the model's FLOP rate (`launch.training.throughput`)."""
  tokens_per_step: int
  model_flops_per_step: float
  devices: int
  peak_tflops: float | None  # per device; None: no MFU (CPU, or a device kind not known)


class _Interval(NamedTuple):
  """What one fetch's steps did, summed."""
  fallback_steps: int
  dropped_rows: int
  skipped_steps: int  # non-finite
  spike_steps: int


class Reporter:
  """Fetches pending steps' outputs from the device in one transfer and writes every step's
  points: training scalars always (to the run's `writer`); the MoE telemetry when
  `config.moe_metrics`; the routed traffic to `WORKDIR/traffic` (process 0) when
  `config.traffic.record`; hands each finished step to the autopilot, if any; prints the
  interval's progress line. A cleanly timed interval that ran one factor goes to the factor
  rule's evidence (`metrics.evidence`), which prices that factor."""

  def __init__(self, config, writer: metrics.MoEMetricsWriter, moe_metrics: metrics.MoEMetrics,
               speed: Speed, recorder: traffic.TrafficRecorder | None,
               pilot: autopilot.Autopilot | None, console: console_lib.Console,
               position: Callable[[int], dict],
               batch_command: Callable[[int], str]):
    self.config = config
    self.speed = speed
    # step -> where its batch came from, and the command that prints it (skip alerts).
    self.position, self.batch_command = position, batch_command
    self.writer = writer
    self.moe_metrics = moe_metrics
    self.recorder = recorder
    self.pilot = pilot
    self.console = console
    self.losses: list[float] = []
    self.totals = Totals()
    self.dropless_steps = 0  # step mode: steps run dropless so far (moe/dropless_steps)
    self._since = time.perf_counter()
    self._compiled = False  # whether an interval after the one that compiled was timed
    # Whether the interval under way holds more than its steps (an eval, a checkpoint, a
    # switch of program, a background compile): its time then says nothing of a step's.
    self._disturbed = False
    self._compiles = self._compile_state()

  def _compile_state(self) -> tuple[int, bool]:
    """The autopilot's background compiles started so far, and whether one is under way."""
    return (0, False) if self.pilot is None else (self.pilot.cache.compiled,
                                                  self.pilot.cache.busy())

  def disturbed(self) -> None:
    """The interval under way also did other work than its steps: do not time it."""
    self._disturbed = True

  def flush(self, pending: list[Pending], stopping: bool = False, cut_short: bool = False
            ) -> None:
    """Fetches and reports `pending` (then empties it); `stopping`: the run stops after it
    (its progress line shows no ETA); `cut_short`: a stop ended it before its boundary (no
    speed either)."""
    if not pending:
      return
    fetched = jax.device_get([p.outputs for p in pending])
    # From fetch to fetch: the interval's time includes the host's work for the one before.
    now = time.perf_counter()
    seconds, self._since = now - self._since, now
    interval = self._report_steps(pending, fetched, seconds,
                                  timed=self._compiled and not cut_short)
    clean = self._timed_cleanly()
    chunks = [out["moe_stats"].fallback_chunks for out in fetched]
    if clean and len({p.factor for p in pending}) == 1:
      self.moe_metrics.aggregator.evidence.add_interval(pending[0].factor, len(pending), seconds)
    if self.recorder is not None:
      self.recorder.append([p.step for p in pending],
                           np.stack([out["moe_stats"].routed_rows_per_device for out in fetched]),
                           [p.factor for p in pending], np.stack(chunks),
                           seconds if clean else float("nan"))
    # The writes run on the writer's thread: the loop queues a flush and dispatches the next
    # steps while TensorFlow writes this interval's points.
    if self.config.moe_metrics:
      self.moe_metrics.end_interval(pending[-1].step, wait=False)  # the expert-load image
    else:
      self.writer.flush(wait=False)
    self._progress(pending, interval, seconds, stopping, cut_short)
    pending.clear()

  def _report_steps(self, pending: list[Pending], fetched: list[dict], seconds: float,
                    timed: bool) -> _Interval:
    """Writes each fetched step's points, runs its alerts and feeds the autopilot; `timed`:
    the interval's time is its steps' (not the compile's, nor a stop's host work)."""
    totals = self.totals
    fallbacks = dropped = skipped_steps = spike_steps = 0
    for p, out in zip(pending, fetched):
      self.losses.append(float(out["loss"]))
      skipped, spike = bool(out["skipped"]), bool(out.get("spike", False))
      totals.skipped += skipped
      totals.spikes += spike
      totals.consecutive_skipped = totals.consecutive_skipped + 1 if skipped or spike else 0
      skipped_steps += skipped
      spike_steps += spike
      stats = out["moe_stats"]
      fallbacks += bool(np.any(stats.fallback))
      dropped += int(np.sum(stats.dropped_rows))
      scalars = self._scalars(out, last=p is pending[-1], steps=len(pending), seconds=seconds,
                              timed=timed)
      self.dropless_steps += bool(out.get("dropless", False))
      if self.config.moe_metrics:
        scalars[tags.FACTOR_IN_FORCE_TAG] = p.factor
        self.moe_metrics.report_step(
            p.step, stats, dropless_steps=self.dropless_steps if "dropless" in out else None)
      self.writer.write_scalars(p.step, scalars)
      self._skip_alerts(p.step, out, skipped, spike)
      if self.pilot is not None:
        self.pilot.step_finished(steps_left=self.config.train_steps - p.step - 1)
    totals.steps += len(pending)
    totals.fallback_steps += fallbacks
    totals.dropped_rows += dropped
    return _Interval(fallbacks, dropped, skipped_steps, spike_steps)

  def _scalars(self, out: dict, *, last: bool, steps: int, seconds: float, timed: bool
               ) -> dict:
    """A step's training scalars; the fetch's last step also gets its rates (the model's
    FLOP rate and MFU only from a `timed` interval)."""
    scalars = {f"train/{k}": float(out[k]) for k in ("loss", "grad_norm", "learning_rate")}
    scalars["train/skipped_steps"] = self.totals.skipped
    if "spike" in out:
      scalars["train/spike_skipped_steps"] = self.totals.spikes
    if last:
      scalars["train/tokens_per_second"] = self.speed.tokens_per_step * steps / seconds
      if timed:
        tflops, mfu = throughput.mfu(self.speed.model_flops_per_step, seconds / steps,
                                     self.speed.devices, self.speed.peak_tflops)
        scalars["train/model_tflops_per_device"] = tflops
        if mfu is not None:
          scalars["train/mfu"] = mfu
    return scalars

  def _skip_alerts(self, step: int, out: dict, skipped: bool, spike: bool) -> None:
    """The alerts of a step whose update was skipped, with where its batch came from."""
    if not (skipped or spike):
      return
    alerts = self.moe_metrics.alerts
    where = dict(data_position=self.position(step), batch_command=self.batch_command(step))
    loss, grad_norm = float(out["loss"]), float(out["grad_norm"])
    if skipped:
      alerts.nonfinite_step(step, loss, grad_norm, **where)
    if spike:
      spikes = self.config.spikes
      alerts.loss_spike(step, loss, grad_norm, tuple(map(float, out["spike_mean"])),
                        tuple(map(float, out["spike_std"])), spikes.sigma, spikes.window,
                        **where)

  def _timed_cleanly(self) -> bool:
    """Whether the interval just fetched timed its steps alone: it was not the first, nothing
    else disturbed it, and no autopilot compile was under way at either end or started in
    between."""
    compiles = self._compile_state()
    clean = (self._compiled and not self._disturbed and compiles == self._compiles and
             not compiles[1])
    self._disturbed, self._compiles = False, compiles
    return clean

  def _progress(self, pending: list[Pending], interval: _Interval, seconds: float,
                stopping: bool, cut_short: bool) -> None:
    """The interval's progress line. The first interval's time is mostly compilation, and one
    cut short by a stop may be a single step, its time mostly the host's work on the fetch
    before: no speed from either."""
    timed = self._compiled and not cut_short
    self._compiled = True
    steps = len(pending)
    tflops, mfu = throughput.mfu(self.speed.model_flops_per_step, seconds / steps,
                                 self.speed.devices, self.speed.peak_tflops)
    self.console.progress(console_lib.Interval(
        last_step=pending[-1].step, loss=self.losses[-1],
        seconds_per_step=seconds / steps if timed else None,
        tokens_per_second=self.speed.tokens_per_step * steps / seconds if timed else None,
        fallback_steps=interval.fallback_steps, steps=steps,
        dropped_rows=interval.dropped_rows, skipped_steps=interval.skipped_steps,
        factor=pending[-1].factor, stopping=stopping,
        tflops_per_device=tflops if timed else None, mfu=mfu if timed else None,
        spike_steps=interval.spike_steps))
