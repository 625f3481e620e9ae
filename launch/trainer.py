"""`train_and_evaluate(config, workdir)`: the training loop behind `python -m launch.train`.

Builds the mesh and the jitted steps (`launch.steps`); restores the latest orbax checkpoint in
`workdir/checkpoints` if any; trains with the MoE metrics pipeline (TensorBoard tags and
alerts in `workdir`), periodic eval and checkpoints; on SIGTERM finishes the current step,
checkpoints it and returns. In `moe.dropless_fallback='step'` mode an overflowing step is
replayed dropless. Works the same with one process or many (`jax.distributed`).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from clu import periodic_actions
from jax.experimental import multihost_utils

import metrics
import moe_hk
from launch import data as data_lib
from launch.model import moe_config
from launch.steps import Steps, make_steps
from moe_hk.step_replay import StepWithReplay, any_overflow


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
  _require(layer.num_experts % config.mesh.expert == 0,
           f"config.moe.num_experts={layer.num_experts} must be divisible by "
           f"config.mesh.expert={config.mesh.expert}.")
  _require(config.data.batch_size % devices == 0,
           f"config.data.batch_size={config.data.batch_size} must be divisible by the "
           f"{devices} devices.")
  _require(1 <= config.moe_every <= config.num_layers and config.num_layers % config.moe_every == 0,
           f"config.moe_every={config.moe_every} must divide config.num_layers="
           f"{config.num_layers} (every moe_every-th block is MoE).")
  _require(config.num_heads % config.num_kv_heads == 0,
           f"config.num_heads={config.num_heads} must be divisible by "
           f"config.num_kv_heads={config.num_kv_heads}.")
  for name in ("attention_block", "loss_chunk"):
    _require(config[name] >= 0 and (config[name] == 0 or seq % config[name] == 0),
             f"config.{name}={config[name]} must be 0 (whole sequence) or a divisor of "
             f"config.data.seq_len={seq}.")
  for name in ("train_steps", "eval_every", "checkpoint_every", "learning_rate"):
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


def _global_batch(tokens: np.ndarray, steps: Steps) -> jax.Array:
  """Every process holds the same `[B, S + 1]` batch; each puts its devices' shards."""
  return jax.make_array_from_callback(tokens.shape, steps.batch_sharding, lambda i: tokens[i])


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_after: int | None = None) -> list[float]:
  """Trains from the latest checkpoint in `workdir` (or from scratch) to `config.train_steps`;
  returns the training losses of the steps it ran. `stop_after` ends the run after that step
  with a checkpoint, as a preemption would (the schedule still targets train_steps)."""
  validate(config)
  mesh = moe_hk.make_mesh(**config.mesh)
  data = data_lib.make_data(config)
  steps = make_steps(config, mesh)
  state = steps.init(jax.random.key(config.seed))
  manager = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoints_to_keep,
                                           save_interval_steps=config.checkpoint_every))
  if manager.latest_step() is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    logging.info("resumed from step %d", int(state.step))

  train = (StepWithReplay(steps.train, steps.replay, lambda out: any_overflow(out[1]["moe_stats"]))
           if steps.replay is not None else steps.train)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  worst = metrics.worst_case_factor(config.moe.num_experts, config.moe.num_experts_per_tok,
                                    config.mesh.expert)
  preemption = _Preemption()
  losses = []
  try:
    with metrics.MoEMetrics(workdir, worst_case_factor=worst, hparams=flat_hparams(config),
                            flush_on_sigterm=False) as moe_metrics:
      report = periodic_actions.ReportProgress(num_train_steps=config.train_steps,
                                               writer=moe_metrics.writer.clu_writer)
      last = time.perf_counter()
      for step in range(int(state.step), config.train_steps):
        batch = _global_batch(data.train_batch(step), steps)
        if isinstance(train, StepWithReplay):
          (state, out), _ = train(state, batch)
        else:
          state, out = train(state, batch)
        out = jax.device_get({k: v for k, v in out.items() if k != "moe_stats"})
        now = time.perf_counter()
        losses.append(float(out["loss"]))
        extra = {f"train/{k}": float(v) for k, v in out.items()}
        extra["train/tokens_per_second"] = tokens_per_step / (now - last)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.train_steps:
          extra["eval/loss"] = float(np.mean([
              steps.eval_loss(state.params, _global_batch(data.eval_batch(i), steps))
              for i in range(config.eval_batches)]))
        moe_metrics.end_step(step, extra_scalars=extra,
                             replays=train.replays if isinstance(train, StepWithReplay) else None)
        report(step)
        stopping = (stop_after is not None and step + 1 >= stop_after) or preemption.should_stop()
        manager.save(step + 1, args=ocp.args.StandardSave(state),
                     force=stopping or step + 1 == config.train_steps)
        last = time.perf_counter()
        if stopping:
          logging.info("stopping after step %d with a checkpoint", step + 1)
          break
      manager.wait_until_finished()
  finally:
    preemption.restore()
  return losses
