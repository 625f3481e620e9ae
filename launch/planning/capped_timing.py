"""Times a config's capped train step at each buffer factor on this machine's devices.

What the capacity planner (`launch.capacity --time_config`) scales a run's measured step by
for the factors the run did not train at: the compiler's FLOPs say how much matmul a bigger
buffer adds, not how long it takes, and on a platform whose grouped matmul skips the buffer's
empty rows (megablox on TPU, the blocked kernel on CPU) a bigger buffer mostly costs memory
traffic.

Each factor's program is the config's train step with `moe_dropless_fallback='none'`: the
capped path alone (a step that overflows drops rows rather than running the fallback, whose
chunks the planner prices from the run's own intervals). Every program trains from the
config's initial state on one synthetic batch of random tokens. The programs run in `rounds`
bursts of `steps` steps, the factors' order reversed every other round so that a slow stretch
of the machine falls on each factor alike; the median burst is each factor's figure.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

import moe_hk
from launch.settings import Settings
from launch.training.steps import make_steps


def capped_step_seconds(settings: Settings, factors: Sequence[float], *, steps: int = 5,
                        rounds: int = 10) -> dict[float, float]:
  """`{factor: seconds}` of one capped train step of `settings` at each of `factors` (a
  factor of -1: the worst-case buffer), median over `rounds` bursts of `steps` steps (each
  >= 1, checked by the caller's flags), after one untimed step each (the compile)."""
  config = settings.config
  mesh = moe_hk.make_mesh(**settings.mesh)
  tokens = np.random.default_rng(0).integers(
      0, config.vocab_size, (config.data.batch_size, config.data.seq_len + 1), np.int32)
  runs = {}
  for factor in dict.fromkeys(float(f) for f in factors):
    capped = dataclasses.replace(settings.layer, ragged_buffer_factor=factor,
                                 moe_dropless_fallback="none")
    program = make_steps(settings._replace(layer=capped), mesh)
    batch = jax.device_put(tokens, program.batch_sharding)
    state, out = program.train(program.init(jax.random.key(0)), batch)
    jax.block_until_ready(out)
    runs[factor] = [program.train, state, batch]
  bursts = {factor: [] for factor in runs}
  for r in range(rounds):
    for factor in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
      train, state, batch = runs[factor]
      started = time.perf_counter()
      for _ in range(steps):
        state, out = train(state, batch)  # the state is donated: carry the new one
      jax.block_until_ready(out)
      bursts[factor].append((time.perf_counter() - started) / steps)
      runs[factor][1] = state
  return {factor: float(np.median(seconds)) for factor, seconds in bursts.items()}
