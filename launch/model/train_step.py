"""The train state, optimizer, loss and the jitted init / train / eval steps for one mesh.

Shared by the training loop (`launch.run.trainer`), the autopilot's programs and the AOT
compiles (`launch.compiling.variants`), so all compile exactly the same step: params and Adam
state sharded FSDP-style (`launch.model.sharding`), the batch `[B, S + 1]` sharded over
every mesh axis, the state donated (in every MoE fallback mode: `'step'` runs in the same
single pass, `moe_hk.step_mode`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from launch.model import memory, sharding, spikes as spikes_lib
from launch.model.loss import cross_entropy
from launch.model.transformer import Transformer
from launch.setup.settings import Settings
from moe_hk import step_mode as step_mode_lib
from moe_hk.stats import MoEStats


class TrainState(NamedTuple):
  step: jax.Array         # [] int32
  params: hk.Params       # float32
  opt_state: optax.OptState
  # The recent applied steps' losses and gradient norms, with `config.spikes.enabled`
  # (`launch.model.spikes`); None without.
  spikes: spikes_lib.SpikeWindow | None = None


class StepOutputs(NamedTuple):
  """What a train step returns beside the new state: scalars `[]` and the MoE layers' stats,
  on the device until the loop fetches them (`launch.run.records` reads them on the host)."""
  loss: jax.Array               # float32 cross-entropy
  grad_norm: jax.Array          # float32 global gradient norm
  learning_rate: jax.Array      # float32: the schedule's rate at the step
  # bool: the loss or gradient norm was not finite (with `config.skip_nonfinite_steps` the
  # step then left params and optimizer state unchanged)
  skipped: jax.Array
  moe_stats: MoEStats           # fields `[layers, ...]`
  # With `config.spikes.enabled`: the step's spike test (a spike left params and optimizer
  # state unchanged too); None without.
  spike: spikes_lib.SpikeCheck | None = None
  # In `moe.moe_dropless_fallback='step'` mode, bool: a MoE layer overflowed, so the step ran
  # every MoE layer from that one on the chunked dropless path (`moe_hk.step_mode`); None in
  # the other modes.
  dropless: jax.Array | None = None


class Steps(NamedTuple):
  """Jitted functions of one (config, mesh) and the shardings they use."""
  init: Callable[[jax.Array], TrainState]                      # rng -> state
  train: Callable[[TrainState, jax.Array], tuple[TrainState, StepOutputs]]
  eval_loss: Callable[[hk.Params, jax.Array], jax.Array]
  state_sharding: Any
  batch_sharding: NamedSharding
  schedule: optax.Schedule


def learning_rate_schedule(config) -> optax.Schedule:
  """Linear warmup over `config.warmup_steps`, then cosine decay to 0 at
  `config.schedule_steps` (0 or absent: `config.train_steps`), 0 after it."""
  steps = config.get("schedule_steps") or config.train_steps
  return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps,
                                            max(steps, config.warmup_steps + 1))


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with `learning_rate_schedule(config)`, after global-norm clipping; its moments
  stored in `config.optimizer_state_dtype`."""
  schedule = learning_rate_schedule(config)
  adamw = optax.adamw(schedule, weight_decay=config.weight_decay)
  if config.optimizer_state_dtype != "float32":
    adamw = stored_as(adamw, jnp.dtype(config.optimizer_state_dtype))
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw), schedule


def stored_as(inner: optax.GradientTransformation, dtype: jnp.dtype
              ) -> optax.GradientTransformation:
  """`inner` with its floating-point state kept in `dtype` between steps: each update
  computes in float32 from the stored values and rounds the new state back (leaf by leaf,
  so XLA fuses it into the update: no float32 copy of the whole state is held)."""
  def cast(tree, to):
    return jax.tree.map(lambda a: a.astype(to) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)

  def init(params):
    return cast(inner.init(params), dtype)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)
  return optax.GradientTransformation(init, update)


def loss_fn(model: hk.Transformed, config, params, batch, step):
  """Next-token cross-entropy + the MoE layers' weighted load-balance and router z-losses.

  batch `[B, S + 1]` int32. Returns `(total, (cross_entropy, MoEStats stacked over layers))`.
  """
  out = model.apply(params, None, batch[:, :-1], step)
  ce = cross_entropy(out.hidden, out.embeddings, batch[:, 1:], config.loss_chunk)
  aux = jnp.sum(out.moe_stats.lb_loss) + jnp.sum(out.moe_stats.z_loss)
  return ce + aux, (ce, out.moe_stats)


def _transformed(settings: Settings, mesh: Mesh) -> hk.Transformed:
  def forward(tokens, step):
    return Transformer(settings.config, settings.layer, mesh, name="model")(tokens, step)
  return hk.transform(forward)


def _train_step(model: hk.Transformed, config, tx: optax.GradientTransformation,
                schedule: optax.Schedule, step_mode: bool) -> Callable:
  """`(state, batch [B, S + 1]) -> (state, StepOutputs)`, not jitted."""
  spiking = config.spikes.enabled

  def train_step(state, batch):
    loss = functools.partial(loss_fn, model, config)
    (total, (ce, stats)), gradients = jax.value_and_grad(loss, has_aux=True)(
        state.params, batch, state.step)
    dropless = step_mode_lib.any_overflow(stats) if step_mode else None
    grad_norm = optax.tree.norm(gradients)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    keep_old = ~finite if config.skip_nonfinite_steps else jnp.zeros((), bool)
    window, test = state.spikes, None
    if spiking:
      test = spikes_lib.check(window, ce, grad_norm, config.spikes.sigma)
      keep_old = keep_old | test.spike
      window = spikes_lib.push(window, ce, grad_norm, ~keep_old)

    def apply(params, opt_state):
      updates, opt_state = tx.update(gradients, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    if config.skip_nonfinite_steps or spiking:
      # A skipped step keeps the params and optimizer state it was given: a branch around the
      # update, rather than a select per leaf after it that read the old state once more.
      params, opt_state = jax.lax.cond(keep_old, lambda *old: old, apply, state.params,
                                       state.opt_state)
    else:
      params, opt_state = apply(state.params, state.opt_state)
    new_state = TrainState(state.step + 1, params, opt_state, window)
    return new_state, StepOutputs(ce, grad_norm, schedule(state.step), ~finite, stats, test,
                                  dropless)
  return train_step


def make_steps(settings: Settings, mesh: Mesh) -> Steps:
  """Builds the jitted steps of `settings` (its model, optimizer and MoE layers) on `mesh`;
  the train step donates the state and returns its `StepOutputs`."""
  config, layer_config = settings.config, settings.layer
  tx, schedule = make_optimizer(config)
  batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  model = _transformed(settings, mesh)

  def init(rng):
    tokens = jnp.zeros((config.data.batch_size, config.data.seq_len), jnp.int32)
    params = model.init(rng, tokens, None)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                      spikes_lib.empty(config.spikes.window) if config.spikes.enabled else None)

  shapes = jax.eval_shape(init, jax.random.key(0))
  state_sharding = sharding.state_shardings(shapes, mesh, layer_config, tx)
  train_step = _train_step(model, config, tx, schedule,
                           step_mode=layer_config.step_fallback)
  eval_loss = jax.jit(lambda params, batch: loss_fn(model, config, params, batch, None)[1][0],
                      in_shardings=(state_sharding.params, batch_sharding))
  train = jax.jit(train_step, in_shardings=(state_sharding, batch_sharding),
                  out_shardings=(state_sharding, None), donate_argnums=(0,))
  return Steps(jax.jit(init, out_shardings=state_sharding), train, eval_loss, state_sharding,
               batch_sharding, schedule)


def abstract_inputs(config: ml_collections.ConfigDict, steps: Steps
                    ) -> tuple[TrainState, jax.ShapeDtypeStruct]:
  """The train step's `(state, batch [B, S + 1] int32)` as ShapeDtypeStructs with their
  shardings: what `steps.train.lower` compiles for, and what a checkpoint restores into."""
  state = memory.abstract_like(jax.eval_shape(steps.init, jax.random.key(0)),
                              steps.state_sharding)
  batch = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len + 1), "int32",
                               sharding=steps.batch_sharding)
  return state, batch
