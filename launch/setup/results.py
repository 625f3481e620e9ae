"""Measured figures as data: `benchmarks/results/<name>.json`, with what produced them.

Every benchmark and `launch.aot` writes its figures through `write`, beside the command line
that reproduces them, the commit they were measured at (with `+changes` when the working tree
differed from it), the date and the machine; the docs quote these files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

import jax

from launch.setup.errors import UserError

# The repository's root (this file is launch/setup/results.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def commit() -> str:
  """The checkout's commit, `+changes` appended when tracked files differ from it; 'unknown'
  outside a git checkout."""
  def git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                          timeout=30, check=True).stdout.strip()
  try:
    head = git("rev-parse", "--short=12", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return os.environ.get("GIT_COMMIT", "unknown")
  return head + ("+changes" if changed else "")


def machine() -> dict:
  """The host and the devices the figures were measured on."""
  device = jax.devices()[0]
  return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
          "jax": jax.__version__, "platform": device.platform,
          "device_kind": device.device_kind, "devices": jax.device_count()}


def command(argv: list[str] | None = None) -> str:
  """`python -m MODULE ARGS` of this process (the module `__main__` runs as)."""
  argv = sys.argv if argv is None else argv
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  program = f"python -m {spec.name}" if spec else f"python {argv[0]}"
  return " ".join([program, *map(shlex.quote, argv[1:])])


def record(figures: dict[str, Any], argv: list[str] | None = None,
           measured_on: dict | None = None) -> dict[str, Any]:
  """`figures` after the `command`, `commit`, `date` and `machine` that produced them
  (`measured_on`: the `machine()` of the process that measured, when it was another one)."""
  return {"command": command(argv), "commit": commit(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": measured_on or machine(), **figures}


def write(name: str, figures: dict[str, Any], argv: list[str] | None = None,
          measured_on: dict | None = None) -> str:
  """Writes `record(figures, argv, measured_on)` to `benchmarks/results/<name>.json`;
  returns the path."""
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, f"{name}.json")
  # Stamped before the file is opened: truncating a committed result would read as a change.
  stamped = record(figures, argv, measured_on)
  with open(path, "w") as f:
    json.dump(stamped, f, indent=2)
    f.write("\n")
  return path


def read_rows(path: str, flag: str, writer: str, field: str) -> list[dict[str, Any]]:
  """The rows (the list under `field`) of the results JSON at `path`, which the command-line
  flag `flag` names and the module `writer` writes; a UserError in one line for a file that
  is not one."""
  try:
    with open(path) as f:
      rows = json.load(f)[field]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
      raise TypeError(f"{field!r} holds no list of rows")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"{flag}={path}: not a results file of {writer} ({e}); give the path of a "
                    "JSON it wrote to benchmarks/results/") from None
  return rows


def add_argument(parser: argparse.ArgumentParser, name: str) -> None:
  """`--results NAME` on a benchmark's parser: where `publish` writes (empty: nowhere)."""
  parser.add_argument("--results", default=name,
                      help="name of the JSON written to benchmarks/results/ ('' writes none)")


def publish(name: str, figures: dict[str, Any]) -> str | None:
  """Prints `figures` as JSON and, when `name` is not empty, writes them (`write`); returns
  the path written."""
  print(json.dumps(figures, indent=2))
  if not name:
    return None
  path = write(name, figures)
  print(f"\nwritten: {path}")
  return path
