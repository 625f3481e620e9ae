"""Times a config's capped train step at each buffer factor on this machine's devices.

What `launch.capacity --time_config` prices factors by ('timed'), beside or in place of the
run's own intervals: a measurement at each factor, never a price scaled from another.

Each factor's program is the config's train step with `moe_dropless_fallback='none'`: the
capped path alone, the step of a factor that does not overflow (the planner's frequency column
says how often each factor would have run the fallback instead). Every program trains from the
config's initial state on one synthetic batch of random tokens. The programs run in `rounds`
bursts of `steps` steps, the factors' order reversed every other round so that a slow stretch
of the machine falls on each factor alike; the median burst is each factor's figure, its error
the bursts' spread.
"""
from __future__ import annotations

import dataclasses
import time
import math
from typing import Callable, Sequence

import jax
import numpy as np

import moe_hk
from launch.model.train_step import make_steps
from launch.setup.settings import Settings


def capped_step_seconds(settings: Settings, factors: Sequence[float], *, steps: int = 5,
                        rounds: int = 10, progress: Callable[[str], None] = lambda line: None
                        ) -> dict[float, tuple[float, float]]:
  """`{factor: (seconds, standard error)}` of one capped train step of `settings` at each of
  `factors` (-1: the worst-case buffer), the median over `rounds` bursts of `steps` steps
  (each >= 1, checked by the caller's flags), after one untimed step each (the compile);
  `progress` gets a line per factor compiled and per round timed."""
  config = settings.config
  mesh = moe_hk.make_mesh(**settings.mesh)
  tokens = np.random.default_rng(0).integers(
      0, config.vocab_size, (config.data.batch_size, config.data.seq_len + 1), np.int32)
  runs = {}
  todo = list(dict.fromkeys(float(f) for f in factors))
  for i, factor in enumerate(todo):
    started = time.perf_counter()
    capped = dataclasses.replace(settings.layer, ragged_buffer_factor=factor,
                                 moe_dropless_fallback="none")
    program = make_steps(settings._replace(layer=capped), mesh)
    batch = jax.device_put(tokens, program.batch_sharding)
    state, out = program.train(program.init(jax.random.key(0)), batch)
    jax.block_until_ready(out)
    runs[factor] = [program.train, state, batch]
    progress(f"compiled factor {factor:g} ({i + 1} of {len(todo)}) in "
             f"{time.perf_counter() - started:.1f} s")
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
    progress(f"timed round {r + 1} of {rounds} ({len(runs)} factors x {steps} steps)")
  # The median's standard error, from the bursts' spread (1.2533 x the mean's).
  return {factor: (float(np.median(s)),
                   1.2533 * float(np.std(s, ddof=1)) / math.sqrt(len(s)) if len(s) > 1
                   else math.inf) for factor, s in bursts.items()}
