"""Checks `--config.KEY=VALUE` overrides against the config file before absl parses them.

ml_collections answers an unknown key with a traceback from inside flag parsing; here it is one
line that names the key and the closest valid ones. Used as `app.run(main, flags_parser=...)`.
"""
from __future__ import annotations

import difflib
import runpy
import sys
from typing import Callable, Sequence

import ml_collections
from absl import app


def _config_path(argv: Sequence[str], flag: str, default: str) -> str:
  path = default
  for arg in argv:
    if arg.startswith(f"--{flag}="):
      path = arg.split("=", 1)[1]
  return path


def unknown_override(argv: Sequence[str], config: ml_collections.ConfigDict,
                     flag: str = "config") -> str | None:
  """The error for the first `--flag.a.b=...` whose path is not in `config`, else None."""
  for arg in argv:
    if not arg.startswith(f"--{flag}."):
      continue
    path = arg[len(flag) + 3:].split("=", 1)[0].split(".")
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


def flags_parser(flag: str, default_path: str) -> Callable[[list[str]], list[str]]:
  """An absl `flags_parser` that refuses unknown `--flag.KEY` overrides in one line."""
  def parse(argv: list[str]) -> list[str]:
    path = _config_path(argv, flag, default_path)
    try:
      config = runpy.run_path(path)["get_config"]()
    except (OSError, KeyError, SyntaxError):
      config = None  # the config flag reports a bad file itself
    message = config is not None and unknown_override(argv, config, flag)
    if message:
      sys.stderr.write(f"FATAL Flags parsing error: {message}\n")
      sys.exit(1)
    return app.parse_flags_with_usage(argv)
  return parse
