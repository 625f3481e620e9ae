"""The launcher's one kind of user error.

`UserError` is a mistake in what the user asked for (a config value, a path, the data): the
entry points print its message as one line and exit with status 1, without a traceback. Every
other exception is the project's bug and keeps its traceback.
"""


class UserError(ValueError):
  """A user's mistake; the message names the flag or field, the value and what is valid."""
