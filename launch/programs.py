"""Train-step programs: one `(state, batch) -> (state, outputs)` per MoE buffer factor, the
run's own jitted step or one compiled ahead for an autopilot candidate (`launch.steps`).
"""
from __future__ import annotations

from typing import Callable

import ml_collections
from jax.sharding import Mesh

from launch.autopilot import Program
from launch.steps import Steps, abstract_inputs, make_steps
from launch import xla_programs

def with_factor(config: ml_collections.ConfigDict, factor: float) -> ml_collections.ConfigDict:
  """A copy of `config` whose MoE layers use `ragged_buffer_factor=factor`."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.moe.ragged_buffer_factor = float(factor)
  return c


def compiler(config: ml_collections.ConfigDict, mesh: Mesh, steps: Steps
             ) -> Callable[[float], Program]:
  """`factor -> Program`: lowers and compiles the train step of `config` at `factor` for the
  run's state and batch shapes; memory is its total (arguments + outputs + temporaries -
  aliased) per device."""
  state, batch = abstract_inputs(config, steps)

  def compile_factor(factor: float) -> Program:
    train = make_steps(with_factor(config, factor), mesh).train.lower(state, batch).compile()
    return Program(float(factor), train, xla_programs.total_memory_bytes(train))
  return compile_factor


def memory_budget_bytes(config: ml_collections.ConfigDict, mesh: Mesh) -> int | None:
  """`config.autopilot.memory_budget_gib` if set, else the device's memory on TPU/GPU; None
  on CPU without a set budget."""
  if config.autopilot.memory_budget_gib > 0:
    return int(config.autopilot.memory_budget_gib * 1024 ** 3)
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return None
  return int((device.memory_stats() or {}).get("bytes_limit", 0)) or None
