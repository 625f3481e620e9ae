"""Loss and gradient-norm spikes, decided inside the compiled train step.

With `config.spikes.enabled`, the train state carries a window of the last `window` applied
steps' losses and global gradient norms (`SpikeWindow`, checkpointed with the state). A step
whose loss or gradient norm is more than `sigma` standard deviations above the window's mean
is a spike: its update is not applied (the same select that skips a non-finite step), and its
values do not enter the window. Nothing is decided until the window holds `window // 8` steps,
and at least `MIN_STEPS`: the deviation of two or three early losses is no basis (it flagged an
ordinary third step as a 7-sigma spike). Config: `config.spikes` (`enabled`, `sigma`,
`window`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from launch.setup.choices import SPIKE_MIN_STEPS

MIN_STEPS = SPIKE_MIN_STEPS  # applied steps in the window before any step is judged


class SpikeWindow(NamedTuple):
  """The recent applied steps a spike is judged against."""
  values: jax.Array  # [2, W] float32: losses (row 0) and global gradient norms (row 1)
  count: jax.Array   # [] int32: steps pushed so far (the window holds min(count, W))


class SpikeCheck(NamedTuple):
  """What the step reports of its spike test."""
  spike: jax.Array  # [] bool: the loss or the gradient norm spiked
  mean: jax.Array   # [2] float32: the window's mean loss and gradient norm
  std: jax.Array    # [2] float32: their standard deviations


def empty(window: int) -> SpikeWindow:
  return SpikeWindow(jnp.zeros((2, window), jnp.float32), jnp.zeros((), jnp.int32))


def check(spikes: SpikeWindow, loss: jax.Array, grad_norm: jax.Array, sigma: float
          ) -> SpikeCheck:
  """Whether `loss` or `grad_norm` is more than `sigma` deviations above the window's mean."""
  size = spikes.values.shape[1]
  held = jnp.minimum(spikes.count, size)
  mask = jnp.arange(size) < held                                          # [W]
  n = jnp.maximum(held, 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(mask, spikes.values, 0), axis=1) / n           # [2]
  spread = jnp.where(mask, spikes.values - mean[:, None], 0)
  std = jnp.sqrt(jnp.sum(spread ** 2, axis=1) / jnp.maximum(n - 1, 1))    # [2]
  ready = held >= max(MIN_STEPS, size // 8)
  now = jnp.stack([loss, grad_norm]).astype(jnp.float32)
  return SpikeCheck(ready & jnp.any(now > mean + sigma * std), mean, std)


def push(spikes: SpikeWindow, loss: jax.Array, grad_norm: jax.Array, applied: jax.Array
         ) -> SpikeWindow:
  """The window with this step's values in the oldest slot, when the step was `applied`."""
  slot = spikes.count % spikes.values.shape[1]
  now = jnp.stack([loss, grad_norm]).astype(jnp.float32)
  values = spikes.values.at[:, slot].set(jnp.where(applied, now, spikes.values[:, slot]))
  return SpikeWindow(values, spikes.count + applied.astype(jnp.int32))
