"""`StopRequest`: SIGTERM and Ctrl-C as a request the training loop reads between steps."""
from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils


class StopRequest:
  """SIGTERM and SIGINT (Ctrl-C) as a request the loop reads after each step, all processes
  agreeing on it: the step finishes, is checkpointed and the run returns. A second SIGINT
  ends the process at once (exit status 130): orbax renames a checkpoint into place only
  once it is complete, so the newest complete one stays intact."""

  def __init__(self):
    self.signal: int | None = None  # the first stop signal received
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for number in (signal.SIGTERM, signal.SIGINT):
        self._previous[number] = signal.signal(number, self._handle)

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      sys.stderr.write("second Ctrl-C: exiting now, without a checkpoint of this step (the "
                       "newest complete checkpoint stays as it is).\n")
      os._exit(130)
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    if jax.process_index() == 0:
      logging.warning("%s: finishing the current step, then checkpointing%s.", name,
                      " (Ctrl-C again exits at once)" if signum == signal.SIGINT else "")
    self.signal = self.signal or signum

  @property
  def interrupted(self) -> bool:
    """Whether the run was stopped by Ctrl-C (its exit status is then 130, not 0)."""
    return self.signal == signal.SIGINT

  def should_stop(self) -> bool:
    if jax.process_count() == 1:
      return self.signal is not None
    requested = np.int32(self.signal is not None)
    return bool(np.max(multihost_utils.process_allgather(requested)))

  def restore(self) -> None:
    for number, previous in self._previous.items():
      signal.signal(number, previous)
