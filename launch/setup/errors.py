"""The launcher's one kind of user error, and the one way a library check becomes one.

`UserError` is a mistake in what the user asked for (a config value, a path, the data): the
entry points print its message as one line and exit with status 1, without a traceback
(`launch.setup.cli`). Every other exception is the project's bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


class UserError(ValueError):
  """A user's mistake; the message names the flag or field, the value and what is valid."""


class Interrupted(Exception):
  """The operator stopped the run with Ctrl-C; it stopped cleanly (a checkpoint of its last
  step). The entry point exits with status 130 (128 + SIGINT), as an interrupted command
  does, so that a script does not go on as if the run had finished; its message is the
  console's last line."""


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
  """Turns the ValueErrors raised inside into UserErrors: for checks of what the user asked
  for (`moe_hk`'s config and mesh checks, the data's), whose messages name the value and
  what is valid. Wrap only such checks: a bug's ValueError must keep its traceback."""
  try:
    yield
  except UserError:
    raise
  except ValueError as e:
    raise UserError(str(e)) from None
