"""`train_and_evaluate(settings, workdir)`: the training loop behind `python -m launch.train`.

Builds the mesh and the jitted steps (`launch.model.train_step`); restores the newest readable
orbax checkpoint in `workdir/checkpoints` if any; trains with the MoE metrics pipeline
(TensorBoard tags and alerts in `workdir`), periodic eval and checkpoints (train state, data
iterator, the MoE metrics' trailing windows, the alerts' rate limits, the autopilot); on
SIGTERM finishes the current step, checkpoints it and returns. In
`moe.moe_dropless_fallback='step'` mode an overflowing step runs dropless from its first
overflowing MoE layer on, in the same compiled step (its outputs say whether it did). Works
the same with one process or many (`jax.distributed`).
"""
from __future__ import annotations

import os
import time
from typing import Mapping

import jax
import ml_collections

import metrics
import moe_hk
from launch.checkpoints import run_config
from launch.checkpoints.store import Checkpoints, GetSetState, Stateful
from launch.compiling import programs
from launch.data import loader as data_lib
from launch.model.train_step import abstract_inputs, make_steps
from launch.planning import autopilot
from launch.run import console as console_lib, consumers, throughput, trainer_alerts
from launch.run.hooks import Hooks
from launch.run.loop import Loop, Run
from launch.run.reporter import Reporter
from launch.setup import cli
from launch.setup.errors import Interrupted, UserError, user_errors
from launch.setup.settings import Settings
from metrics import factor_rule, traffic
from metrics.alerts import ALERTS_FILE
from metrics.evidence import Evidence
from metrics.run_folder import run_dir
from moe_hk import buffer_size


def flat_hparams(config: ml_collections.ConfigDict) -> dict:
  """`{'moe/num_experts': 8, ...}`: the config's scalar fields for TensorBoard's HParams."""
  return {key.replace(".", "/"): value for key, value in run_config.flatten(config).items()
          if isinstance(value, (bool, int, float, str))}


def _setup(settings: Settings, workdir: str) -> Run:
  """The mesh, data, steps and checkpoints of the run, checked before anything compiles (the
  config against the workdir's record first: `record`); once the checkpoint is restored the
  config is recorded as `workdir/config.json` (for the next start and `launch.batch`)."""
  _check_workdir(workdir)
  start = run_config.check(settings.config, workdir)
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
    run_config.write(config, workdir, step)
  console = console_lib.Console(config.train_steps)
  if start.changed:
    console.line(f"changed since the last start: {', '.join(start.changed)}")
  for line in run_config.schedule_notes(start, step):
    console.line(line)
  return Run(settings, workdir, mesh, data, steps, console, checkpoints, restored)


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
  return Evidence(worst_case=worst_case, factor=buffer_size.factor_in_force(factor, worst_case),
                  rule=rule, window=section.window, priced=section.objective == "throughput")


def _autopilot(run: Run, evidence: Evidence, alerts: metrics.AlertManager
               ) -> autopilot.Autopilot | None:
  """The buffer-factor autopilot of `config.autopilot` on the run's `evidence`, its factor
  changes sent to `alerts`; None when it is off."""
  settings = run.settings
  pilot = settings.config.autopilot
  if not pilot.enabled:
    return None
  controller = autopilot.FactorController(evidence, window=pilot.window)
  cache = autopilot.ProgramCache(programs.compiler(settings, run.mesh, run.steps),
                                 budget_bytes=programs.memory_budget_bytes(settings, run.mesh),
                                 max_programs=pilot.max_programs)
  def on_change(step, old, new, decision):
    alerts.send(trainer_alerts.factor_changed(step, old, new, decision), limited=False)
  return autopilot.Autopilot(controller, cache, on_change=on_change, wait=pilot.wait)


def _alerts_written(workdir: str) -> int:
  """Lines in `workdir/alerts.jsonl` (0 when there is none)."""
  path = os.path.join(workdir, ALERTS_FILE)
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for _ in f)


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
  loop, totals = _train(run, state, stop_after)
  _summary(run, totals, loop, time.perf_counter() - started,
           _alerts_written(workdir) - alerts_before)
  run.checkpoints.close()
  if loop.stop.interrupted:
    raise Interrupted(f"stopped by Ctrl-C after step {loop.first + len(totals.losses) - 1} "
                      "with a checkpoint; the same command resumes.")
  return totals.losses


def not_recorded(config) -> list[str]:
  """One console line for each record the run's switches leave out."""
  lines = []
  if not config.moe_metrics:
    lines.append("MoE telemetry off (config.moe_metrics=False): no moe/ TensorBoard tags, "
                 "overflow alerts or buffer-factor advice, and the MoE layers' host callbacks "
                 "are off; the training scalars are still written.")
  if not config.traffic.record:
    lines.append("traffic recording off (config.traffic.record=False): no WORKDIR/traffic, so "
                 "launch.capacity has nothing of this run to replay.")
  return lines


def _finish_checkpoint(run: Run, state) -> None:
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


def _train(run: Run, state, stop_after: int | None) -> tuple[Loop, consumers.Totals]:
  """Opens the run's writers and telemetry, resumes what the checkpoint holds and runs the
  loop; returns it, finished, with the totals of what it trained. The run's `Evidence` is made
  here and handed to what reads and writes it: the MoE telemetry (each step), the interval
  timings (each clean fetch) and the autopilot (the factor in force, refused factors)."""
  settings, layer, workdir = run.settings, run.settings.layer, run.workdir
  worst = buffer_size.worst_case_factor(layer.num_experts, layer.num_experts_per_tok,
                                        settings.expert_shards)
  evidence = _evidence(settings, worst)
  # Every process runs the alert rules; only process 0 logs and writes them.
  first = jax.process_index() == 0
  alerts = metrics.AlertManager(worst_case_factor=worst, workdir=workdir if first else None,
                                log=first)
  pilot = None
  try:
    # The run's event files: the trainer's scalars, and the MoE layers' through moe_metrics.
    with metrics.MoEMetricsWriter(run_dir(workdir)) as writer, metrics.MoEMetrics(
        workdir, worst_case_factor=worst, evidence=evidence, alerts=alerts, writer=writer,
        flush_on_sigterm=False) as moe_metrics:
      writer.write_hparams(flat_hparams(settings.config))
      for text in not_recorded(settings.config):
        run.console.line(text)
      pilot = _autopilot(run, evidence, alerts)
      parts = {"data": GetSetState(run.data), "moe_metrics": moe_metrics.aggregator,
               "alerts": alerts, **({} if pilot is None else {"autopilot": pilot})}
      train, factor = _resume(run, parts, evidence, pilot)
      totals = consumers.Totals()
      hooks = _hooks(run, totals, writer, moe_metrics, evidence, pilot, state)
      compiles = lambda: (0, False) if pilot is None else (pilot.cache.compiled,
                                                          pilot.cache.busy())
      loop = Loop(run, state, Reporter(hooks, compiles), writer, parts, pilot, stop_after)
      try:
        loop.run(train, factor)
        _finish_checkpoint(run, loop.state)
      finally:
        loop.stop.restore()
  finally:
    if pilot is not None:
      pilot.cache.close()
  return loop, totals


def _hooks(run: Run, totals: consumers.Totals, writer: metrics.MoEMetricsWriter,
           moe_metrics: metrics.MoEMetrics, evidence: Evidence,
           pilot: autopilot.Autopilot | None, state) -> Hooks:
  """The consumers of the run's finished steps, in the order each record reaches them: the
  totals first; the MoE telemetry before the autopilot (it puts the step into the evidence the
  autopilot decides on) and before the skip alerts (a step's overflow alerts come first); the
  writer's flush after everything written; the console last."""
  config = run.settings.config
  speed = _speed(run.settings, throughput.model_flops(state.params, config, run.settings.layer))
  source = lambda step: trainer_alerts.BatchSource(
      run.data.position(step), trainer_alerts.batch_command(run.workdir, step))
  hooks = Hooks()
  hooks.add("totals", totals)
  if config.moe_metrics:
    hooks.add("moe_telemetry", consumers.MoETelemetry(moe_metrics))
  hooks.add("train_scalars", consumers.TrainScalars(writer, speed, with_factor=config.moe_metrics))
  hooks.add("skip_alerts", consumers.SkipAlerts(moe_metrics.alerts, config.spikes, source))
  if pilot is not None:
    hooks.add("autopilot", consumers.AutopilotSteps(pilot, config.train_steps))
  hooks.add("interval_timings", consumers.IntervalTimings(evidence))
  recorder = _recorder(run)
  if recorder is not None:
    hooks.add("traffic", consumers.TrafficRecording(recorder))
  hooks.add("flush_writer", consumers.FlushWriter(writer))
  hooks.add("progress", consumers.Progress(run.console, speed))
  return hooks


def _resume(run: Run, parts: Mapping[str, Stateful], evidence: Evidence,
            pilot: autopilot.Autopilot | None):
  """Loads the restored checkpoint into `parts`; returns the program to start with and its
  buffer factor (the autopilot's, when it resumed at another)."""
  restored, factor = run.restored, run.settings.layer.ragged_buffer_factor
  if restored is not None:
    restored.apply(parts)
    run.console.line(f"resumed from {run.checkpoints.directory}/{restored.step}: the next "
                     f"step is {restored.step}")
  if pilot is None:
    # Without the autopilot the config's factor is in force, whatever the checkpoint's was.
    evidence.set_factor(buffer_size.factor_in_force(factor, evidence.worst_case))
    return run.steps.train, factor
  if pilot.factor != factor:
    return pilot.cache.compile_now(pilot.factor).step, pilot.factor
  pilot.cache.add(autopilot.Program(factor, run.steps.train, None))
  return run.steps.train, factor


def _speed(settings: Settings, flops: float) -> consumers.Speed:
  """The model's FLOPs per step (`flops`) and the devices' peak, for the MFU."""
  config, device = settings.config, jax.devices()[0]
  return consumers.Speed(
      config.data.batch_size * config.data.seq_len, flops, jax.device_count(),
      throughput.peak_tflops(device.device_kind, device.platform, config.peak_tflops_per_device))


def _recorder(run: Run) -> traffic.TrafficRecorder | None:
  """Process 0's traffic recorder when `config.traffic.record`, else None."""
  config, layer = run.settings.config, run.settings.layer
  if not (config.traffic.record and jax.process_index() == 0):
    return None
  return traffic.TrafficRecorder(
      run.workdir, expert_shards=run.settings.expert_shards, k=layer.num_experts_per_tok,
      tokens_per_device=_tokens_per_device(config), max_bytes=config.traffic.max_mib * 1024 ** 2)


def _summary(run: Run, totals: consumers.Totals, loop: Loop, seconds: float, alerts: int
             ) -> None:
  """The run's last lines: what it did (`totals`, and the `loop`'s first step and last eval)
  and where its outputs are."""
  losses, console, first = totals.losses, run.console, loop.first
  if not losses:
    return
  evaluated = "" if loop.eval_loss is None else f" (eval {loop.eval_loss:.4g})"
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
