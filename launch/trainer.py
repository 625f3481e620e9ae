"""`train_and_evaluate(config, workdir)`: the training loop behind `python -m launch.train`.

Builds the mesh, the model and AdamW; restores the latest orbax checkpoint in
`workdir/checkpoints` if any; trains with the MoE metrics pipeline (TensorBoard tags and
alerts in `workdir`), periodic eval and checkpoints; returns the losses it trained.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from clu import periodic_actions
from jax.sharding import NamedSharding, PartitionSpec as P

import metrics
import moe_hk
from launch import data as data_lib
from launch.model import Transformer, moe_config


class TrainState(NamedTuple):
  step: jax.Array
  params: hk.Params
  opt_state: optax.OptState


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


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_steps, max(config.train_steps, config.warmup_steps + 1))
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                     optax.adamw(schedule, weight_decay=config.weight_decay)), schedule


def loss_fn(model, params, batch, step):
  """Next-token cross-entropy + the MoE layers' (weighted) load-balance losses."""
  out = model.apply(params, None, batch[:, :-1], step)
  ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch[:, 1:]).mean()
  lb = sum(s.lb_loss for s in out.moe_stats)
  return ce + lb, ce


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, naming the field and the valid range, before anything is compiled."""
  layer = moe_config(config)  # MoEConfig validates its own fields
  devices = jax.device_count()
  mesh_size = config.mesh.data * config.mesh.fsdp * config.mesh.expert
  if mesh_size != devices:
    raise ValueError(f"config.mesh {dict(config.mesh)} has {mesh_size} devices; this run has "
                     f"{devices}.")
  if layer.num_experts % config.mesh.expert:
    raise ValueError(f"config.moe.num_experts={layer.num_experts} must be divisible by "
                     f"config.mesh.expert={config.mesh.expert}.")
  if config.data.batch_size % devices:
    raise ValueError(f"config.data.batch_size={config.data.batch_size} must be divisible by "
                     f"the {devices} devices.")
  if config.num_layers < config.moe_every or config.moe_every < 1:
    raise ValueError(f"config.moe_every={config.moe_every} must be in [1, num_layers="
                     f"{config.num_layers}].")
  if config.num_heads % config.num_kv_heads:
    raise ValueError(f"config.num_heads={config.num_heads} must be divisible by "
                     f"config.num_kv_heads={config.num_kv_heads}.")
  for name in ("train_steps", "eval_every", "checkpoint_every", "learning_rate"):
    if config[name] <= 0:
      raise ValueError(f"config.{name}={config[name]} must be > 0.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_after: int | None = None) -> list[float]:
  """Trains from the latest checkpoint in `workdir` (or from scratch) to `config.train_steps`;
  returns the training losses of the steps it ran. `stop_after` ends the run after that step
  with a checkpoint, as a preemption would (the schedule still targets train_steps)."""
  validate(config)
  mesh = moe_hk.make_mesh(**config.mesh)
  data = data_lib.make_data(config)
  model = hk.transform(lambda tokens, step: Transformer(config, mesh, name="model")(tokens, step))
  tx, schedule = make_optimizer(config)
  batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  put = lambda b: jax.device_put(b, batch_sharding)

  def init(rng):
    params = model.init(rng, jnp.zeros((config.data.batch_size, config.data.seq_len), jnp.int32),
                        None)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

  @jax.jit
  def train_step(state, batch):
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, model), has_aux=True)
    (_, ce), grads = grad_fn(state.params, batch, state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
    return new_state, {"loss": ce, "grad_norm": optax.tree.norm(grads),
                       "learning_rate": schedule(state.step)}

  @jax.jit
  def eval_loss(params, batch):
    return loss_fn(model, params, batch, None)[1]

  state = jax.jit(init)(jax.random.key(config.seed))
  manager = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoints_to_keep,
                                           save_interval_steps=config.checkpoint_every))
  if manager.latest_step() is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    logging.info("resumed from step %d", int(state.step))

  losses = []
  worst = metrics.worst_case_factor(config.moe.num_experts, config.moe.num_experts_per_tok,
                                    config.mesh.expert)
  with metrics.MoEMetrics(workdir, worst_case_factor=worst,
                          hparams=flat_hparams(config)) as moe_metrics:
    report = periodic_actions.ReportProgress(num_train_steps=config.train_steps,
                                             writer=moe_metrics.writer.clu_writer)
    for step in range(int(state.step), config.train_steps):
      state, out = train_step(state, put(data.train_batch(step)))
      out = jax.device_get(out)
      losses.append(float(out["loss"]))
      extra = {f"train/{k}": float(v) for k, v in out.items()}
      if (step + 1) % config.eval_every == 0 or step + 1 == config.train_steps:
        extra["eval/loss"] = float(np.mean([eval_loss(state.params, put(data.eval_batch(i)))
                                            for i in range(config.eval_batches)]))
      moe_metrics.end_step(step, extra_scalars=extra)
      report(step)
      stopping = stop_after is not None and step + 1 >= stop_after
      manager.save(step + 1, args=ocp.args.StandardSave(state), force=stopping)
      if stopping:
        break
    manager.wait_until_finished()
  return losses
