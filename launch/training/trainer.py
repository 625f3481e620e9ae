"""`train_and_evaluate(settings, workdir)`: the training loop behind `python -m launch.train`.

Builds the mesh and the jitted steps (`launch.training.steps`); restores the newest readable
orbax checkpoint in `workdir/checkpoints` if any; trains with the MoE metrics pipeline
(TensorBoard tags and alerts in `workdir`), periodic eval and checkpoints (train state, data
iterator, the MoE metrics' trailing windows, the alerts' rate limits, the autopilot); on
SIGTERM finishes the current step, checkpoints it and returns. In
`moe.moe_dropless_fallback='step'` mode an overflowing step runs dropless from its first
overflowing MoE layer on, in the same compiled step (its outputs say whether it did). Works
the same with one process or many (`jax.distributed`).
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

import metrics
import moe_hk
from launch.errors import Interrupted, UserError, user_errors
from launch.planning import autopilot
from launch import cli
from launch.settings import Settings
from launch.training import console as console_lib
from launch.training import data as data_lib
from launch.training import programs, record, throughput
from launch.training.checkpoints import Checkpoints, Restored
from launch.training.reporter import Pending, Reporter, Speed
from launch.training.steps import Steps, abstract_inputs, make_steps
from metrics import factor_rule, traffic
from metrics.evidence import Evidence
from metrics.alerts import ALERTS_FILE
from metrics.run_folder import run_dir
from moe_hk import dispatch_plan


def flat_hparams(config: ml_collections.ConfigDict) -> dict:
  """`{'moe/num_experts': 8, ...}`: the config's scalar fields for TensorBoard's HParams."""
  return {key.replace(".", "/"): value for key, value in record.flatten(config).items()
          if isinstance(value, (bool, int, float, str))}


class _Stop:
  """SIGTERM and SIGINT (Ctrl-C) as a request the loop reads after each step, all processes
  agreeing on it: the step finishes, is checkpointed and the run returns. A second SIGINT
  ends the process at once (exit status 130): orbax renames a checkpoint into place only
  once it is complete, so the newest complete one stays intact."""

  def __init__(self):
    self.signal: int | None = None  # the first stop signal received
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for number in (signal.SIGTERM, signal.SIGINT):
        self._previous[number] = signal.signal(number, self._handle)

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      sys.stderr.write("second Ctrl-C: exiting now, without a checkpoint of this step (the "
                       "newest complete checkpoint stays as it is).\n")
      os._exit(130)
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    if jax.process_index() == 0:
      logging.warning("%s: finishing the current step, then checkpointing%s.", name,
                      " (Ctrl-C again exits at once)" if signum == signal.SIGINT else "")
    self.signal = self.signal or signum

  @property
  def interrupted(self) -> bool:
    """Whether the run was stopped by Ctrl-C (its exit status is then 130, not 0)."""
    return self.signal == signal.SIGINT

  def should_stop(self) -> bool:
    if jax.process_count() == 1:
      return self.signal is not None
    requested = np.int32(self.signal is not None)
    return bool(np.max(multihost_utils.process_allgather(requested)))

  def restore(self) -> None:
    for number, previous in self._previous.items():
      signal.signal(number, previous)


class _Run(NamedTuple):
  """What a run is set up with before its first step."""
  settings: Settings
  workdir: str
  mesh: jax.sharding.Mesh
  data: data_lib.Data
  steps: Steps
  console: console_lib.Console
  checkpoints: Checkpoints
  restored: Restored | None


def _setup(settings: Settings, workdir: str) -> _Run:
  """The mesh, data, steps and checkpoints of the run, checked before anything compiles (the
  config against the workdir's record first: `record`); once the checkpoint is restored the
  config is recorded as `workdir/config.json` (for the next start and `launch.batch`)."""
  _check_workdir(workdir)
  start = record.check(settings.config, workdir)
  settings = settings._replace(config=start.config)
  mesh = moe_hk.make_mesh(**settings.mesh)
  with user_errors():
    data = data_lib.make_data(settings.config, process_index=jax.process_index(),
                              process_count=jax.process_count())
  steps = make_steps(settings, mesh)
  config = settings.config
  checkpoints = Checkpoints(workdir, keep=config.checkpoints_to_keep,
                            every=config.checkpoint_every)
  restored = checkpoints.restore(abstract_inputs(config, steps)[0])
  step = 0 if restored is None else restored.step
  if jax.process_index() == 0:
    record.write(config, workdir, step)
  console = console_lib.Console(config.train_steps)
  if start.changed:
    console.line(f"changed since the last start: {', '.join(start.changed)}")
  for line in record.schedule_notes(start, step):
    console.line(line)
  return _Run(settings, workdir, mesh, data, steps, console, checkpoints, restored)


def _check_workdir(workdir: str) -> None:
  """UserError unless `workdir` exists or can be created, and a file can be written in it."""
  probe = os.path.join(workdir, f".write-test-{os.getpid()}")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"workdir {workdir!r} cannot be created or written ({e.strerror or e}): "
                    "pass a folder this user can write.") from None


def _tokens_per_device(config) -> int:
  """T: the tokens of one device's share of the global batch."""
  return config.data.batch_size * config.data.seq_len // jax.device_count()


def _evidence(settings: Settings, worst_case: float) -> Evidence:
  """The factor rule's evidence of the run (`config.autopilot` holds the rule's settings for
  every use); `worst_case` is the worst-case buffer's factor, the highest candidate."""
  section, factor = settings.config.autopilot, settings.layer.ragged_buffer_factor
  rule = factor_rule.Rule(section.target_fallback_frequency, section.max_fallback_frequency,
                          min_steps=section.min_steps)
  return Evidence(worst_case=worst_case, factor=factor if factor > 0 else worst_case, rule=rule,
                  window=section.window, priced=section.objective == "throughput")


def _autopilot(run: _Run, moe_metrics: metrics.MoEMetrics) -> autopilot.Autopilot | None:
  """The buffer-factor autopilot of `config.autopilot`, or None when it is off."""
  settings = run.settings
  pilot = settings.config.autopilot
  if not pilot.enabled:
    return None
  controller = autopilot.FactorController(moe_metrics.aggregator.evidence, window=pilot.window)
  cache = autopilot.ProgramCache(programs.compiler(settings, run.mesh, run.steps),
                                 budget_bytes=programs.memory_budget_bytes(settings, run.mesh),
                                 max_programs=pilot.max_programs)
  def on_change(step, old, new, decision):
    moe_metrics.alerts.factor_changed(step, old, new, decision.reason, decision.evidence)
  return autopilot.Autopilot(controller, cache, on_change=on_change, wait=pilot.wait)


def _alerts_written(workdir: str) -> int:
  """Lines in `workdir/alerts.jsonl` (0 when there is none)."""
  path = os.path.join(workdir, ALERTS_FILE)
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for _ in f)


class _Loop:
  """The steps of one run from its first to its last or a stop: dispatch, fetch, eval,
  checkpoint (`run`)."""

  def __init__(self, run: _Run, state, reporter: Reporter, moe_metrics: metrics.MoEMetrics,
               pilot: autopilot.Autopilot | None, stop_after: int | None):
    self.run_ = run
    self.config = run.settings.config
    self.state = state
    self.reporter = reporter
    self.moe_metrics = moe_metrics
    self.pilot = pilot
    self.stop_after = stop_after
    self.stop = _Stop()
    self.pending: list[Pending] = []
    self.first = int(state.step)

  def save(self, step: int) -> None:
    self.run_.checkpoints.save(step, self.state, self.run_.data.get_state(),
                               self.moe_metrics.aggregator.state_dict(),
                               {} if self.pilot is None else self.pilot.state_dict(),
                               self.moe_metrics.alerts.state_dict())

  def stop_if_nonfinite(self, fetched: int, step: int) -> None:
    """After a fetch through step `fetched`, with steps up to `step` dispatched: once too
    many steps in a row were skipped, fetches the rest and stops the run with a checkpoint at
    `step + 1`."""
    skipped, limit = (self.reporter.totals.consecutive_skipped,
                      self.config.max_consecutive_nonfinite)
    if not ((self.config.skip_nonfinite_steps or self.config.spikes.enabled) and
            skipped >= limit):
      return
    self.reporter.flush(self.pending, stopping=True, cut_short=True)
    self.save(step + 1)
    self.run_.checkpoints.wait()
    raise UserError(
        f"{skipped} steps in a row up to step {fetched} had a non-finite or spiking loss or "
        f"gradient norm (config.max_consecutive_nonfinite={limit}); they changed nothing, and "
        f"the state is checkpointed after step {step} (checkpoints/{step + 1}): check the data "
        f"({_batch_command(self.run_.workdir, fetched)}) and the learning rate, then rerun to "
        "resume.")

  def _batch(self, rows: np.ndarray) -> jax.Array:
    """This process's rows `[B / processes, S + 1]` of the global batch, on its devices."""
    return jax.make_array_from_process_local_data(
        self.run_.steps.batch_sharding, rows, (self.config.data.batch_size, *rows.shape[1:]))

  def _first_step(self, train, batch):
    """Runs the first step, which compiles, and says how long it took."""
    console = self.run_.console
    console.line("compiling the train step (it runs once compiled) ...")
    started = time.perf_counter()
    self.state, out = train(self.state, batch)
    jax.block_until_ready(out["loss"])
    seconds = time.perf_counter() - started
    console.line(f"first step: {seconds:.1f} s (compilation included)")
    if self.pilot is not None:
      self.pilot.compile_seconds = max(self.pilot.compile_seconds, seconds)
    return out

  def _evaluate(self, step: int) -> None:
    config, run = self.config, self.run_
    loss = float(np.mean([run.steps.eval_loss(self.state.params,
                                              self._batch(run.data.eval_batch(i)))
                          for i in range(config.eval_batches)]))
    self.reporter.totals.eval_loss = loss
    self.reporter.writer.write_scalars(step, {"eval/loss": loss})
    self.reporter.disturbed()

  def run(self, train, factor: float) -> None:
    """Trains from the state's step to `config.train_steps`, or to a stop. An interval
    fetched at a plain log boundary waits until the next step is dispatched, so the device
    computes that step while the host writes the interval's points."""
    reporter = self.reporter
    deferred: list[Pending] = []
    for step in range(self.first, self.config.train_steps):
      switched = None if self.pilot is None else self.pilot.switch(step)
      if switched is not None:
        train, factor = switched.step, switched.factor
      batch = self._batch(self.run_.data.train_batch(step))
      if step == self.first:
        out = self._first_step(train, batch)
      else:
        self.state, out = train(self.state, batch)
      fetched = deferred[-1].step if deferred else None
      reporter.flush(deferred)
      if switched is not None:
        reporter.disturbed()
      self.pending.append(Pending(step, out, factor))
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
      reporter.flush(self.pending, stopping=stopping and not done,
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


def train_and_evaluate(settings: Settings, workdir: str, stop_after: int | None = None
                       ) -> list[float]:
  """Trains from the newest readable checkpoint in `workdir` (or from scratch) to
  `config.train_steps`; returns the training losses of the steps it ran.

  `stop_after` ends the run after that step with a checkpoint, as a preemption would (the
  schedule still targets train_steps). The host runs ahead of the device: step outputs stay
  on the device and are fetched every `config.log_every` steps (and before an eval, a
  checkpoint or a stop), each step still getting its own TensorBoard points. With
  `config.autopilot.enabled` the autopilot swaps in programs for other buffer factors at step
  boundaries. A user's mistake found before compiling (workdir, data) raises `UserError`, as
  do a failed checkpoint write and `config.max_consecutive_nonfinite` skipped steps in a row
  (after a checkpoint). A run stopped by SIGTERM returns; one stopped by Ctrl-C (SIGINT) raises
  `Interrupted` once its checkpoint is written (exit status 130).
  """
  run = _setup(settings, workdir)
  config, restored = run.settings.config, run.restored
  if restored is not None and restored.step >= config.train_steps:
    run.console.line(
        f"{workdir} has trained steps 0-{restored.step - 1}, config.train_steps="
        f"{config.train_steps}: nothing to train. To train longer, rerun with "
        f"--config.train_steps=N (N > {restored.step}); the learning-rate schedule ends at step "
        f"{config.schedule_steps} (rate 0 after it) unless --config.schedule_steps=N "
        "re-plans it.")
    run.checkpoints.close()
    return []
  state = run.steps.init(jax.random.key(config.seed)) if restored is None else restored.state
  alerts_before = _alerts_written(workdir)
  started = time.perf_counter()
  loop = _train(run, state, stop_after)
  _summary(run, loop.reporter, loop.first, time.perf_counter() - started,
           _alerts_written(workdir) - alerts_before)
  run.checkpoints.close()
  if loop.stop.interrupted:
    raise Interrupted(f"stopped by Ctrl-C after step "
                      f"{loop.first + len(loop.reporter.losses) - 1} with a checkpoint; the "
                      "same command resumes.")
  return loop.reporter.losses


def _finish_checkpoint(run: _Run, state) -> None:
  """Waits for the run's last checkpoint, saying on the console what it writes and, once
  written, how long the wait took (a large state's write outlasts the last step line)."""
  step = run.checkpoints.writing
  if step is None:
    return
  size = Checkpoints.state_bytes(state)
  size = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
  run.console.line(f"writing checkpoint {run.checkpoints.directory}/{step} ({size} of train "
                   "state) ...")
  started = time.perf_counter()
  run.checkpoints.wait()
  run.console.line(f"checkpoint {step} written ({time.perf_counter() - started:.1f} s)")


def _train(run: _Run, state, stop_after: int | None) -> _Loop:
  """Opens the run's writers and telemetry, resumes what the checkpoint holds and runs the
  loop; returns it, finished."""
  settings, layer, workdir = run.settings, run.settings.layer, run.workdir
  worst = dispatch_plan.worst_case_factor(layer.num_experts, layer.num_experts_per_tok,
                                          settings.expert_shards)
  pilot = None
  try:
    # The run's event files: the trainer's scalars, and the MoE layers' through moe_metrics.
    with metrics.MoEMetricsWriter(run_dir(workdir)) as writer, metrics.MoEMetrics(
        workdir, worst_case_factor=worst, evidence=_evidence(settings, worst), writer=writer,
        flush_on_sigterm=False, alert_sinks=jax.process_index() == 0) as moe_metrics:
      writer.write_hparams(flat_hparams(settings.config))
      pilot = _autopilot(run, moe_metrics)
      train, factor = _resume(run, moe_metrics, pilot)
      flops = throughput.model_flops(state.params, settings.config, layer)
      reporter = Reporter(settings.config, writer, moe_metrics, _speed(settings, flops),
                          _recorder(run), pilot, run.console, run.data.position,
                          functools.partial(_batch_command, workdir))
      loop = _Loop(run, state, reporter, moe_metrics, pilot, stop_after)
      try:
        loop.run(train, factor)
        _finish_checkpoint(run, loop.state)
      finally:
        loop.stop.restore()
  finally:
    if pilot is not None:
      pilot.cache.close()
  return loop


def _resume(run: _Run, moe_metrics: metrics.MoEMetrics, pilot: autopilot.Autopilot | None):
  """Applies the restored checkpoint's data, metrics and autopilot state; returns the program
  to start with and its buffer factor (the autopilot's, when it resumed at another)."""
  restored, factor = run.restored, run.settings.layer.ragged_buffer_factor
  if restored is not None:
    run.data.set_state(restored.data)
    moe_metrics.aggregator.load_state_dict(restored.moe_metrics)
    if restored.alerts:
      moe_metrics.alerts.load_state_dict(restored.alerts)
    if pilot is not None and restored.autopilot:
      pilot.load_state_dict(restored.autopilot)
    run.console.line(f"resumed from {run.checkpoints.directory}/{restored.step}: the next "
                     f"step is {restored.step}")
  if pilot is None:
    # Without the autopilot the config's factor is in force, whatever the checkpoint's was.
    moe_metrics.aggregator.evidence.set_factor(
        factor if factor > 0 else moe_metrics.alerts.worst_case_factor)
    return run.steps.train, factor
  if pilot.factor != factor:
    return pilot.cache.compile_now(pilot.factor).step, pilot.factor
  pilot.cache.add(autopilot.Program(factor, run.steps.train, None))
  return run.steps.train, factor


def _batch_command(workdir: str, step: int) -> str:
  """The command that prints step `step`'s batch (`launch.batch`)."""
  return cli.runnable("python", "-m", "launch.batch", f"--workdir={workdir}", f"--step={step}")


def _speed(settings: Settings, flops: float) -> Speed:
  """The model's FLOPs per step (`flops`) and the devices' peak, for the MFU."""
  config, device = settings.config, jax.devices()[0]
  return Speed(config.data.batch_size * config.data.seq_len, flops,
               jax.device_count(), throughput.peak_tflops(device.device_kind, device.platform,
                                                          config.peak_tflops_per_device))


def _recorder(run: _Run) -> traffic.TrafficRecorder | None:
  """Process 0's traffic recorder when `config.traffic.record`, else None."""
  config, layer = run.settings.config, run.settings.layer
  if not (config.traffic.record and jax.process_index() == 0):
    return None
  return traffic.TrafficRecorder(
      run.workdir, expert_shards=run.settings.expert_shards, k=layer.num_experts_per_tok,
      tokens_per_device=_tokens_per_device(config), max_bytes=config.traffic.max_mib * 1024 ** 2)


def _summary(run: _Run, reporter: Reporter, first: int, seconds: float, alerts: int) -> None:
  """The run's last lines: what it did and where its outputs are."""
  totals, losses, console = reporter.totals, reporter.losses, run.console
  if not losses:
    return
  evaluated = "" if totals.eval_loss is None else f" (eval {totals.eval_loss:.4g})"
  console.line(
      f"done: steps {first}-{first + len(losses) - 1} in {console_lib.duration(seconds)} | "
      f"loss {losses[-1]:.4g}{evaluated} | fallback in {totals.fallback_steps}/{totals.steps} "
      f"steps | dropped {totals.dropped_rows} rows | skipped {totals.skipped} non-finite" +
      (f" and {totals.spikes} spiking steps" if run.settings.config.spikes.enabled else " steps"))
  tensorboard = cli.runnable("tensorboard", "--logdir", run.workdir)
  newest = run.checkpoints.latest_step()
  console.line(f"alerts: {alerts} new in {os.path.join(run.workdir, ALERTS_FILE)} | "
               f"TensorBoard: {tensorboard} | checkpoint: "
               f"{run.checkpoints.directory}/{newest} (after step {newest - 1})")
