"""Train-step programs per MoE buffer factor: one `(state, batch) -> (state, outputs)` each,
compiled ahead (off the training thread) for the autopilot's candidates.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jax.sharding import Mesh

from launch.model import memory
from launch.model.train_step import Steps, abstract_inputs, make_steps
from launch.planning.autopilot import Program
from launch.setup.settings import Settings


def at_factor(settings: Settings, factor: float) -> Settings:
  """`settings` whose MoE layers use `ragged_buffer_factor=factor`."""
  return settings._replace(layer=dataclasses.replace(settings.layer,
                                                     ragged_buffer_factor=float(factor)))


def compiler(settings: Settings, mesh: Mesh, steps: Steps) -> Callable[[float], Program]:
  """`factor -> Program`: lowers and compiles the train step of `settings` at `factor` for the
  run's state and batch shapes; memory is its total (arguments + outputs + temporaries -
  aliased) per device."""
  state, batch = abstract_inputs(settings.config, steps)

  def compile_factor(factor: float) -> Program:
    train = make_steps(at_factor(settings, factor), mesh).train.lower(state, batch).compile()
    return Program(float(factor), train, memory.total_memory_bytes(train))
  return compile_factor


def memory_budget_bytes(settings: Settings, mesh: Mesh) -> int | None:
  """`config.autopilot.memory_budget_gib` if set, else the device's memory on TPU/GPU; None
  on CPU without a set budget."""
  budget = settings.config.autopilot.memory_budget_gib
  if budget > 0:
    return int(budget * 1024 ** 3)
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return None
  return int((device.memory_stats() or {}).get("bytes_limit", 0)) or None
