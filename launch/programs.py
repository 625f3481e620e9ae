"""Train-step programs: one callable `(state, batch) -> (state, outputs, replayed)` per MoE
buffer factor, jitted for the run's factor or compiled ahead for an autopilot candidate.

`moe_dropless_fallback='step'` programs wrap the capped step and its dropless replay in
`StepWithReplay`; the others call the train step directly (`replayed` is then False).
"""
from __future__ import annotations

from typing import Callable

import jax
import ml_collections
from jax.sharding import Mesh

from launch.autopilot import Program
from launch.steps import Steps, make_steps
from moe_hk import aot
from moe_hk.step_replay import StepWithReplay, any_overflow

Runner = Callable[..., tuple]  # (state, batch) -> (state, outputs, replayed)


def runner(train: Callable, replay: Callable | None) -> Runner:
  """The step as `(state, batch) -> (state, outputs, replayed)`."""
  if replay is None:
    return lambda state, batch: (*train(state, batch), False)
  replaying = StepWithReplay(train, replay, lambda out: any_overflow(out[1]["moe_stats"]))
  def run(state, batch):
    (state, outputs), replayed = replaying(state, batch)
    return state, outputs, replayed
  return run


def with_factor(config: ml_collections.ConfigDict, factor: float) -> ml_collections.ConfigDict:
  """A copy of `config` whose MoE layers use `ragged_buffer_factor=factor`."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.moe.ragged_buffer_factor = float(factor)
  return c


def compiler(config: ml_collections.ConfigDict, mesh: Mesh, steps: Steps
             ) -> Callable[[float], Program]:
  """`factor -> Program`: lowers and compiles the train step (and its replay) of `config` at
  `factor` for the run's state and batch shapes; memory is the larger program's total
  (arguments + outputs + temporaries - aliased) per device."""
  state = aot.abstract_like(jax.eval_shape(steps.init, jax.random.key(0)), steps.state_sharding)
  batch = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len + 1), "int32",
                               sharding=steps.batch_sharding)

  def compile_factor(factor: float) -> Program:
    candidate = make_steps(with_factor(config, factor), mesh)
    train = candidate.train.lower(state, batch).compile()
    replay = None if candidate.replay is None else candidate.replay.lower(state, batch).compile()
    memory = max(aot.total_memory_bytes(p) for p in (train, replay) if p is not None)
    return Program(float(factor), runner(train, replay), memory)
  return compile_factor


def memory_budget_bytes(config: ml_collections.ConfigDict, mesh: Mesh) -> int | None:
  """`config.moe.memory_budget_gib` if set, else the device's memory on TPU/GPU; None on CPU
  without a set budget."""
  if config.moe.memory_budget_gib > 0:
    return int(config.moe.memory_budget_gib * 1024 ** 3)
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return None
  return int((device.memory_stats() or {}).get("bytes_limit", 0)) or None
