"""Config files on the command line: `--config=FILE` and its `--config.KEY=VALUE` overrides.

ml_collections answers a missing file or an unknown key with a traceback from inside flag
parsing; `launch.cli` checks both first with `load` and `unknown_override`, one line each that
names the file or key and what is valid. `as_flags` writes a config back as the overrides that
set every key.
"""
from __future__ import annotations

import difflib
import os
import runpy
import shlex
from typing import Sequence

import ml_collections

from launch.errors import UserError

# Keys of the launcher's config that moved (old path -> new path), each refused with a line
# naming the new one.
MOVED_KEYS = {
    "moe.autotune_ragged_buffer_factor": "autopilot.enabled",
    "moe.target_fallback_frequency": "autopilot.target_fallback_frequency",
    "moe.memory_budget_gib": "autopilot.memory_budget_gib",
    "moe.autotune_window": "autopilot.window",
    "moe.autotune_max_programs": "autopilot.max_programs",
    "moe.autotune_wait": "autopilot.wait",
    "moe.record_traffic": "traffic.record",
    "moe.traffic_max_mib": "traffic.max_mib",
    "moe.shared_expert": "shared_expert",
    "moe.log_required_ragged_buffer_factor": "moe.stream_step_stats",
}

# The config files that ship with the launcher, wherever the command runs.
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped() -> str:
  """The shipped config files, in words."""
  names = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".py") and n != "__init__.py")
  return f"Shipped configs: {', '.join(names)} in {CONFIGS}"


def config_path(argv: Sequence[str], flag: str) -> str | None:
  """The file `argv` gives `--flag` (`--flag=FILE` or `--flag FILE`; the last one), or None."""
  path = None
  for arg, following in zip(argv, [*argv[1:], None]):
    if arg.startswith(f"--{flag}="):
      path = arg.split("=", 1)[1]
    elif arg == f"--{flag}" and following is not None:
      path = following
  return path


def load(path: str, flag: str = "config") -> ml_collections.ConfigDict:
  """The config `path`'s `get_config()` returns; UserError when the file cannot give one."""
  if not os.path.isfile(path):
    raise UserError(f"--{flag}={path}: no such file (from {os.getcwd()}). {shipped()}.")
  try:
    module = runpy.run_path(path)
  except SyntaxError as e:
    raise UserError(f"--{flag}={path}: line {e.lineno}: {e.msg}; a config file is Python "
                    "with a get_config().") from None
  if "get_config" not in module:
    raise UserError(f"--{flag}={path}: defines no get_config(). {shipped()}.")
  return module["get_config"]()


def unknown_override(argv: Sequence[str], config: ml_collections.ConfigDict,
                     flag: str = "config") -> str | None:
  """The error for the first `--flag.a.b=...` whose path is not in `config`, else None."""
  for arg in argv:
    if not arg.startswith(f"--{flag}."):
      continue
    path = arg[len(flag) + 3:].split("=", 1)[0].split(".")
    dotted = ".".join(path)
    if dotted in MOVED_KEYS:
      return f"--{flag}.{dotted}: this key moved to --{flag}.{MOVED_KEYS[dotted]}."
    node = config
    for depth, key in enumerate(path):
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        where = ".".join([flag, *path[:depth]])
        keys = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
        hint = (f"closest: {', '.join(f'{where}.{c}' for c in close)}" if close else
                f"{where} has {', '.join(keys) if keys else 'no sub-keys'}")
        return f"--{'.'.join([flag, *path])}: no such config key ({hint})."
      node = node[key]
  return None


def as_flags(config: ml_collections.ConfigDict, flag: str = "config") -> list[str]:
  """`--flag.KEY=VALUE` for every key of `config` (nested keys dotted), quoted for a shell."""
  lines = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      lines += as_flags(value, f"{flag}.{key}")
    else:
      lines.append(f"--{flag}.{key}={shlex.quote(str(value))}")
  return lines
