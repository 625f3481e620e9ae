"""`Loop`: the training loop of one run, from its first step to its last or a stop.

The host runs ahead of the device: each step is dispatched, its outputs left on the device as
`Pending`, and fetched in one transfer at a log boundary (or before an eval, a checkpoint or a
stop), where the `Reporter` hands their records to the run's consumers. A plain log boundary's
fetch waits until the next step is dispatched, so the device computes while the host writes.
The loop names no consumer: what it needs of the steps (how many in a row the state did not
take) it reads from the fetches' records, and what it measures itself (the first step's
compile, the eval loss) it keeps or puts in a record.
"""
from __future__ import annotations

import time
from typing import Mapping, NamedTuple

import jax
import numpy as np

import metrics
from launch.checkpoints.store import Checkpoints, Restored, Stateful
from launch.data import loader as data_lib
from launch.model.train_step import StepOutputs, Steps
from launch.planning import autopilot
from launch.run import console as console_lib, trainer_alerts
from launch.run.records import Pending
from launch.run.reporter import Reporter
from launch.run.stop_request import StopRequest
from launch.setup.errors import UserError
from launch.setup.settings import Settings


class Run(NamedTuple):
  """What a run is set up with before its first step."""
  settings: Settings
  workdir: str
  mesh: jax.sharding.Mesh
  data: data_lib.Data
  steps: Steps
  console: console_lib.Console
  checkpoints: Checkpoints
  restored: Restored | None


class Loop:
  """The steps of one run from its first to its last or a stop: dispatch, fetch (the
  `reporter` hands the records to the run's consumers), eval (to `writer`), checkpoint (the
  train state and `parts`, `launch.checkpoints.store`) (`run`). `pilot` is the autopilot,
  which may switch programs between steps."""

  def __init__(self, run: Run, state, reporter: Reporter, writer: metrics.MoEMetricsWriter,
               parts: Mapping[str, Stateful], pilot: autopilot.Autopilot | None,
               stop_after: int | None):
    self.run_ = run
    self.config = run.settings.config
    self.state = state
    self.reporter, self.writer = reporter, writer
    self.parts = parts
    self.pilot = pilot
    self.stop_after = stop_after
    self.stop = StopRequest()
    self.pending: list[Pending] = []
    self.first = int(state.step)
    self.unapplied = 0  # fetched steps in a row whose update was skipped (or spiked)
    self.eval_loss: float | None = None  # the last eval's

  def _flush(self, pending: list[Pending], stopping: bool = False, cut_short: bool = False
             ) -> None:
    """Has the reporter fetch and report `pending` (`Reporter.flush`); counts the steps in a
    row the state did not take."""
    interval = self.reporter.flush(pending, stopping=stopping, cut_short=cut_short)
    if interval is not None:
      self.unapplied = interval.unapplied_in_a_row(self.unapplied)

  def save(self, step: int) -> None:
    self.run_.checkpoints.save(step, self.state, self.parts)

  def stop_if_nonfinite(self, fetched: int, step: int) -> None:
    """After a fetch through step `fetched`, with steps up to `step` dispatched: once too
    many steps in a row were skipped, fetches the rest and stops the run with a checkpoint at
    `step + 1`."""
    skipped, limit = self.unapplied, self.config.max_consecutive_nonfinite
    if not ((self.config.skip_nonfinite_steps or self.config.spikes.enabled) and
            skipped >= limit):
      return
    self._flush(self.pending, stopping=True, cut_short=True)
    self.save(step + 1)
    self.run_.checkpoints.wait()
    raise UserError(
        f"{skipped} steps in a row up to step {fetched} had a non-finite or spiking loss or "
        f"gradient norm (config.max_consecutive_nonfinite={limit}); they changed nothing, and "
        f"the state is checkpointed after step {step} (checkpoints/{step + 1}): check the data "
        f"({trainer_alerts.batch_command(self.run_.workdir, fetched)}) and the learning rate, then "
        "rerun to resume.")

  def _batch(self, rows: np.ndarray) -> jax.Array:
    """This process's rows `[B / processes, S + 1]` of the global batch, on its devices."""
    return jax.make_array_from_process_local_data(
        self.run_.steps.batch_sharding, rows, (self.config.data.batch_size, *rows.shape[1:]))

  def _dispatch(self, train, batch: jax.Array, first: bool
                ) -> tuple[StepOutputs, float | None]:
    """Dispatches one step on `batch [B, S + 1]`; returns its outputs and, for the `first`,
    which compiles and is waited for, how long it took (None for the others)."""
    if not first:
      self.state, out = train(self.state, batch)
      return out, None
    console = self.run_.console
    console.line("compiling the train step (it runs once compiled) ...")
    started = time.perf_counter()
    self.state, out = train(self.state, batch)
    jax.block_until_ready(out.loss)
    seconds = time.perf_counter() - started
    console.line(f"first step: {seconds:.1f} s (compilation included)")
    return out, seconds

  def _evaluate(self, step: int) -> None:
    config, run = self.config, self.run_
    loss = float(np.mean([run.steps.eval_loss(self.state.params,
                                              self._batch(run.data.eval_batch(i)))
                          for i in range(config.eval_batches)]))
    self.eval_loss = loss
    self.writer.write_scalars(step, {"eval/loss": loss})
    self.reporter.disturbed()

  def run(self, train, factor: float) -> None:
    """Trains from the state's step to `config.train_steps`, or to a stop. An interval
    fetched at a plain log boundary waits until the next step is dispatched, so the device
    computes that step while the host writes the interval's points."""
    deferred: list[Pending] = []
    for step in range(self.first, self.config.train_steps):
      switched = None if self.pilot is None else self.pilot.switch(step)
      if switched is not None:
        train, factor = switched.step, switched.factor
      batch = self._batch(self.run_.data.train_batch(step))
      out, compile_seconds = self._dispatch(train, batch, first=step == self.first)
      fetched = deferred[-1].step if deferred else None
      self._flush(deferred)
      if switched is not None:
        self.reporter.disturbed()
      self.pending.append(Pending(step, out, factor, compile_seconds))
      if fetched is not None:
        self.stop_if_nonfinite(fetched, step)
      if self._after_step(step, deferred):
        break

  def _after_step(self, step: int, deferred: list[Pending]) -> bool:
    """Fetches, evaluates and checkpoints as step `step`'s boundary asks; True to stop."""
    config, reporter = self.config, self.reporter
    done = step + 1 == config.train_steps
    evaluate = (step + 1) % config.eval_every == 0 or done
    saving = self.run_.checkpoints.should_save(step + 1)
    boundary = evaluate or saving or (step + 1) % config.log_every == 0
    stopping = (self.stop_after is not None and step + 1 >= self.stop_after) or (
        self.stop.should_stop() if boundary or jax.process_count() == 1 else False)
    if boundary and not (evaluate or saving or stopping):
      deferred[:], self.pending = self.pending, []
    elif boundary or stopping:
      self._flush(self.pending, stopping=stopping and not done,
                  cut_short=stopping and not boundary)
      self.stop_if_nonfinite(step, step)
    if evaluate:
      self._evaluate(step)
    if saving or stopping or done:
      self.save(step + 1)
      reporter.disturbed()
    if stopping:
      self.run_.console.line(f"stopping after step {step} with a checkpoint "
                             f"(checkpoints/{step + 1})")
    return stopping
