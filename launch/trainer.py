"""`train_and_evaluate(config, workdir)`: the training loop behind `python -m launch.train`.

Builds the mesh and the jitted steps (`launch.steps`); restores the latest orbax checkpoint in
`workdir/checkpoints` if any; trains with the MoE metrics pipeline (TensorBoard tags and
alerts in `workdir`), periodic eval and checkpoints (train state, data iterator, the MoE
metrics' trailing windows); on SIGTERM finishes the current step, checkpoints it and returns.
In `moe.moe_dropless_fallback='step'` mode an overflowing step runs dropless from its first
overflowing MoE layer on, in the same compiled step (its outputs say whether it did). Works the
same with one process or many (`jax.distributed`).
"""
from __future__ import annotations

import functools
import os
import signal
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
from launch import autopilot, programs, step_time
from launch import console as console_lib
from launch import data as data_lib
from launch.attention import ATTENTION_IMPLS
from launch.checkpoints import Checkpoints
from launch.errors import UserError
from launch.model import REMAT_POLICIES, moe_config
from launch.steps import Steps, abstract_inputs, make_steps
from metrics import traffic
from metrics.alerts import ALERTS_FILE
from moe_hk import dispatch_plan, mesh as mesh_lib


def flat_hparams(config: ml_collections.ConfigDict) -> dict:
  """`{'moe/num_experts': 8, ...}`: the config's scalar fields for TensorBoard's HParams."""
  flat = {}
  def walk(prefix, node):
    for key, value in node.items():
      if isinstance(value, (dict, ml_collections.ConfigDict)):
        walk(f"{prefix}{key}/", value)
      elif isinstance(value, (bool, int, float, str)):
        flat[prefix + key] = value
  walk("", config)
  return flat


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def validate(config: ml_collections.ConfigDict, devices: int | None = None) -> None:
  """Raises ValueError, naming the field and the valid range, before anything is compiled.
  `devices` defaults to this run's device count (`launch.aot` passes the topology's)."""
  layer = moe_config(config)  # MoEConfig validates its own fields
  devices = jax.device_count() if devices is None else devices
  seq = config.data.seq_len
  sizes = {axis: config.mesh[axis] for axis in mesh_lib.AXES}
  mesh_lib.check_device_count(sizes, devices)  # the mesh's own checks, before it exists
  mesh_lib.check_axes(layer, sizes)
  _require(config.data.batch_size % devices == 0,
           f"config.data.batch_size={config.data.batch_size} must be divisible by the "
           f"{devices} devices.")
  _require(1 <= config.moe_every <= config.num_layers and config.num_layers % config.moe_every == 0,
           f"config.moe_every={config.moe_every} must divide config.num_layers="
           f"{config.num_layers} (every moe_every-th block is MoE).")
  _require(config.num_heads % config.num_kv_heads == 0,
           f"config.num_heads={config.num_heads} must be divisible by "
           f"config.num_kv_heads={config.num_kv_heads}.")
  _require(config.attention_impl in ATTENTION_IMPLS,
           f"config.attention_impl={config.attention_impl!r} must be one of "
           f"{', '.join(repr(a) for a in ATTENTION_IMPLS)}.")
  _require(config.optimizer_state_dtype in ("float32", "bfloat16"),
           f"config.optimizer_state_dtype={config.optimizer_state_dtype!r} must be 'float32' "
           "or 'bfloat16'.")
  _require(config.remat_policy in REMAT_POLICIES,
           f"config.remat_policy={config.remat_policy!r} must be one of "
           f"{', '.join(repr(p) for p in REMAT_POLICIES)}.")
  for name in ("attention_block", "loss_chunk"):
    _require(config[name] >= 0 and (config[name] == 0 or seq % config[name] == 0),
             f"config.{name}={config[name]} must be 0 (whole sequence) or a divisor of "
             f"config.data.seq_len={seq}.")
  pilot = config.autopilot
  if pilot.enabled:
    _require(layer.moe_dropless_fallback != "none" and layer.capped,
             "config.autopilot.enabled=True needs a capped buffer (ragged_buffer_factor > 0) "
             "and a fallback (config.moe.moe_dropless_fallback 'layer' or 'step', not "
             f"{layer.moe_dropless_fallback!r}): a lower factor would otherwise drop rows.")
    autopilot.check_settings(target=pilot.target_fallback_frequency, window=pilot.window,
                             max_programs=pilot.max_programs, objective=pilot.objective,
                             max_frequency=pilot.max_fallback_frequency)
  _require(pilot.memory_budget_gib >= 0,
           f"config.autopilot.memory_budget_gib={pilot.memory_budget_gib} must be >= 0.")
  _require(config.traffic.max_mib >= 0,
           f"config.traffic.max_mib={config.traffic.max_mib} must be >= 0.")
  _require(config.max_consecutive_nonfinite >= 1,
           f"config.max_consecutive_nonfinite={config.max_consecutive_nonfinite} must be >= 1.")
  for name in ("train_steps", "eval_every", "checkpoint_every", "log_every", "learning_rate"):
    _require(config[name] > 0, f"config.{name}={config[name]} must be > 0.")


class _Preemption:
  """Turns SIGTERM into a flag the loop reads after each step (all processes agree on it)."""

  def __init__(self):
    self.requested = False
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM: finishing the current step, then checkpointing.")
    self.requested = True

  def should_stop(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.requested))))

  def restore(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _place_batch(local: np.ndarray, steps: Steps, global_rows: int) -> jax.Array:
  """This process's rows `[B / processes, S + 1]` of the global batch, placed on its devices."""
  return jax.make_array_from_process_local_data(steps.batch_sharding, local,
                                                (global_rows, *local.shape[1:]))


class _Pending(NamedTuple):
  """A step whose outputs are still on the device."""
  step: int
  outputs: dict        # loss, grad_norm, learning_rate, skipped, moe_stats (device arrays)
  factor: float        # the ragged_buffer_factor of the program that ran it


class _Totals:
  """What the run did so far, for the console's summary and the non-finite stop."""

  def __init__(self):
    self.steps = self.fallback_steps = self.dropped_rows = self.skipped = 0
    self.consecutive_skipped = 0  # skipped steps in a row, up to the last step fetched
    self.eval_loss: float | None = None


class _Reporter:
  """Fetches pending steps' outputs from the device in one transfer and writes every step's
  points: training scalars always (to the run's `writer`); the MoE telemetry when
  `config.moe_metrics`; the routed traffic to `WORKDIR/traffic` (process 0) when
  `config.traffic.record`; feeds the autopilot, if any; prints the interval's progress line."""

  def __init__(self, config, writer: metrics.MoEMetricsWriter, moe_metrics: metrics.MoEMetrics,
               tokens_per_step: int, recorder: traffic.TrafficRecorder | None,
               pilot: autopilot.Autopilot | None, console: console_lib.Console):
    self.config = config
    self.writer = writer
    self.moe_metrics = moe_metrics
    self.tokens_per_step = tokens_per_step
    self.recorder = recorder
    self.pilot = pilot
    self.console = console
    self.losses: list[float] = []
    self.totals = _Totals()
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

  def flush(self, pending: list[_Pending], stopping: bool = False, cut_short: bool = False
            ) -> None:
    """Fetches and reports `pending`; `stopping`: the run stops after it (its progress line
    shows no ETA); `cut_short`: a stop ended it before its boundary (no speed either)."""
    if not pending:
      return
    fetched = jax.device_get([p.outputs for p in pending])
    # From fetch to fetch: the interval's time includes the host's work for the one before.
    now = time.perf_counter()
    seconds, self._since = now - self._since, now
    totals, interval_fallbacks, interval_dropped, interval_skipped = self.totals, 0, 0, 0
    for p, out in zip(pending, fetched):
      self.losses.append(float(out["loss"]))
      skipped = bool(out["skipped"])
      totals.skipped += skipped
      totals.consecutive_skipped = totals.consecutive_skipped + 1 if skipped else 0
      interval_skipped += skipped
      stats = out["moe_stats"]
      interval_fallbacks += bool(np.any(stats.fallback))
      interval_dropped += int(np.sum(stats.dropped_rows))
      extra = {f"train/{k}": float(out[k]) for k in ("loss", "grad_norm", "learning_rate")}
      extra["train/skipped_steps"] = totals.skipped
      if p is pending[-1]:
        extra["train/tokens_per_second"] = self.tokens_per_step * len(pending) / seconds
      self.dropless_steps += bool(out.get("dropless", False))
      if self.config.moe_metrics:
        extra["moe/ragged_buffer_factor"] = p.factor
        self.moe_metrics.report_step(
            p.step, stats, dropless_steps=self.dropless_steps if "dropless" in out else None)
      self.writer.write_scalars(p.step, extra)
      if skipped:
        self.moe_metrics.alerts.nonfinite_step(p.step, float(out["loss"]),
                                               float(out["grad_norm"]))
      if self.pilot is not None:
        self.pilot.observe(stats)
    # Clean: no compile was under way at either end, and none started in between.
    compiles = self._compile_state()
    clean = (self._compiled and not self._disturbed and compiles == self._compiles and
             not compiles[1])
    self._disturbed, self._compiles = False, compiles
    chunks = [out["moe_stats"].fallback_chunks for out in fetched]
    if clean and self.pilot is not None and len({p.factor for p in pending}) == 1:
      self.pilot.observe_interval(pending[0].factor, len(pending), int(np.sum(chunks)), seconds,
                                  steps_left=self.config.train_steps - pending[-1].step - 1)
    if self.recorder is not None:
      self.recorder.append([p.step for p in pending],
                           np.stack([out["moe_stats"].routed_rows_per_device for out in fetched]),
                           [p.factor for p in pending],
                           np.stack(chunks),
                           seconds if clean else float("nan"))
    # The writes run on the writer's thread: the loop queues a flush and dispatches the next
    # steps while TensorFlow writes this interval's points.
    if self.config.moe_metrics:
      self.moe_metrics.end_interval(pending[-1].step, wait=False)  # the expert-load image
    else:
      self.writer.flush(wait=False)
    totals.steps += len(pending)
    totals.fallback_steps += interval_fallbacks
    totals.dropped_rows += interval_dropped
    # The first interval's time is mostly compilation, and one cut short by a stop may be a
    # single step, its time mostly the host's work on the fetch before: no speed from either.
    timed = self._compiled and not cut_short
    self._compiled = True
    self.console.progress(console_lib.Interval(
        last_step=pending[-1].step, loss=self.losses[-1],
        seconds_per_step=seconds / len(pending) if timed else None,
        tokens_per_second=self.tokens_per_step * len(pending) / seconds if timed else None,
        fallback_steps=interval_fallbacks, steps=len(pending), dropped_rows=interval_dropped,
        skipped_steps=interval_skipped, factor=pending[-1].factor, stopping=stopping))
    pending.clear()


def _autopilot(config, mesh, steps: Steps, moe_metrics: metrics.MoEMetrics, worst_case: float,
               flops: tuple[float, float]) -> autopilot.Autopilot | None:
  """The buffer-factor autopilot of `config.autopilot`, or None when it is off; `worst_case`
  is the worst-case buffer's factor, its highest candidate; `flops` the step's matmul FLOPs
  (`step_time.step_flops`)."""
  pilot = config.autopilot
  if not pilot.enabled:
    return None
  m = config.moe
  shards = config.mesh[m.expert_axis]
  chunks = functools.partial(
      step_time.fallback_chunks, tokens_per_device=_tokens_per_device(config),
      seq_len=config.data.seq_len, k=m.num_experts_per_tok, shards=shards,
      local_experts=m.num_experts // shards, requested=m.dropless_fallback_num_chunks)
  pricing = autopilot.Pricing(step_time.StepFlops(
      *flops, moe_layers=config.num_layers // config.moe_every), chunks)
  controller = autopilot.FactorController(
      m.ragged_buffer_factor, target=pilot.target_fallback_frequency,
      worst_case=worst_case, window=pilot.window, objective=pilot.objective,
      max_frequency=pilot.max_fallback_frequency, pricing=pricing)
  cache = autopilot.ProgramCache(programs.compiler(config, mesh, steps),
                                 budget_bytes=programs.memory_budget_bytes(config, mesh),
                                 max_programs=pilot.max_programs)
  def on_change(step, old, new, decision):
    moe_metrics.alerts.factor_changed(step, old, new, decision.reason, decision.evidence)
  return autopilot.Autopilot(controller, cache, on_change=on_change, wait=pilot.wait)


def _tokens_per_device(config) -> int:
  """T: the tokens of one device's share of the global batch."""
  return config.data.batch_size * config.data.seq_len // jax.device_count()


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


def _alerts_written(workdir: str) -> int:
  """Lines in `workdir/alerts.jsonl` (0 when there is none)."""
  path = os.path.join(workdir, ALERTS_FILE)
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for _ in f)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_after: int | None = None) -> list[float]:
  """Trains from the newest readable checkpoint in `workdir` (or from scratch) to
  `config.train_steps`; returns the training losses of the steps it ran. `stop_after` ends the
  run after that step with a checkpoint, as a preemption would (the schedule still targets
  train_steps).

  The host runs ahead of the device: step outputs stay on the device and are fetched every
  `config.log_every` steps (and before an eval, a checkpoint or a stop), each step still
  getting its own TensorBoard points. With `config.autopilot.enabled` the
  autopilot swaps in programs for other buffer factors at step boundaries. A user's mistake
  found before compiling (config, workdir, data) raises `UserError`, as do a failed checkpoint
  write and `config.max_consecutive_nonfinite` skipped steps in a row (after a checkpoint).
  """
  try:
    validate(config)
  except ValueError as e:
    raise UserError(str(e)) from None
  _check_workdir(workdir)
  mesh = moe_hk.make_mesh(**config.mesh)
  try:
    data = data_lib.make_data(config, process_index=jax.process_index(),
                              process_count=jax.process_count())
  except (ValueError, OSError) as e:
    raise UserError(str(e)) from None
  steps = make_steps(config, mesh)
  console = console_lib.Console(config.train_steps)
  checkpoints = Checkpoints(workdir, keep=config.checkpoints_to_keep,
                            every=config.checkpoint_every)
  restored = checkpoints.restore(abstract_inputs(config, steps)[0])
  if restored is not None and restored.step >= config.train_steps:
    console.line(f"{workdir} is at step {restored.step}, config.train_steps="
                 f"{config.train_steps}: nothing to train. To train longer, rerun with "
                 f"--config.train_steps=N, N > {restored.step}.")
    checkpoints.close()
    return []
  state = steps.init(jax.random.key(config.seed)) if restored is None else restored.state
  m = config.moe
  worst = dispatch_plan.worst_case_factor(m.num_experts, m.num_experts_per_tok,
                                          config.mesh[m.expert_axis])
  batch_rows = config.data.batch_size
  preemption = _Preemption()
  pilot = None
  alerts_before = _alerts_written(workdir)
  started = time.perf_counter()
  try:
    # The run's event files: the trainer's scalars, and the MoE layers' through moe_metrics.
    with metrics.MoEMetricsWriter(workdir) as writer, metrics.MoEMetrics(
        workdir, worst_case_factor=worst, writer=writer, flush_on_sigterm=False) as moe_metrics:
      writer.write_hparams(flat_hparams(config))
      flops = step_time.step_flops(state.params, config)
      pilot = _autopilot(config, mesh, steps, moe_metrics, worst, flops)
      if restored is not None:
        data.set_state(restored.data)
        moe_metrics.aggregator.load_state_dict(restored.moe_metrics)
        if pilot is not None and restored.autopilot:
          pilot.load_state_dict(restored.autopilot)
        console.line(f"resumed from step {restored.step} ({checkpoints.directory})")
      factor = m.ragged_buffer_factor if pilot is None else pilot.factor
      if pilot is not None and factor != m.ragged_buffer_factor:
        run = pilot.cache.compile_now(factor).step  # resumed at the autopilot's factor
      else:
        run = steps.train
        if pilot is not None:
          pilot.cache.add(autopilot.Program(factor, run, None))
      recorder = (traffic.TrafficRecorder(
          workdir, expert_shards=config.mesh[m.expert_axis], k=m.num_experts_per_tok,
          tokens_per_device=_tokens_per_device(config),
          max_bytes=config.traffic.max_mib * 1024 ** 2, shape=traffic.RunShape(
              config.data.seq_len, m.dropless_fallback_chunking == "adaptive",
              m.dropless_fallback_num_chunks, *flops))
          if config.traffic.record and jax.process_index() == 0 else None)
      reporter = _Reporter(config, writer, moe_metrics, batch_rows * config.data.seq_len,
                           recorder, pilot, console)
      totals = reporter.totals
      first = int(state.step)

      def save(step: int) -> None:
        checkpoints.save(step, state, data.get_state(), moe_metrics.aggregator.state_dict(),
                         {} if pilot is None else pilot.state_dict())

      def stop_if_nonfinite(fetched: int, step: int) -> None:
        """After a fetch through step `fetched`, with steps up to `step` dispatched: once too
        many steps in a row were skipped, fetches the rest and stops the run with a
        checkpoint at `step + 1`."""
        skipped = totals.consecutive_skipped
        if not (config.skip_nonfinite_steps and skipped >= config.max_consecutive_nonfinite):
          return
        reporter.flush(pending, stopping=True, cut_short=True)
        save(step + 1)
        checkpoints.wait()
        raise UserError(
            f"{skipped} steps in a row up to step {fetched} had a non-finite loss or gradient "
            f"norm (config.max_consecutive_nonfinite={config.max_consecutive_nonfinite}); "
            f"they changed nothing, and the state is checkpointed at step {step + 1}: check "
            "the data and the learning rate, then rerun to resume.")

      pending: list[_Pending] = []
      # An interval fetched at a plain log boundary waits until the next step is dispatched,
      # so the device computes that step while the host writes the interval's points.
      deferred: list[_Pending] = []
      for step in range(first, config.train_steps):
        switched = None if pilot is None else pilot.switch(step)
        if switched is not None:
          run, factor = switched.step, switched.factor
        batch = _place_batch(data.train_batch(step), steps, batch_rows)
        if step == first:
          console.line("compiling the train step (it runs once compiled) ...")
          compile_started = time.perf_counter()
        state, out = run(state, batch)
        if step == first:
          jax.block_until_ready(out["loss"])
          compile_seconds = time.perf_counter() - compile_started
          console.line(f"first step: {compile_seconds:.1f} s (compilation included)")
          if pilot is not None:
            pilot.compile_seconds = max(pilot.compile_seconds, compile_seconds)
        fetched = deferred[-1].step if deferred else None
        reporter.flush(deferred)
        if switched is not None:
          reporter.disturbed()
        pending.append(_Pending(step, out, factor))
        if fetched is not None:
          stop_if_nonfinite(fetched, step)
        done = step + 1 == config.train_steps
        evaluate = (step + 1) % config.eval_every == 0 or done
        saving = checkpoints.should_save(step + 1)
        boundary = evaluate or saving or (step + 1) % config.log_every == 0
        stopping = (stop_after is not None and step + 1 >= stop_after) or (
            preemption.should_stop() if boundary or jax.process_count() == 1 else False)
        if boundary and not (evaluate or saving or stopping):
          deferred, pending = pending, []
        elif boundary or stopping:
          reporter.flush(pending, stopping=stopping and not done,
                         cut_short=stopping and not boundary)
          stop_if_nonfinite(step, step)
        if evaluate:
          totals.eval_loss = float(np.mean([
              steps.eval_loss(state.params, _place_batch(data.eval_batch(i), steps, batch_rows))
              for i in range(config.eval_batches)]))
          writer.write_scalars(step, {"eval/loss": totals.eval_loss})
          reporter.disturbed()
        if saving or stopping or done:
          save(step + 1)
          reporter.disturbed()
        if stopping:
          console.line(f"stopping after step {step + 1} with a checkpoint")
          break
      checkpoints.wait()
  finally:
    preemption.restore()
    if pilot is not None:
      pilot.cache.close()
  _summary(console, workdir, checkpoints, totals, reporter.losses, first,
           time.perf_counter() - started, _alerts_written(workdir) - alerts_before)
  checkpoints.close()
  return reporter.losses


def _summary(console: console_lib.Console, workdir: str, checkpoints: Checkpoints,
             totals: _Totals, losses: list[float], first: int, seconds: float,
             alerts: int) -> None:
  """The run's last lines: what it did and where its outputs are."""
  if not losses:
    return
  evaluated = "" if totals.eval_loss is None else f" (eval {totals.eval_loss:.4g})"
  console.line(
      f"done: steps {first}-{first + len(losses) - 1} in {console_lib.duration(seconds)} | "
      f"loss {losses[-1]:.4g}{evaluated} | fallback in {totals.fallback_steps}/{totals.steps} "
      f"steps | dropped {totals.dropped_rows} rows | skipped {totals.skipped} non-finite steps")
  console.line(f"alerts: {alerts} new in {os.path.join(workdir, ALERTS_FILE)} | "
               f"TensorBoard: tensorboard --logdir {workdir} | checkpoints: "
               f"{checkpoints.directory} (step {checkpoints.latest_step()})")
