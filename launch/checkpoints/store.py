"""The run's orbax checkpoints, which never strand it.

A checkpoint holds the train state and the JSON state of each of the run's stateful parts (a
`{name: Stateful}` mapping: the trainer's are the data iterator, the MoE metrics' trailing
windows, the alerts' rate limits and the autopilot), in `WORKDIR/checkpoints/<step>` (the state
before step `<step>`, steps counted from 0), one item a part. On restore the newest checkpoint that
reads wins: newer ones that do not read (a truncated array file, garbage JSON) are moved aside
to `checkpoints/corrupt-<step>` (never deleted), each with one warning line, so a restart
resumes by itself, and nothing else about it reaches the console (the failed reads' late
callbacks and asyncio's reports of them: `_drop_late_reads`). When none reads, nothing moves
and the run stops with one line naming the folder. A save that fails (disk full, read-only
folder) stops the run with one line; orbax writes each checkpoint to a temporary folder and
renames it when complete, so the previous checkpoint stays intact, and the failed save's
temporary folder is removed (its space is freed where the folder is writable).
"""
from __future__ import annotations

import logging as logging_lib
import os
import shutil
import sys
import time
from typing import Any, Mapping, NamedTuple, Protocol

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from launch.setup.errors import UserError

_PARTIAL = ".orbax-checkpoint-tmp"  # in the name of a checkpoint orbax is still writing


def newest_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step in `workdir/checkpoints` (orbax renames a
  checkpoint to its step only when it is complete), read from the folder names alone."""
  folder = os.path.join(workdir, "checkpoints")
  steps = [int(name) for name in os.listdir(folder) if name.isdigit()] if os.path.isdir(
      folder) else []
  return max(steps, default=None)


_STATE = "state"  # the train state's item; every other item is a stateful part's JSON


class Stateful(Protocol):
  """A part of a run whose state a checkpoint keeps beside the train state."""

  def state_dict(self) -> dict:
    """JSON-serialisable."""

  def load_state_dict(self, state: dict) -> None:
    """Restores what `state_dict` returned."""


class GetSetState:
  """A part with grain's naming (`get_state`, `set_state`: the data iterators) as a
  `Stateful`."""

  def __init__(self, part):
    self.part = part

  def state_dict(self) -> dict:
    return self.part.get_state()

  def load_state_dict(self, state: dict) -> None:
    self.part.set_state(state)


class Restored(NamedTuple):
  """What a checkpoint holds, read but not yet applied."""
  step: int
  state: Any           # the train state, shaped and sharded like the one passed in
  parts: dict          # name -> the part's `state_dict()`, for every part the checkpoint has

  def apply(self, parts: Mapping[str, Stateful]) -> None:
    """Loads each of `parts` whose state the checkpoint holds (a part absent from it, or
    saved empty, keeps its state)."""
    for name, part in parts.items():
      if self.parts.get(name):
        part.load_state_dict(self.parts[name])


def _reason(error: Exception) -> str:
  """The first line of an exception, short enough for a log line."""
  text = str(error).strip().splitlines()
  first = text[0] if text else ""
  return f"{type(error).__name__}: {first[:200]}"


def _late_read(unraisable) -> bool:
  """Whether an unraisable exception comes from a failed restore's reads: a callback that
  finds orbax's asyncio loop closed, or a read coroutine of orbax's whose error nobody
  awaited (the same unreadable file, already reported)."""
  if (isinstance(unraisable.exc_value, RuntimeError) and
      str(unraisable.exc_value) == "Event loop is closed"):
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _LateReadLogs(logging_lib.Filter):
  """asyncio's reports of a failed restore's reads: tasks destroyed while pending, and futures
  whose read error (naming a file of a checkpoints folder in `folders`) nobody retrieved."""

  def __init__(self):
    super().__init__()
    self.folders: set[str] = set()

  def filter(self, record: logging_lib.LogRecord) -> bool:
    text = record.getMessage()
    if text.startswith("Task was destroyed but it is pending"):
      return False
    return not (text.startswith("Future exception was never retrieved") and
                any(folder in text for folder in self.folders))


_LATE_READ_LOGS = _LateReadLogs()


def _drop_late_reads(folder: str) -> None:
  """Before restoring from checkpoints `folder`: when a read fails, orbax closes the event
  loop it reads the checkpoint's arrays on, while the other reads are still under way in
  tensorstore; those finish later, failing on the same file or not, with nobody to take their
  results: their callbacks find that loop closed (`RuntimeError: Event loop is closed`), their
  coroutines' errors are never awaited (both printed as unraisable exceptions, hundreds of
  tracebacks for a large state), and asyncio reports their tasks destroyed while pending and
  their futures' errors never retrieved. The first of them can come before the restore's
  error reaches the caller, so this is in place before any read. Those, and only those, are
  dropped for the rest of the process: every other unraisable exception and asyncio error
  still prints."""
  _LATE_READ_LOGS.folders.add(folder)
  previous = sys.unraisablehook
  if getattr(previous, "drops_late_reads", False):
    return
  def hook(unraisable):
    if not _late_read(unraisable):
      previous(unraisable)
  hook.drops_late_reads = True
  sys.unraisablehook = hook
  logging_lib.getLogger("asyncio").addFilter(_LATE_READ_LOGS)


class Checkpoints:
  """`WORKDIR/checkpoints`: periodic saves, and restores that skip unreadable checkpoints."""

  def __init__(self, workdir: str, *, keep: int, every: int):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    # The save's temporary folder is made before `save` returns, not by a background thread:
    # when that thread fails (a read-only folder), the save's writes, started beside it, wait
    # for its signal until orbax's coordination timeout and are never run, their coroutines
    # dropped unawaited (a RuntimeWarning each when collected). Made in `save`, a folder that
    # cannot be written fails there, before any write starts.
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False)))
    self.writing: int | None = None  # the step of the save started last, until `wait`

  @staticmethod
  def state_bytes(state) -> int:
    """Bytes of `state`'s arrays over all devices' shards, as a checkpoint writes them."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def save(self, step: int, state, parts: Mapping[str, Stateful]) -> None:
    """Starts writing checkpoint `step` (in the background): the train `state` and each of
    `parts`' `state_dict()`; UserError when a write fails."""
    if _STATE in parts:
      raise ValueError(f"Checkpoints.save: {_STATE!r} names the train state, not a part.")
    items = {name: ocp.args.JsonSave(part.state_dict()) for name, part in parts.items()}
    self.writing = step
    self._guarded(lambda: self._manager.save(step, force=True, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(state)}, **items)))

  def wait(self) -> None:
    """Blocks until every started save is complete; UserError when one failed."""
    self._guarded(self._manager.wait_until_finished)
    self.writing = None

  def _guarded(self, write) -> None:
    try:
      write()
    except Exception as e:  # tensorstore and orbax wrap the OS error in their own types
      if jax.process_index() == 0:
        self._remove_partial()
      intact = [s for s in self._manager.all_steps()
                if os.path.isdir(os.path.join(self.directory, str(s)))]
      newest = (f"checkpoints/{max(intact)} is the newest intact one" if intact else
                "none was written")
      raise UserError(f"writing a checkpoint to {self.directory} failed ({_reason(e)}); "
                      f"{newest}: free space or fix the folder's permissions, then rerun to "
                      "resume.") from None

  def _remove_partial(self, attempts: int = 20, pause_s: float = 0.25) -> None:
    """Removes the failed save's temporary folders (never renamed to a step). orbax raises at
    the first failed write while the save's other writes may still be creating files, and a
    file created after `rmtree` listed its folder leaves the folder behind: removal is
    retried until the folders stay gone."""
    for _ in range(attempts):
      partial = [os.path.join(self.directory, name) for name in os.listdir(self.directory)
                 if _PARTIAL in name]
      if not partial:
        return
      for path in partial:
        shutil.rmtree(path, ignore_errors=True)
      time.sleep(pause_s)

  def restore(self, abstract_state) -> Restored | None:
    """The newest checkpoint that reads (None when there is none); `abstract_state` gives the
    train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s). Newer unreadable
    checkpoints are moved aside."""
    steps = sorted(self._manager.all_steps(), reverse=True)
    failed = []
    if steps:
      _drop_late_reads(self.directory)
    for step in steps:
      try:
        names = self._part_names(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            **{_STATE: ocp.args.StandardRestore(abstract_state)},
            **{name: ocp.args.JsonRestore() for name in names}))
      except Exception as e:  # what an unreadable checkpoint raises varies by what broke
        failed.append((step, _reason(e)))
        continue
      for bad, reason in failed:
        self._move_aside(bad, reason)
      if failed:
        self._manager.reload()
      return Restored(step, restored[_STATE], {name: restored[name] or {} for name in names})
    if failed:
      listed = "; ".join(f"step {s}: {r}" for s, r in failed)
      raise UserError(f"no checkpoint in {self.directory} reads ({listed}): move the folder "
                      "away to train from scratch, or restore a copy.")
    return None

  def _part_names(self, step: int) -> list[str]:
    """The parts checkpoint `step` holds: its items other than the train state (each a
    folder; older checkpoints lack the parts added since)."""
    folder = os.path.join(self.directory, str(step))
    return sorted(name for name in os.listdir(folder) if name != _STATE and
                  not name.startswith((".", "_")) and os.path.isdir(os.path.join(folder, name)))

  def _move_aside(self, step: int, reason: str) -> None:
    """Renames checkpoint `step` to `corrupt-<step>` (process 0; every process waits)."""
    source = os.path.join(self.directory, str(step))
    target = os.path.join(self.directory, f"corrupt-{step}")
    suffix = 0
    while os.path.exists(target):
      suffix += 1
      target = os.path.join(self.directory, f"corrupt-{step}-{suffix}")
    if jax.process_index() == 0:
      os.rename(source, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
    if jax.process_index() == 0:
      logging.warning("checkpoint %d does not read (%s): moved to %s; resuming from an older "
                      "one.", step, reason, target)

  def close(self) -> None:
    self._manager.close()
