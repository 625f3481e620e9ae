"""The entry points' command line: flags parsed, and the user's mistakes reported, in one line.

`run(main)` stands in for absl's `app.run(main)`. A mistake ends the program before anything
compiles with one line on stderr, `PROGRAM: error: MESSAGE`, naming the flag or config field,
the value and what is valid, with no traceback and no absl usage dump. The exit status says
which kind of mistake:

  2 (FLAG_MISUSE)  the command line does not parse: an unknown flag or config key, a missing
                   required flag, a value that does not parse as the flag's or key's type, an
                   argument that is not a flag;
  1 (USER_ERROR)   it parses but asks for something invalid: `main` raised a `UserError` (a
                   config value, a file, the data), or an absl `UsageError` (its `exitcode`).
  130 (INTERRUPTED) Ctrl-C stopped a run cleanly (`Interrupted`: its one line, no "error").

With several processes, the line of a process other than 0 names it: `PROGRAM [process I/N]`.

Any other exception is the program's bug and keeps its traceback.

A config flag (`define_config`) takes a config file, `--NAME=FILE`, whose keys the command line
sets as `--NAME.KEY=VALUE`: the file is loaded once, with its overrides, by
`launch.setup.settings.load` before absl parses the other flags. `--print_config` prints every
config flag's resolved config, one `--NAME.KEY=VALUE` line per key, and exits.
"""
from __future__ import annotations

import functools
import os
import shlex
import sys
from typing import Any, Callable, NoReturn

import ml_collections
from absl import app, flags

from launch.setup import settings
from launch.setup.errors import Interrupted, UserError

USER_ERROR, FLAG_MISUSE, INTERRUPTED = 1, settings.FLAG_MISUSE, 130
# (index, count) of this process once jax.distributed started (`set_process`).
_PROCESS = (0, 1)


class ConfigFlag:
  """`--NAME=FILE`'s config, with its `--NAME.KEY=VALUE` overrides, once the command line is
  parsed (`value`; None when no file was given and there is no default)."""

  def __init__(self, name: str, default: str | None):
    self.name = name
    self.default = default and os.path.join(settings.CONFIGS, default)
    self.path: str | None = None  # the file loaded
    self.value: ml_collections.ConfigDict | None = None
    self.explicit = False  # whether the command line named the file
    self.overrides: list[tuple[str, str]] = []  # its --NAME.KEY=VALUE pairs, in order

  def take(self, argv: list[str]) -> list[str]:
    """Loads the config `argv` names (or the default) with its overrides; returns `argv`
    without them, for absl."""
    path, overrides, rest = self.default, [], []
    self.path, self.value = None, None
    i = 0
    while i < len(argv):
      arg = argv[i]
      if arg == f"--{self.name}" and i + 1 < len(argv):
        path, i = argv[i + 1], i + 2
        continue
      if arg.startswith(f"--{self.name}="):
        path = arg.split("=", 1)[1]
      elif arg.startswith(f"--{self.name}."):
        key, sep, text = arg[len(self.name) + 3:].partition("=")
        if not sep:  # `--config.KEY VALUE`
          if i + 1 >= len(argv):
            raise app.UsageError(f"{arg}: needs a value (--{self.name}.{key}=VALUE).",
                                 exitcode=FLAG_MISUSE)
          text, i = argv[i + 1], i + 1
        overrides.append((key, text))
      else:
        rest.append(arg)
      i += 1
    if path is None and overrides:
      raise app.UsageError(f"--{self.name}.{overrides[0][0]} needs --{self.name}=FILE.",
                           exitcode=FLAG_MISUSE)
    if path is not None:
      self.value = settings.load(path, overrides, self.name)
    self.path, self.overrides = path, overrides
    self.explicit = path is not None and path != self.default
    return rest


# The config flags `define_config` made: `parse` loads them before absl parses the rest.
_CONFIG_FLAGS: dict[str, ConfigFlag] = {}

# The flags `define_config` defines belong to its caller, whose --help lists them.
flags.disclaim_key_flags()


def define_config(name: str, default: str | None, help_text: str) -> ConfigFlag:
  """`--NAME`: a config file, each key settable as --NAME.KEY=VALUE; by default (without one
  on the command line) the shipped `default`, a file name in launch/configs/."""
  holder = ConfigFlag(name, default)
  if not _CONFIG_FLAGS:
    flags.DEFINE_boolean("print_config", False, "Print the resolved config (the file with its "
                         "overrides), one --config.KEY=VALUE line per key, unchecked, and exit; "
                         "what each key means is commented in the config file and in "
                         "launch/configs/default.py, which the others extend.")
  _CONFIG_FLAGS[name] = holder
  # Declared to absl for --help only: `parse` takes the file and its keys off the command line.
  flags.DEFINE_string(
      name, holder.default, f"{help_text} {settings.shipped()}. Set any key as "
      f"--{name}.KEY=VALUE; --print_config lists every key and its value.")
  return holder


def runnable(program: str, *args: str) -> str:
  """A command line to print for the operator that runs as typed from where the command was
  started: `program` ('python' or a console script such as 'tensorboard') from this
  interpreter's own bin folder (the venv's: `.venv/bin/python` from the checkout), then
  `args`, quoted for a shell."""
  folder = os.path.dirname(sys.executable)
  relative = os.path.relpath(folder)
  folder = relative if not relative.startswith("..") else folder
  return " ".join([os.path.join(folder, program), *map(shlex.quote, args)])


def set_process(index: int, count: int) -> None:
  """Names this process in its one-line errors (the entry point calls it once jax.distributed
  started)."""
  global _PROCESS
  _PROCESS = (index, count)


def program() -> str:
  """`launch.train` for `python -m launch.train` (`launch.train [process 1/32]` on another
  process than 0)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  name = spec.name if spec else os.path.basename(sys.argv[0])
  index, count = _PROCESS
  return f"{name} [process {index}/{count}]" if index else name


def fail(message: str, status: int) -> NoReturn:
  """Ends the program: `PROGRAM: error: MESSAGE` on stderr in one line, exit status `status`."""
  sys.stderr.write(f"{program()}: error: {' '.join(message.split())}\n")
  sys.exit(status)


def parse(argv: list[str]) -> list[str]:
  """absl's flag parsing (an `app.run` flags_parser), each config file loaded first with its
  overrides; a mistake ends the program in one line."""
  try:
    for holder in _CONFIG_FLAGS.values():
      argv = holder.take(argv)
  except UserError as e:
    fail(str(e), USER_ERROR)
  except app.UsageError as e:
    fail(str(e), e.exitcode)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"{e} (--help lists the flags)", FLAG_MISUSE)


def print_configs() -> None:
  """`--print_config`'s output: every loaded config as `--NAME.KEY=VALUE` lines."""
  for holder in _CONFIG_FLAGS.values():
    if holder.value is not None:
      print("\n".join(settings.as_flags(holder.value, holder.name)))


def one_line_errors(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  """`main`, its user errors (and arguments that are not flags) ending it in one line;
  with `--print_config`, the configs printed instead."""
  @functools.wraps(main)
  def run_main(argv: list[str]) -> Any:
    if len(argv) > 1:
      fail(f"unexpected arguments {' '.join(argv[1:])}: every option is a --flag (--help "
           "lists them).", FLAG_MISUSE)
    if _CONFIG_FLAGS and flags.FLAGS["print_config"].value:
      return print_configs()
    try:
      return main(argv)
    except UserError as e:
      fail(str(e), USER_ERROR)
    except Interrupted as e:
      if _PROCESS[0] == 0:
        print(e, flush=True)
      sys.exit(INTERRUPTED)
    except app.UsageError as e:
      fail(str(e), e.exitcode)
  return run_main


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run(main)` with one-line errors (the module docstring)."""
  app.run(one_line_errors(main), flags_parser=parse)
