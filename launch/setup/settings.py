"""The launcher's configuration, read once and checked once.

A config file (`--config=FILE`, a Python file with `get_config()`) is loaded once by `load`,
which applies the command line's `--config.KEY=VALUE` overrides to it. `build` then checks
every launcher setting against what is valid (the sections' owners say what is: the model's
remat policies, the attention forms, the data sources, the autopilot's settings) and builds
the one `moe_hk.MoEConfig` of the run from `config.moe` (whose keys are exactly `MoEConfig`'s
fields; the width, compute dtype and `record_traffic` come from `config.emb_dim`,
`config.dtype` and `config.traffic.record`). What the launcher runs takes the `Settings`;
a variant of the layer (an autopilot candidate, an AOT variant, a planner's factor) is
`dataclasses.replace(settings.layer, ...)`, never a write into the ConfigDict.

Every mistake is a `UserError` (a value: exit status 1) or an absl `UsageError` with exit
status 2 (a key that does not exist, a value that does not parse), one line that names the
key, the value and what is valid.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import os
import runpy
import shlex
from typing import Mapping, NamedTuple, Sequence

import ml_collections
from absl import app

import moe_hk
from launch.setup.errors import UserError, user_errors
from launch.setup.choices import (ATTENTION_IMPLS, DATA_SOURCES, REMAT_POLICIES, REMAT_UNITS,
                            ROPE_LAYOUTS, ROPE_SCALINGS, SPIKE_MIN_STEPS, resolve_attention)
from launch.planning import autopilot
from moe_hk import mesh as mesh_lib

# The config files that ship with the launcher, wherever the command runs.
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
RUN_CONFIG = "config.json"  # in a run's workdir: its resolved config (`save`, `saved`)
FLAG_MISUSE = 2  # the exit status of a command line that does not parse (launch.setup.cli)
# `MoEConfig` fields the launcher derives from its other keys: the model's width and compute
# dtype, and `record_traffic` from `config.traffic.record`.
DERIVED_MOE_FIELDS = ("emb_dim", "dtype", "record_traffic")
# The layer's host callbacks, which `config.moe_metrics=False` turns off.
CALLBACK_FIELDS = ("emit_fallback_events", "stream_step_stats")


class Settings(NamedTuple):
  """A checked run configuration: the launcher's settings and the MoE layers' config."""
  config: ml_collections.ConfigDict  # the config file with its overrides, as given
  layer: moe_hk.MoEConfig            # every MoE layer's settings, built once from config.moe
  mesh: Mapping[str, int]            # mesh axis sizes {'data', 'fsdp', 'expert'}

  @property
  def expert_shards(self) -> int:
    """P: the size of the mesh axis the experts are sharded over."""
    return self.mesh[self.layer.expert_axis]

  @property
  def moe_layers(self) -> int:
    """The model's MoE blocks (every `moe_every`-th block)."""
    return self.config.num_layers // self.config.moe_every


def shipped() -> str:
  """The shipped config files, in words."""
  names = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".py") and n != "__init__.py")
  return f"Shipped configs: {', '.join(names)} in {CONFIGS}"


def load(path: str, overrides: Sequence[tuple[str, str]] = (), flag: str = "config"
         ) -> ml_collections.ConfigDict:
  """The config `path`'s `get_config()` returns, with `overrides` (`(dotted key, text)`
  pairs, as `--flag.KEY=VALUE` gave them) applied in order.

  Raises `UserError` when the file cannot give a config, `app.UsageError` (exit status 2)
  for a key the config does not have or a value that does not parse as the key's type.
  """
  if not os.path.isfile(path):
    raise UserError(f"--{flag}={path}: no such file (from {os.getcwd()}). {shipped()}.")
  try:
    module = runpy.run_path(path)
  except SyntaxError as e:
    raise UserError(f"--{flag}={path}: line {e.lineno}: {e.msg}; a config file is Python "
                    "with a get_config().") from None
  if "get_config" not in module:
    raise UserError(f"--{flag}={path}: defines no get_config(). {shipped()}.")
  config = module["get_config"]()
  for key, text in overrides:
    _override(config, key, text, flag)
  return config


def load_record(workdir: str, overrides: Sequence[tuple[str, str]] = (),
                flag: str = "config") -> ml_collections.ConfigDict:
  """The config a run recorded in `workdir/config.json`, with `overrides` applied as `load`
  applies them (what `launch.train --workdir=W` without --config resumes with)."""
  config = saved(workdir)
  for key, text in overrides:
    _override(config, key, text, flag)
  return config


def _override(config: ml_collections.ConfigDict, key: str, text: str, flag: str) -> None:
  """Sets `config.<key>` from the command line's `text`, parsed as the key's current type."""
  *parents, name = key.split(".")
  node = config
  for depth, part in enumerate([*parents, name]):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      where = ".".join([flag, *key.split(".")[:depth]])
      keys = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(part, keys, n=3, cutoff=0.5)
      hint = (f"closest: {', '.join(f'{where}.{c}' for c in close)}" if close else
              f"{where} has {', '.join(keys) if keys else 'no sub-keys'}")
      raise app.UsageError(f"--{flag}.{key}: no such config key ({hint}; --print_config "
                           "lists every key).", exitcode=FLAG_MISUSE)
    if part != name:
      node = node[part]
  current = node[name]
  if isinstance(current, ml_collections.ConfigDict):
    raise app.UsageError(f"--{flag}.{key} is a section: set its keys ({', '.join(current)}).",
                         exitcode=FLAG_MISUSE)
  try:
    node[name] = _parse(text, current)
  except (ValueError, TypeError, SyntaxError, KeyError):
    kind = "None" if current is None else type(current).__name__
    raise app.UsageError(f"--{flag}.{key}={text}: not a valid {kind} (the key holds "
                         f"{current!r}; --print_config lists every key and its value).",
                         exitcode=FLAG_MISUSE) from None


def _parse(text: str, current: object) -> object:
  """`text` as a value of `current`'s type (bool, int, float, str; tuples and None literally)."""
  if isinstance(current, bool):
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    return words[text.strip().lower()]
  if isinstance(current, int):
    return int(text)
  if isinstance(current, float):
    return float(text)
  if isinstance(current, str):
    return text
  value = ast.literal_eval(text)
  if current is not None and not isinstance(value, type(current)):
    raise TypeError(text)
  return value


def save(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes a run's resolved config to `workdir/config.json`."""
  with open(os.path.join(workdir, RUN_CONFIG), "w") as f:
    f.write(config.to_json(indent=2))


def saved(workdir: str) -> ml_collections.ConfigDict:
  """The config a `launch.train` run saved in `workdir`; UserError naming what to do
  without one."""
  path = os.path.join(workdir, RUN_CONFIG)
  if not os.path.isfile(path):
    raise UserError(f"{path}: no such file; --workdir must be a launch.train run's folder "
                    "(runs write their config there when they start).")
  with open(path) as f:
    return ml_collections.ConfigDict(with_defaults(json.load(f)))


def with_defaults(recorded: dict) -> dict:
  """A recorded config with every key added to the shipped default config since it was
  written set to its default value (which keeps the model it recorded)."""
  def fill(into: dict, defaults: dict) -> dict:
    for key, value in defaults.items():
      if key not in into:
        into[key] = value
      elif isinstance(value, dict) and isinstance(into[key], dict):
        fill(into[key], value)
    return into
  return fill(json.loads(json.dumps(recorded)),
              load(os.path.join(CONFIGS, "default.py")).to_dict())


def as_flags(config: ml_collections.ConfigDict, flag: str = "config") -> list[str]:
  """`--flag.KEY=VALUE` for every key of `config` (nested keys dotted), quoted for a shell."""
  lines = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      lines += as_flags(value, f"{flag}.{key}")
    else:
      lines.append(f"--{flag}.{key}={shlex.quote(str(value))}")
  return lines


def cpu_devices(config: ml_collections.ConfigDict) -> int:
  """`config.cpu_devices`: the simulated CPU devices when jax runs on the CPU (8 without it)."""
  n = config.get("cpu_devices", 8)
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise UserError(f"config.cpu_devices={n!r} must be an integer >= 1 (the CPU devices jax "
                    "simulates where the machine has no TPU or GPU).")
  return n


def heartbeat_timeout_s(config: ml_collections.ConfigDict) -> int:
  """`config.heartbeat_timeout_s`: after this long without a heartbeat from a process, the
  others end the run (launch.setup.distributed)."""
  seconds = config.heartbeat_timeout_s
  if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 1:
    raise UserError(f"config.heartbeat_timeout_s={seconds!r} must be an integer >= 1 (seconds "
                    "without a heartbeat before a process counts as lost).")
  return seconds


def build(config: ml_collections.ConfigDict, devices: int,
          mesh: Mapping[str, int] | None = None, platform: str | None = None) -> Settings:
  """Checks `config` for a run on `devices` devices and builds its `MoEConfig`; `mesh` (axis
  sizes) replaces `config.mesh` (the planner regroups a run's devices). With `platform`
  ('cpu', 'tpu', 'gpu': where the run's devices are), the kernels and backends the config
  names must run there (compiles for another machine's topology leave it None).

  Raises `UserError` naming the first invalid key, its value and what is valid.
  """
  layer = _layer_config(config)
  given = config.mesh if mesh is None else mesh
  sizes = {axis: given[axis] for axis in mesh_lib.AXES}  # in mesh order
  _check_mesh(config, layer, sizes, devices)
  _check_model(config)
  _check_run(config, layer)
  if platform is not None:
    _check_platform(config, layer, platform)
  return Settings(config, layer, sizes)


def _check_platform(config: ml_collections.ConfigDict, layer: moe_hk.MoEConfig,
                    platform: str) -> None:
  """The attention form and the MoE backends run on `platform`: checked here, in one line,
  rather than when the step is traced (a traceback from inside the trace)."""
  with user_errors():
    resolve_attention(config.attention_impl, platform)
    moe_hk.mesh_forward.backends_on(layer, platform)


def _layer_config(config: ml_collections.ConfigDict) -> moe_hk.MoEConfig:
  """`MoEConfig` of `config.moe` (checked by MoEConfig itself: each field once)."""
  valid = [f.name for f in dataclasses.fields(moe_hk.MoEConfig)
           if f.name not in DERIVED_MOE_FIELDS]
  for key in config.moe:
    if key not in valid:
      close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
      raise UserError(f"config.moe.{key} is not a MoE setting" +
                      (f"; did you mean {', '.join('config.moe.' + c for c in close)}?"
                       if close else f"; valid keys: {', '.join(valid)}."))
  # The layer's callbacks feed the MoE telemetry: without it they are off too, which the
  # trainer says on the console (`launch.run.trainer`).
  callbacks = {} if config.moe_metrics else {name: False for name in CALLBACK_FIELDS}
  with user_errors():
    return moe_hk.MoEConfig(**{**config.moe, **callbacks}, emb_dim=config.emb_dim,
                            dtype=config.dtype,
                            record_traffic=config.traffic.record)


def _check_mesh(config: ml_collections.ConfigDict, layer: moe_hk.MoEConfig,
                sizes: Mapping[str, int], devices: int) -> None:
  """The mesh fits the devices and the layer (moe_hk's own checks), and the batch the mesh."""
  try:
    mesh_lib.check_device_count(sizes, devices)
  except ValueError as e:
    raise UserError(f"config.mesh: {e} Set config.mesh to fit the devices, or, on a machine "
                    "without a TPU or GPU, config.cpu_devices to the mesh's size.") from None
  with user_errors():
    mesh_lib.check_axes(layer, sizes)
  _require(config.data.batch_size % devices == 0,
           f"config.data.batch_size={config.data.batch_size} must be divisible by the "
           f"{devices} devices.")


def _check_model(config: ml_collections.ConfigDict) -> None:
  """The model's keys: its shape, remat policy and unit, attention form and chunking."""
  seq = config.data.seq_len
  _require(1 <= config.moe_every <= config.num_layers and config.num_layers % config.moe_every == 0,
           f"config.moe_every={config.moe_every} must divide config.num_layers="
           f"{config.num_layers} (every moe_every-th block is MoE).")
  _require(config.num_heads % config.num_kv_heads == 0,
           f"config.num_heads={config.num_heads} must be divisible by "
           f"config.num_kv_heads={config.num_kv_heads}.")
  _require(config.rope_theta > 0, f"config.rope_theta={config.rope_theta} must be > 0.")
  _check_positions(config)
  _require(0 < config.norm_eps < 1, f"config.norm_eps={config.norm_eps} must be in (0, 1).")
  _one_of("attention_impl", config.attention_impl, ATTENTION_IMPLS)
  _one_of("remat_policy", config.remat_policy, REMAT_POLICIES)
  _one_of("remat_unit", config.remat_unit, REMAT_UNITS)
  _require(type(config.layer_scan_unroll) is int and config.layer_scan_unroll >= 1,
           f"config.layer_scan_unroll={config.layer_scan_unroll!r} must be an integer >= 1 "
           "(layer groups per iteration of the scan over groups; their count unrolls it whole).")
  _one_of("optimizer_state_dtype", config.optimizer_state_dtype, moe_hk.config.DTYPES)
  _one_of("data.source", config.data.source, DATA_SOURCES)
  for name in ("attention_block", "loss_chunk"):
    _require(config[name] >= 0 and (config[name] == 0 or seq % config[name] == 0),
             f"config.{name}={config[name]} must be 0 (whole sequence) or a divisor of "
             f"config.data.seq_len={seq}.")


def _check_positions(config: ml_collections.ConfigDict) -> None:
  """The keys of `launch.model.positions` and the layer pattern they make."""
  _one_of("rope_layout", config.rope_layout, ROPE_LAYOUTS)
  scaling = config.rope_scaling
  _one_of("rope_scaling.type", scaling.type, ROPE_SCALINGS)
  if scaling.type == "llama3":
    _require(scaling.factor > 0 and scaling.original_max_positions > 0 and
             0 < scaling.low_freq_factor <= scaling.high_freq_factor,
             f"config.rope_scaling={scaling.to_dict()}: llama3 needs factor > 0, "
             "original_max_positions > 0 and 0 < low_freq_factor <= high_freq_factor.")
  for name in ("nope_every", "attention_chunk_size"):
    _require(isinstance(config[name], int) and config[name] >= 0,
             f"config.{name}={config[name]!r} must be an integer >= 0 (0: off).")
  period = math.lcm(config.moe_every, config.nope_every or 1)
  _require(config.num_layers % period == 0,
           f"config.num_layers={config.num_layers} must be a multiple of {period}, the "
           f"period of the layer pattern (moe_every={config.moe_every}, "
           f"nope_every={config.nope_every}).")
  _require(config.floor_scale > 0, f"config.floor_scale={config.floor_scale} must be > 0.")


def _check_run(config: ml_collections.ConfigDict, layer: moe_hk.MoEConfig) -> None:
  """The loop's keys: steps, intervals, the autopilot, traffic recording, non-finite stops."""
  with user_errors():
    autopilot.check_settings(config.autopilot, layer, config.moe_metrics)
  _require(config.traffic.max_mib >= 0,
           f"config.traffic.max_mib={config.traffic.max_mib} must be >= 0.")
  _require(config.max_consecutive_nonfinite >= 1,
           f"config.max_consecutive_nonfinite={config.max_consecutive_nonfinite} must be >= 1.")
  for name in ("train_steps", "eval_every", "checkpoint_every", "log_every", "learning_rate"):
    _require(config[name] > 0, f"config.{name}={config[name]} must be > 0.")
  _require(config.get("schedule_steps", 0) >= 0, f"config.schedule_steps="
           f"{config.get('schedule_steps')} must be >= 0 (0: the first start's train_steps).")
  _require(config.peak_tflops_per_device >= 0,
           f"config.peak_tflops_per_device={config.peak_tflops_per_device} must be >= 0 (0: "
           "the table's figure for the device kind).")
  spikes = config.spikes
  _require(spikes.sigma > 0, f"config.spikes.sigma={spikes.sigma} must be > 0.")
  _require(spikes.window >= SPIKE_MIN_STEPS,
           f"config.spikes.window={spikes.window} must be >= {SPIKE_MIN_STEPS} (the applied "
           "steps a spike is judged against).")


def _one_of(key: str, value: object, valid: Sequence[str]) -> None:
  _require(value in valid, f"config.{key}={value!r} must be one of "
           f"{', '.join(repr(v) for v in valid)}.")


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise UserError(message)
