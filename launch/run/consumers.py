"""The consumers of the trainer's finished steps (`launch.run.hooks.Hook`s), each with
one job: what they write, count or decide from a `StepRecord` or an `IntervalRecord`. Each
keeps its own counts and reads no other consumer; their order (`launch.run.trainer._hooks`)
matters only for what they hand on: the evidence the MoE telemetry fills before the autopilot
decides, the alerts' order, the writes before the writer's flush.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

import metrics
from launch.planning import autopilot
from launch.run import console as console_lib, throughput, trainer_alerts
from launch.run.hooks import Hook
from launch.run.records import IntervalRecord, StepRecord
from metrics import tags, traffic
from metrics.evidence import Evidence


class Speed(NamedTuple):
  """What turns a step's time into the model's FLOP rate (`launch.run.throughput`)."""
  tokens_per_step: int
  model_flops_per_step: float
  devices: int
  peak_tflops: float | None  # per device; None: no MFU (CPU, or a device kind not known)

  def rates(self, interval: IntervalRecord) -> tuple[float, float, float | None]:
    """The interval's tokens per second, model TFLOP/s per device and MFU (None: no peak)."""
    steps = len(interval.steps)
    tflops, mfu = throughput.mfu(self.model_flops_per_step, interval.seconds / steps,
                                 self.devices, self.peak_tflops)
    return self.tokens_per_step * steps / interval.seconds, tflops, mfu


class Totals(Hook):
  """What the run did since it started: the console's summary, the training losses
  `train_and_evaluate` returns."""

  def __init__(self):
    self.losses: list[float] = []
    self.steps = self.fallback_steps = self.dropped_rows = self.skipped = self.spikes = 0

  def on_step(self, record: StepRecord) -> None:
    self.losses.append(record.loss)
    self.steps += 1
    self.fallback_steps += record.fell_back
    self.dropped_rows += record.dropped_rows
    self.skipped += record.skipped
    self.spikes += record.spiked


class MoETelemetry(Hook):
  """The MoE layers' stats of each step to `moe_metrics` (aggregator, evidence, TensorBoard,
  overflow alerts); each fetch's `moe/expert_load` image."""

  def __init__(self, moe_metrics: metrics.MoEMetrics):
    self.moe_metrics = moe_metrics
    self.dropless_steps = 0  # step mode: steps run dropless so far (moe/dropless_steps)

  def on_step(self, record: StepRecord) -> None:
    self.dropless_steps += bool(record.dropless)
    self.moe_metrics.report_step(
        record.step, record.moe_stats,
        dropless_steps=None if record.dropless is None else self.dropless_steps)

  def on_interval(self, interval: IntervalRecord) -> None:
    self.moe_metrics.write_expert_load(interval.last.step)


class TrainScalars(Hook):
  """Each step's `train/` scalars (and the factor in force, `with_factor`), with the steps
  skipped so far since the run started (non-finite; caught as spikes); each fetch's last step
  also gets the fetch's rates (its model FLOP rate and MFU only when timed)."""

  def __init__(self, writer: metrics.MoEMetricsWriter, speed: Speed, *, with_factor: bool):
    self.writer, self.speed = writer, speed
    self.with_factor = with_factor
    self.skipped = self.spikes = 0

  def on_step(self, record: StepRecord) -> None:
    self.skipped += record.skipped
    self.spikes += record.spiked
    scalars = {"train/loss": record.loss, "train/grad_norm": record.grad_norm,
               "train/learning_rate": record.learning_rate, "train/skipped_steps": self.skipped}
    if record.spike is not None:
      scalars["train/spike_skipped_steps"] = self.spikes
    if self.with_factor:
      scalars[tags.FACTOR_IN_FORCE_TAG] = record.factor
    self.writer.write_scalars(record.step, scalars)

  def on_interval(self, interval: IntervalRecord) -> None:
    tokens_per_second, tflops, mfu = self.speed.rates(interval)
    scalars = {"train/tokens_per_second": tokens_per_second}
    if interval.timed:
      scalars["train/model_tflops_per_device"] = tflops
      if mfu is not None:
        scalars["train/mfu"] = mfu
    self.writer.write_scalars(interval.last.step, scalars)


class FlushWriter(Hook):
  """Queues a flush of the run's event files after each fetch: the writes run on the writer's
  thread while the loop dispatches the next steps."""

  def __init__(self, writer: metrics.MoEMetricsWriter):
    self.writer = writer

  def on_interval(self, interval: IntervalRecord) -> None:
    self.writer.flush(wait=False)


class SkipAlerts(Hook):
  """The alerts of a step whose update was skipped (non-finite, spiking), naming its batch."""

  def __init__(self, alerts: metrics.AlertManager, spikes, source: Callable[[int], dict]):
    self.alerts = alerts
    self.spikes = spikes   # config.spikes
    self.source = source   # step -> trainer_alerts.BatchSource of its batch

  def on_step(self, record: StepRecord) -> None:
    if record.skipped:
      self.alerts.send(trainer_alerts.nonfinite_step(record, self.source(record.step)))
    if record.spiked:
      self.alerts.send(trainer_alerts.loss_spike(record, self.spikes.sigma, self.spikes.window,
                                              self.source(record.step)))


class IntervalTimings(Hook):
  """A cleanly timed fetch that ran one factor prices that factor in the run's `evidence`."""

  def __init__(self, evidence: Evidence):
    self.evidence = evidence

  def on_interval(self, interval: IntervalRecord) -> None:
    if interval.clean and len(interval.factors) == 1:
      self.evidence.add_interval(interval.last.factor, len(interval.steps), interval.seconds)


class TrafficRecording(Hook):
  """Each fetch's routed rows per device and MoE layer to `WORKDIR/traffic`."""

  def __init__(self, recorder: traffic.TrafficRecorder):
    self.recorder = recorder

  def on_interval(self, interval: IntervalRecord) -> None:
    steps = interval.steps
    self.recorder.append([r.step for r in steps],
                         np.stack([r.moe_stats.routed_rows_per_device for r in steps]),
                         [r.factor for r in steps],
                         np.stack([r.moe_stats.fallback_chunks for r in steps]),
                         interval.seconds if interval.clean else float("nan"))


class AutopilotSteps(Hook):
  """Each finished step to the buffer-factor autopilot, once the evidence holds it, with the
  time of a step that compiled its program (a move's cost)."""

  def __init__(self, pilot: autopilot.Autopilot, train_steps: int):
    self.pilot, self.train_steps = pilot, train_steps

  def on_step(self, record: StepRecord) -> None:
    if record.compile_seconds is not None:
      self.pilot.saw_compile(record.compile_seconds)
    self.pilot.step_finished(steps_left=self.train_steps - record.step - 1)


class Progress(Hook):
  """The console's progress line of each fetch (no speed from one not timed)."""

  def __init__(self, console: console_lib.Console, speed: Speed):
    self.console, self.speed = console, speed

  def on_interval(self, interval: IntervalRecord) -> None:
    steps, timed = interval.steps, interval.timed
    tokens_per_second, tflops, mfu = self.speed.rates(interval)
    self.console.progress(console_lib.Interval(
        last_step=interval.last.step, loss=interval.last.loss,
        seconds_per_step=interval.seconds / len(steps) if timed else None,
        tokens_per_second=tokens_per_second if timed else None,
        fallback_steps=sum(r.fell_back for r in steps), steps=len(steps),
        dropped_rows=sum(r.dropped_rows for r in steps),
        skipped_steps=sum(r.skipped for r in steps), factor=interval.last.factor,
        stopping=interval.stopping, tflops_per_device=tflops if timed else None,
        mfu=mfu if timed else None, spike_steps=sum(r.spiked for r in steps)))
