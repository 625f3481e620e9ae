"""The entry points' command line: flags parsed, and the user's mistakes reported, in one line.

`run(main)` stands in for absl's `app.run(main)`. A mistake ends the program before anything
compiles with one line on stderr, `PROGRAM: error: MESSAGE`, naming the flag or config field,
the value and what is valid, with no traceback and no absl usage dump. The exit status says
which kind of mistake:

  2 (FLAG_MISUSE)  the command line does not parse: an unknown flag or config key, a missing
                   required flag, a value absl cannot read as the flag's type, an argument
                   that is not a flag;
  1 (USER_ERROR)   it parses but asks for something invalid: `main` raised a `UserError` (a
                   config value, a file, the data), or an absl `UsageError` (its `exitcode`).

Any other exception is the program's bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, NoReturn

from absl import app, flags
from ml_collections import config_flags

from launch import overrides
from launch.errors import UserError

USER_ERROR, FLAG_MISUSE = 1, 2

# The config file flags `define_config` made (name -> default file): `parse` checks them first.
_CONFIG_FLAGS: dict[str, str | None] = {}

# The flags `define_config` defines belong to its caller, whose --help lists them.
flags.disclaim_key_flags()


def define_config(name: str, default: str | None, help_text: str) -> flags.FlagHolder:
  """`--NAME`: a config file, each key settable as --NAME.KEY=VALUE; by default (without one
  on the command line) the shipped `default`, a file name in launch/configs/."""
  path = default and os.path.join(overrides.CONFIGS, default)
  _CONFIG_FLAGS[name] = path
  # No default for ml_collections: it would load the file, and apply the command line's
  # overrides, at this definition, where an unknown key is a traceback. `parse` gives it.
  holder = config_flags.DEFINE_config_file(
      name, None, f"{help_text} {overrides.shipped()}. Set any key as --{name}.KEY=VALUE; "
      "`python -m launch.train --config=FILE --print_config` lists every key and its value.")
  flags.FLAGS[name].default_as_str = repr(path)  # what --help shows as the default
  return holder


def _program() -> str:
  """`launch.train` for `python -m launch.train`."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  return spec.name if spec else os.path.basename(sys.argv[0])


def fail(message: str, status: int) -> NoReturn:
  """Ends the program: `PROGRAM: error: MESSAGE` on stderr in one line, exit status `status`."""
  sys.stderr.write(f"{_program()}: error: {' '.join(message.split())}\n")
  sys.exit(status)


def parse(argv: list[str]) -> list[str]:
  """absl's flag parsing (an `app.run` flags_parser), each config file and its overrides
  checked first; a mistake ends the program in one line."""
  for name, default in _CONFIG_FLAGS.items():
    path = overrides.config_path(argv, name)
    if path is None and default:
      path, argv = default, [argv[0], f"--{name}={default}", *argv[1:]]
    if path is None:
      continue
    try:
      config = overrides.load(path, name)
    except UserError as e:
      fail(str(e), USER_ERROR)
    message = overrides.unknown_override(argv, config, name)
    if message:
      fail(message, FLAG_MISUSE)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"{e} (--help lists the flags)", FLAG_MISUSE)


def one_line_errors(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  """`main`, its user errors (and arguments that are not flags) ending it in one line."""
  @functools.wraps(main)
  def run_main(argv: list[str]) -> Any:
    if len(argv) > 1:
      fail(f"unexpected arguments {' '.join(argv[1:])}: every option is a --flag (--help "
           "lists them).", FLAG_MISUSE)
    try:
      return main(argv)
    except UserError as e:
      fail(str(e), USER_ERROR)
    except app.UsageError as e:
      fail(str(e), e.exitcode)
  return run_main


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run(main)` with one-line errors (the module docstring)."""
  app.run(one_line_errors(main), flags_parser=parse)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
  """Turns the ValueErrors raised inside into UserErrors: for checks of what the user asked
  for (config validation), whose messages name the field, the value and what is valid."""
  try:
    yield
  except ValueError as e:
    raise UserError(str(e)) from None
