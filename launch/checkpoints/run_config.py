"""`WORKDIR/config.json`, the run's record: what its checkpoints hold, checked at each start.

A start compares its config with the recorded one before anything is restored or written.
A changed key of `STORED` (what a checkpoint holds: parameter shapes, the optimizer state's
dtype, the data iterator's kind) ends the start in one line (`UserError`) naming each such key,
old and new; any other change is logged once. `config.schedule_steps` (0: the first start's
`train_steps`) is resolved here and recorded, so the learning-rate schedule outlives a raised
`train_steps`. `write` records a start that succeeded: `config.json`, and the same config in
`configs/<step>.json` (the step it started at), so earlier starts' configs are kept.
"""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import ml_collections

from launch.model import train_step as steps_lib
from launch.setup import settings as settings_lib
from launch.setup.errors import UserError

# Keys whose change makes the checkpoints unreadable or wrong for the new config: parameter
# shapes (the model's and its MoE layers'), the optimizer moments' stored dtype, the kind of
# data iterator state. The mesh is not among them: parameters have one global shape, which
# orbax reshards to any mesh.
STORED = ("vocab_size", "emb_dim", "num_layers", "moe_every", "nope_every", "num_heads",
          "num_kv_heads",
          "head_dim", "mlp_dim", "shared_expert", "moe.num_experts", "moe.mlp_dim",
          "optimizer_state_dtype", "data.source")
HISTORY = "configs"  # WORKDIR/configs/<step>.json: the config of the start at that step


def flatten(config: ml_collections.ConfigDict | dict, prefix: str = "") -> dict[str, Any]:
  """`{'moe.num_experts': 8, ...}`: every leaf of `config` under its dotted key."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[prefix + key] = value
  return flat


class Start(NamedTuple):
  """A start's config checked against the record."""
  config: ml_collections.ConfigDict  # the new config, schedule_steps resolved
  changed: list[str]     # 'key old -> new' for the keys changed since the recorded start
  recorded_schedule: int | None  # the recorded schedule_steps (None: a first start)


def _recorded(workdir: str) -> dict | None:
  path = os.path.join(workdir, settings_lib.RUN_CONFIG)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return settings_lib.with_defaults(json.load(f))


def _show(value: Any) -> str:
  return json.dumps(value) if isinstance(value, (list, tuple)) else repr(value)


def check(config: ml_collections.ConfigDict, workdir: str) -> Start:
  """`config` against `workdir`'s record; UserError when a `STORED` key changed."""
  recorded = _recorded(workdir)
  config = ml_collections.ConfigDict(config.to_dict())  # the caller's stays as given
  if recorded is None:
    config.schedule_steps = config.schedule_steps or config.train_steps
    return Start(config, [], None)
  # A record without the key predates it: its first start planned train_steps. One that holds
  # 0 was written before any start (launch.convert): this start plans it.
  schedule = recorded.get("schedule_steps", recorded["train_steps"]) or None
  config.schedule_steps = config.schedule_steps or schedule or config.train_steps
  old, new = flatten(recorded), flatten(json.loads(config.to_json()))
  changed = [key for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
  refused = [key for key in changed if key in STORED]
  if refused:
    listed = ", ".join(f"config.{k} {_show(old.get(k))} -> {_show(new.get(k))}"
                       for k in refused)
    raise UserError(f"{workdir} holds checkpoints of another model: {listed} changed since "
                    f"its last start ({os.path.join(workdir, settings_lib.RUN_CONFIG)}); start "
                    "a new run in another --workdir, or drop the override to resume this one.")
  notes = [f"{k} {_show(old.get(k))} -> {_show(new.get(k))}" for k in changed]
  return Start(config, notes, schedule)


def write(config: ml_collections.ConfigDict, workdir: str, step: int) -> None:
  """Records the config of a start at `step` that succeeded (process 0 only calls it)."""
  history = os.path.join(workdir, HISTORY)
  os.makedirs(history, exist_ok=True)
  with open(os.path.join(history, f"{step}.json"), "w") as f:
    f.write(config.to_json(indent=2))
  settings_lib.save(config, workdir)


def schedule_notes(start: Start, step: int) -> list[str]:
  """What a start at `step` does to the learning-rate schedule, in lines (none when nothing
  is to be said): a schedule that ends before `train_steps`, a re-planned one."""
  config, lines = start.config, []
  rate = steps_lib.learning_rate_schedule(config)
  if start.recorded_schedule not in (None, config.schedule_steps):
    before = ml_collections.ConfigDict(config.to_dict())
    before.schedule_steps = start.recorded_schedule
    lines.append(
        f"config.schedule_steps {start.recorded_schedule} -> {config.schedule_steps} re-plans "
        f"the learning rate: at step {step} it was "
        f"{float(steps_lib.learning_rate_schedule(before)(step)):.3g}, it is now "
        f"{float(rate(step)):.3g}.")
  if config.train_steps > config.schedule_steps:
    lines.append(
        f"learning rate: the schedule ends at step {config.schedule_steps} (config."
        f"schedule_steps{', as recorded' if start.recorded_schedule else ''}); steps "
        f"{config.schedule_steps}-{config.train_steps - 1} train at rate "
        f"{float(rate(config.schedule_steps)):.3g}: --config.schedule_steps=N re-plans it.")
  return lines
