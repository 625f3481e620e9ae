"""A run's parameters at one of its checkpoints, restored onto its mesh (for `launch.score`
and `launch.convert --to_hf`, which need neither the optimizer state nor the data)."""
from __future__ import annotations

import os

import haiku as hk
import orbax.checkpoint as ocp

import moe_hk
from launch.model import train_step as steps_lib
from launch.setup.errors import UserError
from launch.setup.settings import Settings


def restore_params(settings: Settings, workdir: str, step: int | None = None
                   ) -> tuple[int, hk.Params]:
  """(step, params) of checkpoint `step` of the run in `workdir` (None: the newest), sharded
  as the run's train step shards them. UserError when there is no such checkpoint."""
  folder = os.path.join(os.path.abspath(workdir), "checkpoints")
  manager = ocp.CheckpointManager(folder)
  steps = sorted(manager.all_steps())
  if not steps or (step is not None and step not in steps):
    manager.close()
    asked = "a checkpoint" if step is None else f"--step={step}"
    raise UserError(f"{asked}: none in {folder} (there: {', '.join(map(str, steps)) or 'none'}"
                    "); --workdir must be a run's folder, --step one of its checkpoints.")
  mesh = moe_hk.make_mesh(**settings.mesh)
  abstract = steps_lib.abstract_inputs(settings.config, steps_lib.make_steps(settings, mesh))[0]
  chosen = steps[-1] if step is None else step
  restored = manager.restore(chosen, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))
  manager.close()
  return chosen, restored.state.params

