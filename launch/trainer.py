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

import os
import signal
import threading
import time
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from clu import periodic_actions
from jax.experimental import multihost_utils

import metrics
import moe_hk
from launch import autopilot, programs
from launch import data as data_lib
from launch.attention import ATTENTION_IMPLS
from launch.model import REMAT_POLICIES, moe_config
from launch.steps import Steps, make_steps
from metrics import traffic


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
  mesh_size = config.mesh.data * config.mesh.fsdp * config.mesh.expert
  seq = config.data.seq_len
  _require(mesh_size == devices, f"config.mesh {dict(config.mesh)} has {mesh_size} devices; "
                                 f"this run has {devices}.")
  axes = ("data", "fsdp", "expert")  # moe_hk.make_mesh's
  _require(layer.expert_axis in axes,
           f"config.moe.expert_axis={layer.expert_axis!r} must be one of the mesh axes "
           f"{', '.join(axes)}.")
  experts_over = config.mesh[layer.expert_axis]
  _require(layer.num_experts % experts_over == 0,
           f"config.moe.num_experts={layer.num_experts} must be divisible by "
           f"config.mesh.{layer.expert_axis}={experts_over}.")
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
  if config.moe.autotune_ragged_buffer_factor:
    _require(layer.moe_dropless_fallback != "none" and layer.capped,
             "config.moe.autotune_ragged_buffer_factor=True needs a capped buffer "
             "(ragged_buffer_factor > 0) and a fallback (config.moe.moe_dropless_fallback "
             f"'layer' or 'step', not {layer.moe_dropless_fallback!r}): a lower factor would "
             "otherwise drop rows.")
    _require(0 < config.moe.target_fallback_frequency < 1,
             f"config.moe.target_fallback_frequency={config.moe.target_fallback_frequency} "
             "must be in (0, 1).")
    _require(config.moe.autotune_window >= 4,
             f"config.moe.autotune_window={config.moe.autotune_window} must be >= 4.")
    _require(config.moe.autotune_max_programs >= 1,
             f"config.moe.autotune_max_programs={config.moe.autotune_max_programs} must be "
             ">= 1.")
  for name in ("memory_budget_gib", "traffic_max_mib"):
    _require(config.moe[name] >= 0, f"config.moe.{name}={config.moe[name]} must be >= 0.")
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
  outputs: dict        # loss, grad_norm, learning_rate, moe_stats (device arrays)
  factor: float        # the ragged_buffer_factor of the program that ran it


class _Reporter:
  """Fetches pending steps' outputs from the device in one transfer and writes every step's
  points: training scalars always; the MoE telemetry when `config.moe_metrics`; the routed
  traffic to `WORKDIR/traffic` (process 0) when `config.moe.record_traffic`; and feeds the
  autopilot, if any."""

  def __init__(self, config, moe_metrics: metrics.MoEMetrics, tokens_per_step: int,
               recorder: traffic.TrafficRecorder | None, pilot: autopilot.Autopilot | None):
    self.config = config
    self.moe_metrics = moe_metrics
    self.tokens_per_step = tokens_per_step
    self.recorder = recorder
    self.pilot = pilot
    self.losses: list[float] = []
    self.replays = 0  # step mode: steps replayed so far (moe/step_replays)
    self._since = time.perf_counter()

  def flush(self, pending: list[_Pending]) -> None:
    if not pending:
      return
    fetched = jax.device_get([p.outputs for p in pending])
    now = time.perf_counter()
    for p, out in zip(pending, fetched):
      self.losses.append(float(out["loss"]))
      extra = {f"train/{k}": float(out[k]) for k in ("loss", "grad_norm", "learning_rate")}
      if p is pending[-1]:
        extra["train/tokens_per_second"] = (self.tokens_per_step * len(pending) /
                                            (now - self._since))
      replayed = bool(out.get("replayed", False))
      self.replays += replayed
      if self.config.moe_metrics:
        extra["moe/ragged_buffer_factor"] = p.factor
        self.moe_metrics.report_step(p.step, out["moe_stats"], attempt=int(replayed),
                                     replays=self.replays if "replayed" in out else None,
                                     extra_scalars=extra)
      else:
        self.moe_metrics.writer.write_scalars(p.step, extra)
      if self.pilot is not None:
        self.pilot.observe(out["moe_stats"])
    if self.recorder is not None:
      self.recorder.append([p.step for p in pending],
                           np.stack([out["moe_stats"].routed_rows_per_device for out in fetched]),
                           [p.factor for p in pending])
    if self.config.moe_metrics:
      self.moe_metrics.end_interval(pending[-1].step)
    else:
      self.moe_metrics.writer.flush()
    pending.clear()
    self._since = time.perf_counter()


def _checkpoint_args(state, data, moe_metrics, pilot) -> ocp.args.Composite:
  return ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data.get_state()),
      moe_metrics=ocp.args.JsonSave(moe_metrics.aggregator.state_dict()),
      autopilot=ocp.args.JsonSave({} if pilot is None else pilot.state_dict()))


def _restore(manager, state, data, moe_metrics, pilot):
  """The latest checkpoint's train state; restores the data iterator, the MoE metrics'
  trailing windows and the autopilot (its factor in force) in place."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
      moe_metrics=ocp.args.JsonRestore(), autopilot=ocp.args.JsonRestore()))
  data.set_state(restored.data)
  moe_metrics.aggregator.load_state_dict(restored.moe_metrics)
  if pilot is not None and restored.autopilot:
    pilot.load_state_dict(restored.autopilot)
  return restored.state


def _autopilot(config, mesh, steps: Steps, moe_metrics: metrics.MoEMetrics
               ) -> autopilot.Autopilot | None:
  """The buffer-factor autopilot of `config.moe.autotune_ragged_buffer_factor`, or None."""
  m = config.moe
  if not m.autotune_ragged_buffer_factor:
    return None
  controller = autopilot.FactorController(
      m.ragged_buffer_factor, target=m.target_fallback_frequency,
      worst_case=metrics.worst_case_factor(m.num_experts, m.num_experts_per_tok,
                                           config.mesh[m.expert_axis]),
      window=m.autotune_window)
  cache = autopilot.ProgramCache(programs.compiler(config, mesh, steps),
                                 budget_bytes=programs.memory_budget_bytes(config, mesh),
                                 max_programs=m.autotune_max_programs)
  def on_change(step, old, new, decision):
    moe_metrics.alerts.factor_changed(step, old, new, decision.reason, decision.evidence)
  return autopilot.Autopilot(controller, cache, on_change=on_change, wait=m.autotune_wait)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_after: int | None = None) -> list[float]:
  """Trains from the latest checkpoint in `workdir` (or from scratch) to `config.train_steps`;
  returns the training losses of the steps it ran. `stop_after` ends the run after that step
  with a checkpoint, as a preemption would (the schedule still targets train_steps).

  The host runs ahead of the device: step outputs stay on the device and are fetched every
  `config.log_every` steps (and before an eval, a checkpoint or a stop), each step still
  getting its own TensorBoard points. With `config.moe.autotune_ragged_buffer_factor` the autopilot swaps in
  programs for other buffer factors at step boundaries.
  """
  validate(config)
  mesh = moe_hk.make_mesh(**config.mesh)
  data = data_lib.make_data(config, process_index=jax.process_index(),
                            process_count=jax.process_count())
  steps = make_steps(config, mesh)
  state = steps.init(jax.random.key(config.seed))
  manager = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoints_to_keep,
                                           save_interval_steps=config.checkpoint_every))
  m = config.moe
  worst = metrics.worst_case_factor(m.num_experts, m.num_experts_per_tok, config.mesh[m.expert_axis])
  batch_rows = config.data.batch_size
  preemption = _Preemption()
  pilot = None
  try:
    with metrics.MoEMetrics(workdir, worst_case_factor=worst, hparams=flat_hparams(config),
                            flush_on_sigterm=False) as moe_metrics:
      pilot = _autopilot(config, mesh, steps, moe_metrics)
      if manager.latest_step() is not None:
        state = _restore(manager, state, data, moe_metrics, pilot)
        logging.info("resumed from step %d", int(state.step))
      factor = m.ragged_buffer_factor if pilot is None else pilot.factor
      if pilot is not None and factor != m.ragged_buffer_factor:
        run = pilot.cache.compile_now(factor).step  # resumed at the autopilot's factor
      else:
        run = steps.train
        if pilot is not None:
          pilot.cache.add(autopilot.Program(factor, run, None))
      recorder = (traffic.TrafficRecorder(
          workdir, expert_shards=config.mesh[m.expert_axis], k=m.num_experts_per_tok,
          tokens_per_device=batch_rows * config.data.seq_len // jax.device_count(),
          max_bytes=m.traffic_max_mib * 1024 ** 2)
          if m.record_traffic and jax.process_index() == 0 else None)
      reporter = _Reporter(config, moe_metrics, batch_rows * config.data.seq_len, recorder, pilot)
      report = periodic_actions.ReportProgress(num_train_steps=config.train_steps,
                                               writer=moe_metrics.writer.clu_writer)
      pending: list[_Pending] = []
      for step in range(int(state.step), config.train_steps):
        switched = None if pilot is None else pilot.switch(step)
        if switched is not None:
          run, factor = switched.step, switched.factor
        batch = _place_batch(data.train_batch(step), steps, batch_rows)
        state, out = run(state, batch)
        pending.append(_Pending(step, out, factor))
        done = step + 1 == config.train_steps
        evaluate = (step + 1) % config.eval_every == 0 or done
        boundary = (evaluate or manager.should_save(step + 1) or
                    (step + 1) % config.log_every == 0)
        stopping = (stop_after is not None and step + 1 >= stop_after) or (
            preemption.should_stop() if boundary or jax.process_count() == 1 else False)
        if boundary or stopping:
          reporter.flush(pending)
        if evaluate:
          moe_metrics.writer.write_scalars(step, {"eval/loss": float(np.mean([
              steps.eval_loss(state.params, _place_batch(data.eval_batch(i), steps, batch_rows))
              for i in range(config.eval_batches)]))})
        report(step)
        if manager.should_save(step + 1) or stopping or done:
          manager.save(step + 1, args=_checkpoint_args(state, data, moe_metrics, pilot),
                       force=True)
        if stopping:
          logging.info("stopping after step %d with a checkpoint", step + 1)
          break
      manager.wait_until_finished()
  finally:
    preemption.restore()
    if pilot is not None:
      pilot.cache.close()
  return reporter.losses
